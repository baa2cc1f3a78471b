"""Every ``FUSEKIT_*`` setting, parsed and checked in one place (read when asked, so tests and users
can change the environment at run time), and the package version."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from . import session
from .errors import SettingError

__version__ = "0.1.0"

#: name -> (meaning, what applies when unset)
SETTINGS: dict[str, tuple[str, str]] = {
    "FUSEKIT_PATTERNS": ("extra pattern directories (os.pathsep-separated), searched first", "shipped patterns only"),
    "FUSEKIT_CACHE_DIR": ("plan cache directory, or off / none / 0 for memory only", "the user cache directory"),
    "FUSEKIT_CACHE_SIZE": ("plans kept in memory (LRU)", "512"),
    "FUSEKIT_MODE": ("heuristic (first plan offered) or autotune (time every candidate on first use)", "heuristic"),
    "FUSEKIT_ALLOW_TF32": (
        "op families whose float32 graphs may run on TF32 tensor cores: conv, matmul, all or none (1/0), or a comma list",
        "PyTorch's switches where PyTorch is imported, else conv (PyTorch's defaults)",
    ),
}
MODES = ("heuristic", "autotune")
_OFF = ("off", "none", "0")


def disk_cache_off() -> bool:
    """True when $FUSEKIT_CACHE_DIR turns the on-disk plan cache off."""
    return os.environ.get("FUSEKIT_CACHE_DIR", "").lower() in _OFF


def _file_in_the_way(path: Path) -> Path | None:
    """The existing non-directory at ``path`` or above it (so no directory can be made there), else None."""
    for p in (path, *path.parents):
        try:
            if p.exists():
                return None if p.is_dir() else p
        except OSError:  # a directory above it the user cannot enter: not a file in the way (the store's own checks say more)
            return None
    return None


def cache_dir() -> Path:
    """$FUSEKIT_CACHE_DIR, else the user cache directory (platformdirs) / fusekit.

    Raises SettingError when $FUSEKIT_CACHE_DIR names a file or a path below one."""
    env = os.environ.get("FUSEKIT_CACHE_DIR")
    if env and env.lower() not in _OFF:
        return checked_cache_dir(env, "FUSEKIT_CACHE_DIR")
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusekit", appauthor=False))


def checked_cache_dir(value: str | os.PathLike[str], setting: str = "cache_dir") -> Path:
    """``value`` as a cache directory path; SettingError if it is a file or below one."""
    path = Path(value).expanduser()
    blocker = _file_in_the_way(path)
    if blocker is not None:
        where = "is a file" if blocker == path else f"is below the file {blocker}"
        raise SettingError(setting, str(value), f"a directory, or off / none / 0 (it {where})")
    return path


#: The most plans a memory cache may be asked to keep (each holds a built cuDNN plan).
MAX_CACHE_SIZE = 1_000_000


def checked_cache_size(value: object, setting: str = "maxsize") -> int:
    """``value`` as a number of plans kept in memory: an int (or ASCII digits) from 1 to MAX_CACHE_SIZE."""
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        n = int(value.strip())
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        n = 0
    if not 1 <= n <= MAX_CACHE_SIZE:
        raise SettingError(setting, str(value), f"an integer from 1 to {MAX_CACHE_SIZE:,} (plans kept in memory)")
    return n


def cache_size() -> int:
    """$FUSEKIT_CACHE_SIZE (default 512); SettingError unless it is an integer from 1 to MAX_CACHE_SIZE."""
    return checked_cache_size(os.environ.get("FUSEKIT_CACHE_SIZE", "512"), "FUSEKIT_CACHE_SIZE")


def mode() -> str:
    """$FUSEKIT_MODE (default "heuristic"); SettingError unless it is one of MODES."""
    raw = os.environ.get("FUSEKIT_MODE", "heuristic")
    if raw not in MODES:
        raise SettingError("FUSEKIT_MODE", raw, f"one of {', '.join(MODES)}")
    return raw


@dataclass(frozen=True)
class Tf32Policy:
    """The numerics policy: which op families' float32 graphs may run on TF32 tensor cores (inputs
    rounded to 10 mantissa bits: about 1e-3 relative error instead of float32's 1e-6, for several times
    the speed). The other families' float32 keys get IEEE float32 plans only. The defaults are
    PyTorch's: ``torch.backends.cudnn.allow_tf32`` (convolutions) is True and
    ``torch.backends.cuda.matmul.allow_tf32`` (matmuls, so Linear layers) is False. Where PyTorch is
    imported fusekit follows those two switches as they are set; ``fusekit.configure(allow_tf32=...)``
    or $FUSEKIT_ALLOW_TF32 overrides them.
    Float16 and bfloat16 keys, and graphs without a convolution or matmul, are not affected."""

    conv: bool = True  # conv_fprop, conv_dgrad, conv_wgrad (so transposed convolutions too)
    matmul: bool = False  # matmul (linear layers and their gradients)

    def allows(self, family: str) -> bool:
        """Whether float32 graphs of op ``family`` ("conv" or "matmul") may use TF32."""
        return bool(getattr(self, family))

    def __str__(self) -> str:
        on = [f for f in TF32_FAMILIES if self.allows(f)]
        return "all" if len(on) == len(TF32_FAMILIES) else ",".join(on) or "none"


#: The op families the numerics policy names.
TF32_FAMILIES: tuple[str, ...] = tuple(f.name for f in fields(Tf32Policy))
#: What ``allow_tf32`` takes: True / False for every family; {family: bool} (families left out keep
#: PyTorch's default); a string as $FUSEKIT_ALLOW_TF32 takes; a Tf32Policy; None for the defaults.
Tf32Setting = bool | str | Mapping[str, bool] | Tf32Policy | None
_YES = ("1", "true", "yes", "on", "all")
_NO = ("0", "false", "no", "off", "none")
_TF32_EXPECTED = (
    f"True / False, a mapping of {' / '.join(TF32_FAMILIES)} to bools, or a string: all, none, default, "
    f"1 / 0 or a comma list of {', '.join(TF32_FAMILIES)}"
)


def tf32_policy(value: Tf32Setting, name: str = "allow_tf32") -> Tf32Policy:
    """The policy ``value`` names (see Tf32Setting): None, "" or "default" give PyTorch's defaults;
    "all" / "none" (1 / 0, true / false, on / off) every family or none; "conv", "matmul" or
    "conv,matmul" exactly those families. SettingError naming ``name`` for anything else."""
    if value is None or isinstance(value, Tf32Policy):
        return value or Tf32Policy()
    if isinstance(value, bool):
        return Tf32Policy(**{f: value for f in TF32_FAMILIES})
    if isinstance(value, str):
        raw = value.strip().lower()
        if raw in ("", "default"):
            return Tf32Policy()
        if raw in _YES or raw in _NO:
            return tf32_policy(raw in _YES)
        named = {part.strip() for part in raw.replace("+", ",").split(",") if part.strip()}
        if named and named <= set(TF32_FAMILIES):
            return Tf32Policy(**{f: f in named for f in TF32_FAMILIES})
    elif isinstance(value, Mapping) and set(value) <= set(TF32_FAMILIES) and all(isinstance(v, bool) for v in value.values()):
        return Tf32Policy(**dict(value))
    raise SettingError(name, value, _TF32_EXPECTED)


def torch_tf32_flags() -> tuple[bool, bool] | None:
    """PyTorch's switches, (``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.allow_tf32``;
    the latter is what ``torch.set_float32_matmul_precision`` sets), once PyTorch is imported; else None.
    Cheap enough for every call's dispatch key (two C getters)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return (torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32())
    except AttributeError:  # a PyTorch without the getters: its public flags
        try:
            return (bool(torch.backends.cudnn.allow_tf32), bool(torch.backends.cuda.matmul.allow_tf32))
        except AttributeError:  # PyTorch still importing
            return None


