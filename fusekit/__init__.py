"""fusekit: fused neural-network layers as cuDNN frontend graphs, with a plan cache.

    import fusekit
    y = fusekit.conv_bias_relu(x, w, b, padding=1)   # x, w, b: CuPy arrays or torch CUDA tensors
"""

from .autotune import TuneOptions, TuneResult, autotune, autotune_shapes
from .cache import DiskStore, Plan, PlanCache, PlanKey, configure, default_cache
from .errors import FusekitError, NoGPUError, OperandError, PatternError, UnsupportedError
from .ops import (
    FusionWarning,
    LayoutWarning,
    call,
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
    plan_for,
    relu_backward,
)
from .patterns import Pattern, get_pattern, list_patterns, load_pattern, parse_pattern
from .tensors import TensorSpec, nhwc
from . import pool  # noqa: E402  (CuPy pooling and softmax kernels)

__version__ = "0.1.0"

__all__ = [
    "Pattern", "Plan", "PlanCache", "PlanKey", "TensorSpec", "DiskStore", "TuneOptions", "TuneResult",
    "autotune", "autotune_shapes", "configure",
    "FusekitError", "NoGPUError", "OperandError", "PatternError", "UnsupportedError",
    "call", "conv2d", "conv_bias", "conv_bias_relu", "plan_for", "default_cache", "FusionWarning", "LayoutWarning",
    "conv2d_backward", "conv_bias_backward", "conv_bias_relu_backward", "relu_backward",
    "conv_transpose_bias", "conv_transpose_bias_relu", "conv_transpose_bias_relu_backward",
    "linear_bias", "linear_bias_relu", "linear_bias_backward", "linear_bias_relu_backward",
    "get_pattern", "list_patterns", "load_pattern", "parse_pattern", "nhwc",
]
