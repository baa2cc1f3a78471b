"""Every ``FUSEKIT_*`` setting, parsed in one place (read when asked, so tests and users can change
the environment at run time), and the package version."""

from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"

#: name -> (meaning, what applies when unset)
SETTINGS: dict[str, tuple[str, str]] = {
    "FUSEKIT_PATTERNS": ("extra pattern directories (os.pathsep-separated), searched first", "shipped patterns only"),
    "FUSEKIT_CACHE_DIR": ("plan cache directory, or off / none / 0 for memory only", "the user cache directory"),
    "FUSEKIT_CACHE_SIZE": ("plans kept in memory (LRU)", "512"),
    "FUSEKIT_MODE": ("heuristic (first plan offered) or autotune (time every candidate on first use)", "heuristic"),
}
MODES = ("heuristic", "autotune")
_OFF = ("off", "none", "0")


def disk_cache_off() -> bool:
    """True when $FUSEKIT_CACHE_DIR turns the on-disk plan cache off."""
    return os.environ.get("FUSEKIT_CACHE_DIR", "").lower() in _OFF


def cache_dir() -> Path:
    """$FUSEKIT_CACHE_DIR, else the user cache directory (platformdirs) / fusekit."""
    env = os.environ.get("FUSEKIT_CACHE_DIR")
    if env and env.lower() not in _OFF:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusekit", appauthor=False))


def cache_size() -> int:
    """$FUSEKIT_CACHE_SIZE (default 512)."""
    raw = os.environ.get("FUSEKIT_CACHE_SIZE", "512")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"FUSEKIT_CACHE_SIZE must be an integer >= 1, got {raw!r}") from None
    return n


def mode() -> str:
    """$FUSEKIT_MODE (default "heuristic")."""
    return os.environ.get("FUSEKIT_MODE", "heuristic")


def pattern_dirs_from_env() -> list[Path]:
    """The directories named by $FUSEKIT_PATTERNS, in order."""
    return [Path(d) for d in os.environ.get("FUSEKIT_PATTERNS", "").split(os.pathsep) if d]


def describe() -> list[tuple[str, str]]:
    """(variable, value or what applies when unset) for every setting (``fusekit doctor``)."""
    return [(var, os.environ.get(var, f"(unset: {unset})")) for var, (_, unset) in SETTINGS.items()]
