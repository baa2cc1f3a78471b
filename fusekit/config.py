"""Every ``FUSEKIT_*`` setting, parsed and checked in one place (read when asked, so tests and users
can change the environment at run time), and the package version."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SettingError

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


def _file_in_the_way(path: Path) -> Path | None:
    """The existing non-directory at ``path`` or above it (so no directory can be made there), else None."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def cache_dir() -> Path:
    """$FUSEKIT_CACHE_DIR, else the user cache directory (platformdirs) / fusekit.

    Raises SettingError when $FUSEKIT_CACHE_DIR names a file or a path below one."""
    env = os.environ.get("FUSEKIT_CACHE_DIR")
    if env and env.lower() not in _OFF:
        path = Path(env).expanduser()
        blocker = _file_in_the_way(path)
        if blocker is not None:
            where = "is a file" if blocker == path else f"is below the file {blocker}"
            raise SettingError("FUSEKIT_CACHE_DIR", env, f"a directory, or off / none / 0 (it {where})")
        return path
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusekit", appauthor=False))


def cache_size() -> int:
    """$FUSEKIT_CACHE_SIZE (default 512); SettingError unless it is an integer >= 1."""
    raw = os.environ.get("FUSEKIT_CACHE_SIZE", "512")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SettingError("FUSEKIT_CACHE_SIZE", raw, "an integer >= 1 (plans kept in memory)")
    return n


def mode() -> str:
    """$FUSEKIT_MODE (default "heuristic"); SettingError unless it is one of MODES."""
    raw = os.environ.get("FUSEKIT_MODE", "heuristic")
    if raw not in MODES:
        raise SettingError("FUSEKIT_MODE", raw, f"one of {', '.join(MODES)}")
    return raw


def pattern_dirs_from_env() -> list[Path]:
    """The directories named by $FUSEKIT_PATTERNS, in order."""
    return [Path(d) for d in os.environ.get("FUSEKIT_PATTERNS", "").split(os.pathsep) if d]


def problems() -> list[str]:
    """One line per invalid setting (empty when every setting is usable); ``fusekit doctor`` shows them."""
    out = []
    for read in (cache_dir, cache_size, mode):
        try:
            read()
        except SettingError as e:
            out.append(str(e))
    for d in pattern_dirs_from_env():
        if not d.is_dir():
            what = "a file" if d.exists() else "missing"
            out.append(f"FUSEKIT_PATTERNS names {str(d)!r}, which is {what}: expected existing directories")
    return out


def describe() -> list[tuple[str, str]]:
    """(variable, value or what applies when unset) for every setting (``fusekit doctor``)."""
    return [(var, os.environ.get(var, f"(unset: {unset})")) for var, (_, unset) in SETTINGS.items()]
