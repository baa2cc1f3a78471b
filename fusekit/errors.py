"""fusekit's exceptions. Every error a user can cause is a FusekitError raised before cuDNN runs."""

from __future__ import annotations

import warnings
from typing import Any


class FusekitError(Exception):
    """Base class of every error fusekit raises on purpose."""


class PatternError(FusekitError):
    """A pattern file is malformed (unknown op, undefined operand, missing output, ...)."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"pattern {source}: {message}")
        self.source = source


class OperandError(FusekitError, ValueError):
    """An operand (array or attribute) does not fit the pattern; names the operand and what was expected."""

    def __init__(self, pattern: str, operand: str, message: str, what: str = "operand") -> None:
        super().__init__(f"{pattern}: {what} '{operand}': {message}")
        self.pattern = pattern
        self.operand = operand


class ArityError(FusekitError, TypeError):
    """A pattern called with the wrong number of array operands."""


class UnsupportedError(FusekitError):
    """cuDNN has no engine for a graph (after every fallback fusekit knows)."""


class NoGPUError(FusekitError):
    """The operation needs a CUDA GPU, an array library (CuPy or PyTorch) or cuDNN, and none is usable."""


class FusionWarning(UserWarning):
    """A fused graph has no cuDNN engine for a key; fusekit runs it as separate graphs."""


class LayoutWarning(UserWarning):
    """A pattern has no cuDNN engine for NCHW operands; fusekit runs it on channels-last copies."""


class CacheWarning(UserWarning):
    """A plan-cache entry was ignored (corrupt, foreign versions or GPU) and rebuilt."""


class NumericsWarning(UserWarning):
    """A float32 key runs on TF32 tensor cores although the numerics policy asks for IEEE float32
    (``fusekit.configure(allow_tf32=...)``): cuDNN offers no IEEE plan for it. Warned once per key
    and process; ``warnings.filterwarnings("error", category=fusekit.NumericsWarning)`` makes it an error."""


class TorchFallbackWarning(UserWarning):
    """A fusekit.torch module got an input fusekit's graphs do not take (a CPU tensor, float64, an
    unsupported rank) and ran PyTorch's own implementation instead."""


class WorkspaceWarning(UserWarning):
    """A plan's cuDNN workspace could not be allocated even after freeing cached memory; the call
    runs on a plan of the same key with a smaller workspace (warned once per key and process)."""


class CaptureError(FusekitError):
    """A call needs work that a CUDA-graph capture forbids (a plan build, a new cuDNN handle): warm up first."""


class SettingError(FusekitError, ValueError):
    """A setting (a ``FUSEKIT_*`` environment variable or a ``fusekit.configure`` argument) has a value fusekit cannot use."""

    def __init__(self, var: str, value: object, expected: str) -> None:
        super().__init__(f"{var}={value!r} is invalid: expected {expected}")
        self.var = var
        self.value = value


class PatternWarning(UserWarning):
    """A pattern directory or file was skipped (missing directory in $FUSEKIT_PATTERNS, unreadable file)."""


def import_or_explain(module: str, user: str, install: str, label: str = "") -> Any:
    """``importlib.import_module(module)``, or an ImportError (ModuleNotFoundError when it is missing)
    saying that ``user`` needs it (``label``: its usual name) and what to install; ``except ImportError`` still catches it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or module).split(".")[0] == module
        raise (ModuleNotFoundError if missing else ImportError)(
            f"{user} needs {label or module}, which {'is not installed' if missing else 'failed to import'} ({e}); install {install}",
            name=module,
        ) from None


def warn_once(key: tuple, message: str, category: type[Warning], stacklevel: int = 2) -> bool:
    """``warnings.warn(message, category)`` the first time this process meets ``key`` for
    ``category`` (keys such as a pattern name, a plan key or a module name); True if it warned."""
    from .session import current

    said, k = current().warned, (category.__name__, *key)
    if k in said:
        return False
    said.add(k)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


def forget_warnings() -> None:
    """Forget which warnings were given, so that each warns once more (tests)."""
    from .session import current

    current().warned.clear()
