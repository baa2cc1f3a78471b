"""``fusekit cache ls|show|clear|export|import|verify``: the on-disk plan cache (no GPU)."""

from __future__ import annotations

import contextlib
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import Any

import click

from fusekit import config
from fusekit.engine.cache import DiskStore, Entry, EntryError, PlanKey
from fusekit.engine.patterns import get_pattern
from fusekit.errors import FusekitError
from fusekit.tensors import matches, nchw_strides, nhwc_strides, view_shape

from .common import (
    CliError,
    Group,
    cache_dir_option,
    candidate_table,
    console,
    emit,
    fmt_attrs,
    fmt_bytes,
    fmt_value,
    friendly,
    is_int,
    one_line,
    plural,
    pretty_json,
    setting,
    speedup_line,
    table,
    text,
    time_of,
    tuning_summary,
)


def _store(cache_dir: Path | None) -> DiskStore:
    if cache_dir is not None:
        return DiskStore(cache_dir)
    if config.disk_cache_off():
        raise CliError(f"the disk plan cache is off (FUSEKIT_CACHE_DIR={setting('FUSEKIT_CACHE_DIR')}); give --cache-dir DIR")
    return DiskStore()


def _cudnn_version(v: Any) -> str:
    """cudnnGetVersion's number as text: 91000 -> 9.10.0 (cuDNN 9), 8906 -> 8.9.6 (cuDNN 8)."""
    if not is_int(v) or v <= 0:
        return str(v)
    if v >= 90000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _entry_shapes(key: PlanKey) -> tuple[str, str]:
    """(operand shapes as --shape takes them '-> outputs', non-default attributes) of a PlanKey."""
    try:
        pat = get_pattern(key.pattern)
    except FusekitError:
        pat = None
    ins, outs = [], []
    for n, spec in key.specs:
        shape = tuple(spec.shape)
        if pat is not None:
            if n in pat.operand_names:
                shape, side = view_shape(pat.operand(n).kind, shape), ins
            else:
                shape, side = view_shape(pat.output_kinds.get(n, "tensor"), shape), outs
        else:
            side = ins
        side.append(f"{n}={fmt_value(shape)}")
    shapes = " ".join(ins) + (f" -> {' '.join(outs)}" if outs else "")
    attrs = list(key.attrs)
    if pat is not None:
        defaults = {}
        for a in pat.attrs:
            try:
                defaults[a.name] = a.normalize(pat.name, a.default)
            except FusekitError:
                pass
        attrs = [(k, v) for k, v in attrs if defaults.get(k, object()) != v]
    return shapes, fmt_attrs(attrs)


def _leftover_sizes(store: DiskStore) -> dict[Path, int]:
    """{path: size} of the temporary files that interrupted writes left in the store."""
    sizes = {}
    for p in store.leftovers():
        with contextlib.suppress(FileNotFoundError):
            sizes[p] = p.stat().st_size
    return sizes


def _files(sizes: list[int]) -> str:
    """``2 leftover temporary files (1.5 MiB)``."""
    return f"{plural(len(sizes), 'leftover temporary file')} ({fmt_bytes(sum(sizes))})"


def _age() -> str:
    return f"{config.TUNABLES.leftover_age_s / 60:g} min"


def _scan(store: DiskStore) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """(valid entries, [(path, problem)]) of a store."""
    good, bad = [], []
    for p in store.entries():
        try:
            good.append(store.load(p))
        except EntryError as e:
            bad.append((p, str(e)))
        except PermissionError as e:  # the store's directories are not trusted
            bad.append((p, f"{p.name}: {e}"))
        except OSError as e:
            bad.append((p, f"{p.name}: cannot read ({e.strerror or e})"))
    return good, bad


