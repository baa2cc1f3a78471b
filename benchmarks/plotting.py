"""The one grouped-bar chart the benchmark scripts draw (matplotlib, written to a file)."""

from __future__ import annotations

from collections.abc import Sequence


def grouped_bars(
    path: str, groups: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], ylabel: str, title: str,
    log: bool = False,
) -> None:
    """One bar per (group, series) value, series side by side within a group; None values leave a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        at = [(i + (j - (len(series) - 1) / 2) * width, v) for i, v in enumerate(values) if v]
        ax.bar([x for x, _ in at], [v for _, v in at], width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
