"""The two chart shapes the report needs, drawn with matplotlib (off-screen, Agg).

Charts are drawn from the same rows as the tables, so each PNG shows exactly the
figures printed next to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    xs: Sequence[float],
    series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One line per series: (median, min, max) per x, min-max as error bars."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, (med, lo, hi) in series.items():
        ax.errorbar(
            xs,
            med,
            yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
            marker="o",
            capsize=3,
            label=label,
        )
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs), [str(x) for x in xs])
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bars(
    path: Path,
    title: str,
    ylabel: str,
    categories: Sequence[str],
    series: dict[str, Sequence[float]],
    logy: bool = False,
    annotate: bool = True,
) -> Path:
    """Grouped bars: one group per category, one bar per series."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(categories) * max(1, len(series)) + 2), 4.5))
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(categories))]
        rects = ax.bar(xs, values, width, label=label)
        if annotate:
            ax.bar_label(rects, labels=[f"{v:.3g}" for v in values], fontsize=7, padding=2)
    ax.set_xticks(range(len(categories)), list(categories), rotation=20 if len(categories) > 6 else 0)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