def _decisions(store: DiskStore) -> tuple[list[list[str]], list[Path]]:
    """(table rows of the valid fused-or-split decisions, the bad decision files)."""
    rows, bad = [], []
    for p in store.decisions():
        try:
            d = store.load_fusion(p)
        except (EntryError, OSError):
            bad.append(p)
            continue
        k = d["key"]
        arrays = " ".join(f"{dt}[{fmt_value(shape)}]{_layout(shape, strides)}" for shape, dt, strides in k.get("arrays", []))
        cc = k.get("cc") or ["?", "?"]
        rows.append([
            p.stem[:12], str(k.get("tag", "?")), arrays, " ".join(fmt_value(v) for v in k.get("attrs", [])) or "-", str(k.get("mode", "?")),
            f"{k.get('gpu', '?')} sm_{cc[0]}{cc[1]}", f"{d['fused_ms'] * 1e3:.1f}", f"{d['split_ms'] * 1e3:.1f}", str(d.get("choice", "?")),
        ])
    return rows, bad


def _layout(shape: list, strides: list) -> str:
    """``:NHWC`` / ``:NCHW`` for dense 4-D arrays, ``:strided`` for other 4-D ones, else nothing."""
    if len(shape) != 4:
        return ""
    for name, canon in (("NCHW", nchw_strides), ("NHWC", nhwc_strides)):
        if matches(tuple(strides), canon(tuple(shape)), tuple(shape)):
            return f":{name}"
    return ":strided"


def _find_entry(store: DiskStore, prefix: str) -> Path:
    p = prefix.strip().lower()
    if not re.fullmatch(r"[0-9a-f]+", p):
        raise CliError(f"{prefix!r} is not a key: give the first hex digits of a KEY that `fusekit cache ls` shows")
    matches = [e for e in list(store.entries()) + list(store.decisions()) if e.stem.startswith(p)]
    if not matches:
        raise CliError(f"no stored plan or decision has a key starting with {p!r} in {store.root} (`fusekit cache ls` lists them)")
    if len(matches) > 1:
        some = ", ".join(m.stem[: max(len(p) + 4, 12)] for m in matches[:5]) + (", ..." if len(matches) > 5 else "")
        kinds = {m.suffix for m in matches}
        what = "stored plans" if kinds == {".plan"} else "fused-or-split decisions" if kinds == {".json"} else "stored plans and decisions"
        raise CliError(f"key prefix {p!r} is ambiguous: it matches {len(matches)} {what} ({some}); give more digits")
    return matches[0]


@click.group("cache", cls=Group)
def cache_group() -> None:
    """Inspect and manage the on-disk plan cache (no GPU needed).

    The directory is --cache-dir, else $FUSEKIT_CACHE_DIR, else the user cache directory.
    """


@cache_group.command("ls")
@cache_dir_option
@friendly
def cache_ls(cache_dir: Path | None) -> None:
    """Table of the stored plans: key, pattern, operand shapes, dtype, layout, GPU, cuDNN, source, engine, created."""
    store = _store(cache_dir)
    good, bad = _scan(store)
    con = console()
    if good:
        t = table(None, ["KEY", "PATTERN", "SHAPES", "ATTRS", "DTYPE", "LAYOUT", "GPU", "CUDNN", "SOURCE", "ENGINE", "CREATED"], wrap=("SHAPES", "ATTRS", "GPU", "ENGINE"))
        rows = []
        for e in good:
            k, plan = e.key, e.header.get("plan") or {}
            shapes, attrs = _entry_shapes(k)
            first = k.specs[0][1] if k.specs else None
            created = str(e.header.get("created", "-")).replace("T", " ").rstrip("Z")
            rows.append((
                k.pattern, created,
                [e.path.stem[:12], k.pattern, shapes, attrs, first.dtype if first else "-", first.layout if first else "-",
                 f"{k.gpu} sm_{k.cc[0]}{k.cc[1]}", _cudnn_version(k.cudnn_backend), str(plan.get("source", "-")),
                 str(plan.get("engine", "-")), created[:16]],
            ))
        for _, _, cells in sorted(rows, key=lambda r: (r[0], r[1])):
            t.add_row(*[text(c) for c in cells])
        emit(con, t)
    con.print(f"{plural(len(good), 'plan')} in {store.plans_dir}" + ("" if good else " (empty)"))
    decisions, bad_decisions = _decisions(store)
    if decisions:
        t = table(None, ["KEY", "CALL", "ARRAYS", "ATTRS", "MODE", "GPU", "FUSED US", "SPLIT US", "KEPT"],
                  right=("FUSED US", "SPLIT US"), wrap=("ARRAYS", "ATTRS", "GPU"))
        for row in sorted(decisions, key=lambda r: (r[1], r[4], r[2])):
            t.add_row(*[text(c) for c in row])
        emit(con)
        emit(con, t)
        con.print(f"{plural(len(decisions), 'fused-or-split decision')} in {store.fusion_dir}")
    n_bad = len(bad) + len(bad_decisions)
    if n_bad:
        con.print(f"{plural(n_bad, 'bad entry', 'bad entries')} (not listed): `fusekit cache verify` shows them, `--fix` moves them aside")
    left = _leftover_sizes(store)
    if left:
        con.print(f"{_files(list(left.values()))} from interrupted writes: `fusekit cache verify` removes those older than {_age()}")


