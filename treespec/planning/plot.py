"""Plot predicted tokens/s against tree budget, one line per hardware, one panel per batch."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from treespec.planning.planner import TreeChoice, best_choice

__all__ = ["plot_curves"]


def plot_curves(
    curves: Mapping[int, Mapping[str, Sequence[TreeChoice]]],
    path: str | os.PathLike,
    title: str = "",
) -> Path:
    """Write a PNG: for each batch (a panel), tokens/s vs budget per hardware (a line, its
    best budget marked). ``curves[batch][hardware]`` is a ``plan_curve`` result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(curves)
    if not batches:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for hardware, curve in curves[batch].items():
            line, = ax.plot([c.budget for c in curve], [c.tokens_per_s for c in curve], label=hardware)
            best = best_choice(curve)
            ax.plot([best.budget], [best.tokens_per_s], "o", color=line.get_color())
        ax.set_yscale("log")
        ax.set_xlabel("tree budget (nodes, root included)")
        ax.set_ylabel("predicted tokens/s (batch total)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
