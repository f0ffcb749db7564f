"""Matplotlib timelines of pipeline schedules: which stage does what at each tick.

Forward cells are dark, backward cells light and hatched, and zb1 / zbv's weight-gradient
cells ``W`` mid-grey green, cross-hatched (the three differ in greyscale); a
figure of several schedules is a grid between 1:1 and 2:1, saved by ``path``'s suffix.

Example:
  >>> import matplotlib
  >>> matplotlib.use("Agg")
  >>> from shardkit.parallel.schedules import make
  >>> fig = plot_schedules([make("gpipe", 4, 8), make("1f1b", 4, 8), make("zb1", 4, 8)])
  >>> len(fig.axes)
  3
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from shardkit.figures import figure_size, matplotlib, save_figure
from shardkit.parallel.schedules import Schedule

__all__ = ["plot_schedules"]


def _plot_timeline(schedule: Schedule, ax: Any, *, title: str | None = None) -> None:
    """Draw ``schedule`` on ``ax``: one row per stage, one column per tick; forward cells
    dark blue, backward cells light orange and hatched, weight-gradient cells (zb1, zbv)
    green and cross-hatched (a tick split between what a stage runs), the micro-batch
    number inside; blank cells are the bubble."""
    p = schedule.stages
    for t in range(schedule.ticks):
        for s in range(p):
            f, b = schedule.forward[t][s], schedule.backward[t][s]
            cells = [(f, _FORWARD), (b, _BACKWARD)]
            if schedule.split:  # zb1 / zbv: B the input gradient, W the weights'
                cells.append((schedule.weight[t][s], _WEIGHT))
            cells = [(item, c) for item, c in cells if item is not None]
            for n, (item, (color, hatch, ink)) in enumerate(cells):
                w = 1.0 / len(cells)
                ax.add_patch(_rect(t + n * w, s, w, color, hatch))
                label = str(item[0]) + (f".{item[1]}" if schedule.virtual > 1 else "")
                ax.text(
                    t + (n + 0.5) * w,
                    s + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color=ink,
                )

    ax.set_xlim(0, schedule.ticks)
    whole = matplotlib().ticker.MaxNLocator(integer=True)  # ticks are whole: no 2.5
    ax.xaxis.set_major_locator(whole)
    ax.set_ylim(p, 0)
    ax.set_yticks([s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_xlabel("tick (one stage's forward or backward of one micro-batch)")
    ax.set_title(
        title
        or f"{schedule.name}: p={p}, m={schedule.microbatches}, "
        f"v={schedule.virtual}, bubble {schedule.bubble:.0%}, a stage holds at most "
        f"{_held(schedule)}",
        fontsize=9,
    )


def _held(schedule: Any) -> str:
    """What a stage holds at once: ``slots`` items, a chunk's share each when ``v > 1``
    (``ring``, the engine's slot count, is the longest wait and may be larger)."""
    if schedule.virtual == 1:
        return f"{schedule.slots} micro-batches"
    return f"{schedule.slots} chunks (1/{schedule.virtual} of a stage each)"


#: (fill, hatch, text colour): dark forward, light hatched backward.
_FORWARD = ("#1f3f73", "", "white")
_BACKWARD = ("#f3b27a", "///", "black")
_WEIGHT = ("#5f9e6e", "xx", "black")


def _rect(x: float, y: float, w: float, color: str, hatch: str = "") -> Any:
    return matplotlib().patches.Rectangle(
        (x, y + 0.05), w, 0.9, facecolor=color, hatch=hatch, edgecolor="#8a5a30", linewidth=0
    )


def plot_schedules(
    schedules: Sequence[Schedule],
    titles: Sequence[str] | None = None,
    *,
    path: str | None = None,
) -> Any:
    """A figure with one timeline per schedule (``titles`` replace the default ones), in
    one column up to three, else two; saved to ``path`` (``.png``, ``.svg``) if given."""
    plt = matplotlib().pyplot  # optional: imported when a figure is asked for

    n = len(schedules)
    ncols = 1 if n <= 3 else 2
    nrows = math.ceil(n / ncols)
    width = 10.0 * ncols
    fig, axes = plt.subplots(
        nrows, ncols, figsize=figure_size(width, 1.8 * nrows + 1.2), squeeze=False
    )
    cells = list(axes.flat)
    for k, (sched, ax) in enumerate(zip(schedules, cells, strict=False)):
        _plot_timeline(sched, ax, title=None if titles is None else titles[k])
    for ax in cells[n:]:
        ax.set_visible(False)
    fig.suptitle("Pipeline schedules: what each stage runs at each tick", fontsize=11)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path, close=False)
    return fig