def allow_tf32() -> Tf32Policy:
    """The numerics policy in force: the one ``fusekit.configure(allow_tf32=...)`` set, else
    $FUSEKIT_ALLOW_TF32, else PyTorch's own switches (:func:`torch_tf32_flags`) where PyTorch is
    imported, else PyTorch's defaults. SettingError if the variable is invalid. Read when a call's plan
    key is made; dispatch keys carry PyTorch's switches, so flipping one re-resolves the calls."""
    chosen = session.current().tf32_policy  # what fusekit.configure(allow_tf32=...) set, if anything
    if chosen is not None:
        return chosen
    raw = os.environ.get("FUSEKIT_ALLOW_TF32", "")
    if raw.strip():  # set and not empty
        return tf32_policy(raw, "FUSEKIT_ALLOW_TF32")
    flags = torch_tf32_flags()
    return Tf32Policy() if flags is None else Tf32Policy(conv=flags[0], matmul=flags[1])


def set_allow_tf32(value: Tf32Setting) -> None:
    """Set the process's numerics policy (None: back to $FUSEKIT_ALLOW_TF32 or the defaults). Use
    ``fusekit.configure(allow_tf32=...)``, which also drops the calls already resolved (they would
    keep running the plans of the old policy)."""
    session.current().tf32_policy = None if value is None else tf32_policy(value)


