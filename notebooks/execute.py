"""Execute the notebooks on this machine (GPU cells run for real where PyTorch sees a CUDA GPU),
write the executed copies and export their key figures as PNGs.

    python notebooks/execute.py                      # every notebooks/*.ipynb
    python notebooks/execute.py 05_pipeline 01       # those named (stem, prefix or path)
    python notebooks/execute.py --out DIR --figures DIR

Executed copies go to ``--out`` (default ``$OUT/notebooks``, or ``build/notebooks`` when ``OUT`` is
unset). Key figures: a code cell tagged ``figure:NAME`` (cell metadata ``tags``) has its image/png
outputs written to ``--figures`` as ``<notebook>_<NAME>.png`` (``<notebook>_<NAME>_<k>.png`` from the
second PNG of one cell on); a bare ``figure`` tag names them by the cell's rank among the tagged
cells. Only tagged cells are exported, so the names do not depend on which branch a cell took.

Needs nbformat, nbclient and ipykernel (the kernel is ipykernel's native ``python3``, started with
this interpreter). The kernel gets this repository on ``PYTHONPATH`` and matplotlib's inline backend.
Prints one line per notebook (time, figures, the error if any) and exits 1 if any notebook failed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INLINE = "module://matplotlib_inline.backend_inline"


def figure_names(nb, stem: str) -> dict[int, str]:
    """Cell index -> figure base name for every code cell tagged ``figure`` or ``figure:NAME``."""
    names, rank = {}, 0
    for i, cell in enumerate(nb.cells):
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t == "figure" or t.startswith("figure:")]
        if cell.get("cell_type") != "code" or not tags:
            continue
        rank += 1
        label = tags[0].partition(":")[2].strip() or str(rank)
        names[i] = f"{stem}_{label}"
    return names


def export_figures(nb, stem: str, directory: Path) -> tuple[list[str], list[str]]:
    """Write the PNG outputs of the tagged cells; returns (files written, tagged cells without a PNG)."""
    written, missing = [], []
    for i, base in figure_names(nb, stem).items():
        pngs = [o["data"]["image/png"] for o in nb.cells[i].get("outputs", [])
                if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
        if not pngs:
            missing.append(base)
        for k, data in enumerate(pngs):
            name = f"{base}.png" if k == 0 else f"{base}_{k + 1}.png"
            directory.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(base64.b64decode("".join(data) if isinstance(data, list) else data))
            written.append(name)
    return written, missing


def resolve(names: list[str]) -> list[Path]:
    every = sorted(HERE.glob("*.ipynb"))
    if not names:
        return every
    out = []
    for n in names:
        p = Path(n)
        if p.suffix == ".ipynb" and p.exists():
            out.append(p.resolve())
            continue
        hits = [q for q in every if q.stem == n] or [q for q in every if q.stem.startswith(n)]
        if len(hits) != 1:
            raise SystemExit(f"execute.py: {n!r} names {len(hits)} notebooks in {HERE} (have: {', '.join(q.stem for q in every)})")
        out.append(hits[0])
    return out


def prepare_environment() -> None:
    """What the kernel (a child process) inherits: fusekit importable, inline figures, writable
    Jupyter/IPython/matplotlib directories even where $HOME is not writable."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        paths.append(str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ["MPLBACKEND"] = INLINE  # a non-inline backend (Agg) would make the figures vanish
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    home = Path(os.path.expanduser("~"))
    if not (home.is_dir() and os.access(home, os.W_OK)):
        scratch = Path(tempfile.gettempdir()) / "fusekit-notebooks-home"
        for var, sub in (("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data"),
                         ("JUPYTER_CONFIG_DIR", "jupyter-config"), ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "matplotlib")):
            if var not in os.environ:
                (scratch / sub).mkdir(parents=True, exist_ok=True)
                os.environ[var] = str(scratch / sub)


def kernel_check(kernel_name: str) -> str:
    """The kernel's command line, or raise with what is missing."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    argv = [sys.executable if a in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}") else a for a in spec.argv]
    return f"{' '.join(argv)} (spec {spec.resource_dir})"  # jupyter_client runs a bare "python" as this interpreter


def error_text(nb, exc: BaseException) -> str:
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                return f"{o.get('ename')}: {o.get('evalue')}".strip()[:500]
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500] if str(exc) else type(exc).__name__


def execute(path: Path, out_dir: Path, fig_dir: Path | None, kernel_name: str, cell_timeout: int) -> dict:
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=cell_timeout, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except BaseException as e:  # a cell error, a timeout or a dead kernel: report it, keep going
        if isinstance(e, KeyboardInterrupt):
            raise
        error = error_text(nb, e)
    took = time.perf_counter() - t0
    # nbclient answers SIGINT/SIGTERM (Ctrl-C, an outer `timeout`) by shutting the kernel down and
    # carrying on; it leaves this future behind, and the caller stops after this notebook
    signalled = getattr(client, "_async_cleanup_kernel_future", None) is not None
    if signalled and error is None:
        error = "stopped by a signal (SIGINT/SIGTERM)"
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    figures, missing = export_figures(nb, path.stem, fig_dir) if fig_dir is not None else ([], [])
    return {"notebook": path.name, "seconds": round(took, 1), "ok": error is None, "error": error,
            "figures": figures, "figures_missing": missing, "signalled": signalled}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="notebook stems, prefixes (05) or paths; default: all in notebooks/")
    default_out = Path(os.environ["OUT"]) / "notebooks" if os.environ.get("OUT") else ROOT / "build" / "notebooks"
    ap.add_argument("--out", type=Path, default=default_out, help=f"directory for the executed copies (default {default_out})")
    ap.add_argument("--figures", type=Path, default=None, help="directory for the key figures' PNGs (default: none exported)")
    ap.add_argument("--kernel", default="python3", help="kernel name (default python3: ipykernel with this interpreter)")
    ap.add_argument("--cell-timeout", type=int, default=300, help="seconds one cell may run (default 300)")
    args = ap.parse_args(argv)

    paths = resolve(args.notebooks)
    prepare_environment()
    try:
        import nbclient
        import nbformat

        argv_line = kernel_check(args.kernel)
    except Exception as e:  # noqa: BLE001
        print(f"execute.py: cannot run notebooks here ({type(e).__name__}: {e}); needs nbformat, nbclient, "
              "jupyter_client and ipykernel", file=sys.stderr)
        return 2
    import platform

    print(f"python {platform.python_version()}, nbclient {nbclient.__version__}, nbformat {nbformat.__version__}; "
          f"kernel {args.kernel}: {argv_line}", flush=True)
    results = []
    for path in paths:
        r = execute(path, args.out, args.figures, args.kernel, args.cell_timeout)
        results.append(r)
        status = "ok" if r["ok"] else "FAILED"
        figs = ", ".join(r["figures"]) or "none"
        print(f"{r['notebook']}: {status} in {r['seconds']:.1f} s; figures: {figs}"
              + (f"; no PNG from {', '.join(r['figures_missing'])}" if r["figures_missing"] else "")
              + (f"\n    error: {r['error']}" if r["error"] else ""), flush=True)
        if r["signalled"]:
            print("stopped by a signal: the remaining notebooks are not run", flush=True)
            break
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    failed = [r["notebook"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f"; executed copies in {args.out}"
          + (f", figures in {args.figures}" if args.figures else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
