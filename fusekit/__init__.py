"""fusekit: fused neural-network layers as cuDNN frontend graphs, with a plan cache.

    import fusekit
    y = fusekit.conv_bias_relu(x, w, b, padding=1)   # x, w, b: CuPy arrays or torch CUDA tensors

Layers, each importing only from the ones below it:
  integrations   fusekit.torch, fusekit.nn (and the CLI)
  ops            fusekit.ops: conv, linear, norm, pool (pooling and softmax)
  dispatch       fusekit.dispatch: operands -> key -> plan -> execute, with the fallbacks
  engine         fusekit.engine: patterns, oracle, lower, keys, cache, autotune, planner, runtime
  base           fusekit.tensors (specs), fusekit.adapters (CuPy, PyTorch, DLPack), fusekit.errors, fusekit.config,
                 fusekit.session (the one owner of runtime state: call table, decisions, tapes, default cache)
"""

import sys as _sys

from . import session
from .config import __version__, settings
from .dispatch import call, plan_for, release
from .engine.autotune import TuneOptions, TuneResult, autotune, autotune_shapes
from .engine.cache import DiskStore, Plan, PlanCache, PlanKey, configure, default_cache
from .engine.patterns import Pattern, get_pattern, list_patterns, load_pattern, parse_pattern
from .errors import (
    ArityError,
    CacheWarning,
    CaptureError,
    FusekitError,
    FusionWarning,
    LayoutWarning,
    NoGPUError,
    NumericsWarning,
    OperandError,
    PatternError,
    PatternWarning,
    SettingError,
    UnsupportedError,
    WorkspaceWarning,
)
from .ops import (
    conv2d,
    conv2d_backward,
    conv_bias,
    conv_bias_backward,
    conv_bias_relu,
    conv_bias_relu_backward,
    conv_transpose_bias,
    conv_transpose_bias_relu,
    conv_transpose_bias_relu_backward,
    linear_bias,
    linear_bias_backward,
    linear_bias_relu,
    linear_bias_relu_backward,
    pool,
    relu_backward,
)
from .engine import oracle, patterns
from .tensors import TensorSpec, nhwc

# Module paths from before the engine/ and ops/ packages keep working (``import fusekit.pool``,
# ``fusekit.oracle.evaluate``, ``fusekit.patterns.register``).
for _name, _mod in (("pool", pool), ("oracle", oracle), ("patterns", patterns)):
    _sys.modules[f"{__name__}.{_name}"] = _mod

__all__ = [
    "__version__",
    "Pattern", "Plan", "PlanCache", "PlanKey", "TensorSpec", "DiskStore", "TuneOptions", "TuneResult",
    "autotune", "autotune_shapes", "configure", "settings", "session",
    "ArityError", "FusekitError", "NoGPUError", "OperandError", "PatternError", "UnsupportedError",
    "CacheWarning", "CaptureError", "FusionWarning", "LayoutWarning", "PatternWarning", "SettingError",
    "NumericsWarning", "WorkspaceWarning",
    "call", "conv2d", "conv_bias", "conv_bias_relu", "plan_for", "release", "default_cache",
    "conv2d_backward", "conv_bias_backward", "conv_bias_relu_backward", "relu_backward",
    "conv_transpose_bias", "conv_transpose_bias_relu", "conv_transpose_bias_relu_backward",
    "linear_bias", "linear_bias_relu", "linear_bias_backward", "linear_bias_relu_backward",
    "get_pattern", "list_patterns", "load_pattern", "parse_pattern", "nhwc", "pool", "oracle", "patterns",
]