@cache_group.command("show")
@click.argument("key")
@cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the entry's whole header as JSON only.")
@friendly
def cache_show(key: str, cache_dir: Path | None, as_json: bool) -> None:
    """Print the stored plan whose key starts with KEY: its header, and its candidate table if it was
    tuned; or the fused-or-split decision with that key: its record."""
    store = _store(cache_dir)
    path = _find_entry(store, key)
    if path.suffix == ".json":
        try:
            record = store.load_fusion(path)
        except EntryError as e:
            raise CliError(f"stored decision {path.stem[:12]} is bad ({e}); `fusekit cache verify --fix` moves it aside") from None
        except OSError as e:
            raise CliError(f"cannot read {path}: {e.strerror or e}") from None
        if not as_json:
            console().print(f"fused-or-split decision {path.stem}  ({path})")
        click.echo(pretty_json(record))
        return
    try:
        entry = store.load(path)
    except EntryError as e:
        raise CliError(f"stored plan {path.stem[:12]} is bad ({e}); `fusekit cache verify --fix` moves it aside") from None
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None
    header = entry.header
    if as_json:
        click.echo(pretty_json(header))
        return
    plan = dict(header.get("plan") or {})
    tuning = plan.get("tuning")
    cands = [c for c in tuning if isinstance(c, dict)] if isinstance(tuning, list) else []
    if cands:
        plan["tuning"] = f"{plural(len(cands), 'candidate')}: the table below (--json prints them)"
    con = console()
    con.print(f"plan {path.stem}  ({path})")
    con.print(f"  {entry.key.describe()}")
    click.echo(pretty_json({**header, "plan": plan}))
    if cands:
        con.print()
        emit(con, candidate_table(cands, "tuning candidates"))
        best, first = tuning_summary(cands)
        if best is not None and first is not None:
            bt, ft = time_of(best), time_of(first)
            con.print(speedup_line(best.get("name", "?"), bt, ft, ft / bt))  # type: ignore[operator, arg-type]


@cache_group.command("clear")
@cache_dir_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@friendly
def cache_clear(cache_dir: Path | None, yes: bool) -> None:
    """Delete every stored plan (and entries moved aside, and leftovers of interrupted writes); asks first unless --yes."""
    store = _store(cache_dir)
    n = sum(1 for _ in store.entries())
    others = sum(1 for p in store.plans_dir.glob("*/*") if p.suffix not in (".plan", ".tmp")) if store.plans_dir.is_dir() else 0
    others += sum(1 for p in store.fusion_dir.glob("*/*") if p.suffix != ".tmp") if store.fusion_dir.is_dir() else 0
    others += len(store.leftovers(config.TUNABLES.leftover_age_s))  # stale ones; clear() keeps a live writer's
    if n == 0 and others == 0:
        click.echo(f"nothing to clear: no plans in {store.plans_dir}")
        return
    if not yes:
        click.confirm(f"delete {plural(n, 'stored plan')} from {store.plans_dir}?", abort=True)
    removed = store.clear()
    click.echo(f"removed {plural(removed, 'plan')} from {store.plans_dir}" + (f" (and {plural(others, 'other file')})" if others else ""))
    kept = list(_leftover_sizes(store).values())
    if kept:
        click.echo(f"kept {_files(kept)} younger than {_age()}: a write may still be in progress")


