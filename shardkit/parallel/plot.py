"""Matplotlib timelines of pipeline schedules: which stage does what at each tick.

Example:
  >>> import matplotlib
  >>> matplotlib.use("Agg")
  >>> from shardkit.parallel.schedules import make
  >>> fig = plot_schedules([make("gpipe", 4, 8), make("1f1b", 4, 8)])
  >>> len(fig.axes)
  2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkit.parallel.schedules import Schedule

__all__ = ["plot_timeline", "plot_schedules"]


def plot_timeline(schedule: Schedule, ax: Any, *, title: str | None = None) -> None:
    """Draw ``schedule`` on ``ax``: one row per stage, one column per tick; forward cells
    blue, backward cells orange (both halves of a tick when a stage runs both), the
    micro-batch number inside; blank cells are the bubble."""
    p = schedule.stages
    for t in range(schedule.ticks):
        for s in range(p):
            f, b = schedule.forward[t][s], schedule.backward[t][s]
            cells = [(f, "#4c72b0"), (b, "#dd8452")]
            cells = [(item, c) for item, c in cells if item is not None]
            for n, (item, color) in enumerate(cells):
                w = 1.0 / len(cells)
                ax.add_patch(_rect(t + n * w, s, w, color))
                label = str(item[0]) + (f".{item[1]}" if schedule.virtual > 1 else "")
                ax.text(
                    t + (n + 0.5) * w,
                    s + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    ax.set_xlim(0, schedule.ticks)
    ax.set_ylim(p, 0)
    ax.set_yticks([s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_xlabel("tick")
    ax.set_title(
        title
        or f"{schedule.name}: p={p}, m={schedule.microbatches}, "
        f"v={schedule.virtual}, bubble {schedule.bubble:.0%}, holds "
        f"{schedule.ring} micro-batches",
        fontsize=9,
    )


def _rect(x: float, y: float, w: float, color: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x, y + 0.05), w, 0.9, color=color, linewidth=0)


def plot_schedules(schedules: Sequence[Schedule], titles: Sequence[str] | None = None) -> Any:
    """A figure with one timeline per schedule (``titles`` replace the default ones)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(schedules), 1, figsize=(10, 1.6 * len(schedules) + 0.8), squeeze=False
    )
    for n, (sched, ax) in enumerate(zip(schedules, axes[:, 0], strict=True)):
        plot_timeline(sched, ax, title=None if titles is None else titles[n])
    fig.tight_layout()
    return fig
