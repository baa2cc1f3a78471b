"""What the benchmark scripts write: results files (JSON + markdown), the grouped-bar chart, profile text."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import Any


def write_results(stem: str, meta: dict, recs: list[dict], markdown: str) -> None:
    """<stem>.json ({"meta", "records"}) and <stem>.md; called after every case, so a run cut short
    keeps what it measured."""
    with open(stem + ".json", "w") as fh:
        json.dump({"meta": meta, "records": recs}, fh, indent=2)
    with open(stem + ".md", "w") as fh:
        fh.write(markdown)


def profiled(fn: Callable[[], Any], n: int, finish: Callable[[], Any] | None = None) -> Any:
    """A cProfile.Profile of ``n`` calls of ``fn`` (then ``finish()``, e.g. a device synchronize, inside it)."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    if finish is not None:
        finish()
    prof.disable()
    return prof


def profile_text(prof: Any, order: str, rows: int, width: int = 200) -> str:
    """A cProfile.Profile's top ``rows`` functions by ``order`` (pstats' table, lines cut at ``width``)."""
    import pstats

    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(order).print_stats(rows)
    return "\n".join(ln[:width] for ln in s.getvalue().splitlines() if ln.strip())


def grouped_bars(
    path: str, groups: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], ylabel: str, title: str,
    log: bool = False,
) -> None:
    """One bar per (group, series) value, series side by side within a group; None values leave a gap
    (a series of None only is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series = [(label, values) for label, values in series if any(values)]  # a peer not run (all None) takes no slot
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        at = [(i + (j - (len(series) - 1) / 2) * width, v) for i, v in enumerate(values) if v]
        ax.bar([x for x, _ in at], [v for _, v in at], width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 3.0, 5.0)))  # labels 0.9 and 1 would overlap
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