def pattern_dirs_from_env() -> list[Path]:
    """The directories named by $FUSEKIT_PATTERNS, in order."""
    return [Path(d) for d in os.environ.get("FUSEKIT_PATTERNS", "").split(os.pathsep) if d]


def problems() -> list[str]:
    """One line per invalid setting (empty when every setting is usable); ``fusekit doctor`` shows them."""
    out = []
    for read in (cache_dir, cache_size, mode, allow_tf32):
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


# ----------------------------------------------------------------------------------------------
# tunables: knobs of the runtime's choices, read where they apply, overridden in a scope
# ----------------------------------------------------------------------------------------------
@dataclass
class Tunables:
    """The runtime's knobs, one home (read as ``config.TUNABLES.<name>``; change them in a scope with
    :func:`settings`)."""

    #: A split route (separate graphs) replaces the fused graph only when it measured at least this
    #: fraction of the fused time (timing noise must not flip the choice).
    split_margin: float = 0.97
    #: Whether ``dispatch.taped`` replays recordings (False: it always runs the op).
    tapes: bool = True
    #: Recordings kept before the tape table starts over (keys that keep changing).
    tape_limit: int = 4096
    #: Whether calls execute through the frontend's raw-pointer entry (engine.lower.native_execute).
    native_execute: bool = True
    #: Channel counts below this run reductions on rows of several pixels (ops.common.channel_rows).
    row_channels: int = 32
    #: Age in seconds after which a store's temporary file counts as left over by a dead writer.
    leftover_age_s: float = 600.0


TUNABLES = Tunables()

_TUNABLE_CHECKS: dict[str, tuple[type, float, float]] = {  # name -> (type, lowest, highest)
    "split_margin": (float, 0.0, 1.0), "tape_limit": (int, 1, 10**7), "row_channels": (int, 1, 4096),
    "leftover_age_s": (float, 0.0, 10**9),
}


def _checked_tunable(name: str, value: object) -> object:
    if name not in _TUNABLE_CHECKS:  # a switch
        if not isinstance(value, bool):
            raise SettingError(name, value, "True or False")
        return value
    kind, lo, hi = _TUNABLE_CHECKS[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    if not ok or not lo <= float(value) <= hi:
        raise SettingError(name, value, f"{'a number' if kind is float else 'an integer'} from {lo:g} to {hi:g}")
    return kind(value)


@contextmanager
def settings(**overrides: object) -> Iterator[Tunables]:
    """``with fusekit.settings(split_margin=0.9, tapes=False): ...``: the named :class:`Tunables`
    take these values inside the block and their previous ones after it (process-wide, not per
    thread). Unknown names and bad values raise SettingError before anything changes."""
    known = {f.name for f in fields(Tunables)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise SettingError(unknown[0], overrides[unknown[0]], f"a tunable: one of {', '.join(sorted(known))}")
    values = {k: _checked_tunable(k, v) for k, v in overrides.items()}
    before = {k: getattr(TUNABLES, k) for k in values}
    for k, v in values.items():
        setattr(TUNABLES, k, v)
    try:
        yield TUNABLES
    finally:
        for k, v in before.items():
            setattr(TUNABLES, k, v)
