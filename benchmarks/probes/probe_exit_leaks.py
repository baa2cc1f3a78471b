"""Who holds the cuDNN frontend's nanobind objects when an example exits? (2026-12-05: realuse's
`examples/train_resnet.py --graphed --control` printed "nanobind: leaked 520 instances" at exit.)

    python benchmarks/probes/probe_exit_leaks.py EXAMPLE [ARGS...] [--release] [--no-exit-hook]

Runs the example's main() in this process, then counts the frontend's live objects by the container
that refers to them (walking gc-tracked containers: module dicts, instance dicts, lists, tuples,
closures). With --release, fusekit.release() runs first, as its exit hook does; --no-exit-hook
unregisters that hook (the state before it existed). Whether nanobind
still reports a leak is printed by the interpreter after this script's own output."""

from __future__ import annotations

import collections
import gc
import runpy
import sys


def frontend_objects() -> collections.Counter:
    """(referrer description) -> how many frontend instances it refers to."""
    holders: collections.Counter = collections.Counter()
    total = 0
    for c in gc.get_objects():
        for r in gc.get_referents(c):
            if str(getattr(type(r), "__module__", "")).startswith("cudnn._compiled_module"):
                total += 1
                owner = type(c).__name__
                if isinstance(c, dict):
                    for m in (sys.modules.get(n) for n in list(sys.modules)):
                        if m is not None and getattr(m, "__dict__", None) is c:
                            owner = f"module {m.__name__}"
                            break
                holders[(owner, type(r).__name__)] += 1
    holders[("total references", "")] = total
    return holders


def main() -> None:
    args = sys.argv[1:]
    release = "--release" in args
    if "--no-exit-hook" in args:
        import atexit

        import fusekit.dispatch

        atexit.unregister(fusekit.dispatch._release_at_exit)
    args = [a for a in args if a not in ("--release", "--no-exit-hook")]
    path, rest = args[0], args[1:]
    sys.argv = [path, *rest]
    ns = runpy.run_path(path, run_name="probe")
    ns["main"]()
    gc.collect()
    print("after main():")
    for (owner, kind), n in frontend_objects().most_common(15):
        print(f"  {n:5d}  {kind:28s} <- {owner}")
    if release:
        import fusekit

        fusekit.release()
        gc.collect()
        print("after fusekit.release():")
        for (owner, kind), n in frontend_objects().most_common(15):
            print(f"  {n:5d}  {kind:28s} <- {owner}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