@cache_group.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@cache_dir_option
@friendly
def cache_export(file: Path, cache_dir: Path | None) -> None:
    """Write every valid stored plan into FILE (a .tar.gz) for `fusekit cache import` elsewhere."""
    store = _store(cache_dir)
    total = sum(1 for _ in store.entries())
    try:
        n = store.export(file)
    except OSError as e:
        raise CliError(f"cannot write {os.fspath(file)}: {e.strerror or e}") from None
    skipped = total - n
    with tarfile.open(file, "r:gz") as tar:
        decisions = sum(1 for m in tar.getmembers() if m.name.startswith("fusion/"))
    click.echo(
        f"exported {plural(n, 'plan')} from {store.plans_dir} to {os.fspath(file)}"
        + (f" with {plural(decisions, 'fused-or-split decision')}" if decisions else "")
        + (f"; skipped {plural(skipped, 'bad entry', 'bad entries')} (`fusekit cache verify` shows them)" if skipped else "")
    )


@cache_group.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@cache_dir_option
@friendly
def cache_import(file: Path, cache_dir: Path | None) -> None:
    """Add the plans of FILE (from `fusekit cache export`); entries that fail their checks are skipped and reported."""
    store = _store(cache_dir)
    decisions = {p.stem for p in store.decisions()}
    try:
        n, problems = store.import_(file)
    except FileNotFoundError:
        raise CliError(f"cannot read {os.fspath(file)}: no such file") from None
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise CliError(f"{os.fspath(file)} is not a fusekit cache export (.tar.gz): {type(e).__name__}: {e}") from None
    except OSError as e:
        raise CliError(f"cannot import {os.fspath(file)}: {e.strerror or e}") from None
    new = store.imported_new
    new_decisions = len({p.stem for p in store.decisions()} - decisions)
    click.echo(f"imported {plural(n, 'plan')} into {store.plans_dir} ({new} new, {n - new} replaced)"
               + (f"; {plural(new_decisions, 'new fused-or-split decision')}" if new_decisions else ""))
    for pr in problems:
        click.echo(f"  skipped: {one_line(pr)}")
    if problems:
        raise CliError(f"{plural(len(problems), 'entry', 'entries')} of {os.fspath(file)} failed their checks and were skipped")


@cache_group.command("verify")
@cache_dir_option
@click.option("--fix", is_flag=True, help="Move bad entries aside (*.bad); they are rebuilt when next needed.")
@friendly
def cache_verify(cache_dir: Path | None, fix: bool) -> None:
    """Check every stored plan (format, checksum, key, owner and permissions); lists the bad ones and
    exits 1 unless --fix. Also removes the temporary files of interrupted writes untouched for 10
    minutes (younger ones may belong to a write in progress: they are only counted)."""
    store = _store(cache_dir)
    total = sum(1 for _ in store.entries())
    decisions = sum(1 for _ in store.decisions())
    bad = store.verify(fix=fix)
    for p, why in bad:
        click.echo(f"bad {p.stem[:12]}: {one_line(why)}")
    sizes = _leftover_sizes(store)
    removed = [sizes.get(p, 0) for p in store.remove_leftovers()]
    kept = list(_leftover_sizes(store).values())
    if removed:
        click.echo(f"removed {_files(removed)} of interrupted writes (older than {_age()})")
    if kept:
        click.echo(f"kept {_files(kept)} younger than {_age()}: a write may still be in progress")
    if not bad:
        also = f" and {plural(decisions, 'fused-or-split decision')}" if decisions else ""
        click.echo(f"checked {plural(total, 'stored plan')}{also} in {store.root}: none is bad")
        return
    if fix:
        good = plural(total + decisions - len(bad), "good plan") if not decisions else plural(total + decisions - len(bad), "good entry", "good entries")
        click.echo(f"moved {plural(len(bad), 'bad entry', 'bad entries')} aside (*.bad); kept {good}")
        return
    what = plural(total, "stored plan") + (f" and {plural(decisions, 'fused-or-split decision')}" if decisions else "")
    raise CliError(f"{len(bad)} of {what} failed their checks; `fusekit cache verify --fix` moves them aside")
