"""Pictures of reports: what each recipe costs per device, one row per recipe.

Two panels share the recipes' rows: memory per device at its peak (stacked: arguments,
temp, output less what aliases the arguments) and wire bytes per device per step (stacked
by collective kind), each with the analytic model's total as a marker. Colours step in
lightness and carry hatches, so they read in greyscale; the figure is between 1:1 and 2:1
whatever the number of recipes; recipes that could not be compiled are listed in a
footnote. The path's suffix picks the format (``.png``, ``.svg``, ``.pdf``).

Example:
  >>> import shardkit as sk
  >>> from shardkit import models
  >>> from shardkit.models import get
  >>> r = models.report(sk.Plan("dp"), get("gpt-tiny"), batch=8, seq=32)
  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "dp.png")
  >>> plot_reports({"dp": r}, path)   # doctest: +ELLIPSIS
  '...dp.png'
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkit.collectives import KINDS
from shardkit.report.report import Report

__all__ = ["ASPECT", "figure_size", "plot_reports", "save_figure"]

#: (narrowest, widest) width : height of every figure shardkit draws.
ASPECT = (1.0, 2.0)

#: Memory parts: dark to light, each with its own hatch (greyscale tells them apart).
_MEMORY = (
    ("arguments", "arguments (params + optimizer)", "#1f3f73", ""),
    ("temp", "temp (grads, activations, gathered)", "#5b8fc9", "//"),
    ("output", "output not aliased", "#c9dcf0", ".."),
)
#: Collective kinds: dark to light, each with its own hatch.
_WIRE = dict(
    zip(
        KINDS,
        (
            ("#4a1010", ""),
            ("#a8402f", "//"),
            ("#e0875e", "\\\\"),
            ("#f4c09c", "xx"),
            ("#fdf3ea", ".."),
        ),
        strict=True,
    )
)


def figure_size(width: float, height: float) -> tuple[float, float]:
    """``(width, height)`` with the height clamped so the aspect lies within ``ASPECT``.

    Example:
      >>> figure_size(11, 3), figure_size(11, 7), figure_size(11, 20)
      ((11, 5.5), (11, 7), (11, 11.0))
    """
    low, high = ASPECT
    return width, min(max(height, width / high), width / low)


def save_figure(fig: Any, path: str | Path, *, close: bool = True) -> str:
    """Save ``fig`` to ``path`` (format from the suffix; SVG text stays text, searchable)
    and close it unless ``close=False``; returns the path."""
    import matplotlib.pyplot as plt  # optional (the ``plot`` extra): only when saving

    with plt.rc_context({"svg.fonttype": "none"}):
        fig.savefig(path, dpi=120)
    if close:
        plt.close(fig)
    return str(path)


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2**30) if largest >= 2 * 2**30 else ("MiB", 2**20)


def plot_reports(
    reports: Mapping[str, Report],
    path: str | Path,
    *,
    title: str | None = None,
    skipped: Mapping[str, str] | None = None,
) -> str:
    """Draw memory and wire bytes per device of each report (one row per recipe) to
    ``path``. ``title`` names the workload (model, devices, batch); ``skipped`` recipes
    and their reasons go in a footnote. Returns the path written."""
    # matplotlib is an optional dependency (the ``plot`` extra): imported here, when a
    # figure is asked for, so that the report works without it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports)
    notes = _footnote(skipped or {})
    width = 11.0
    fig, (ax_mem, ax_wire) = plt.subplots(
        1,
        2,
        sharey=True,
        figsize=figure_size(width, 2.6 + 0.34 * max(len(names), 1) + 0.17 * len(notes)),
    )
    rows = range(len(names))

    mem_unit, mem_scale = _unit(max((r.memory.total for r in reports.values()), default=0))
    for part, label, color, hatch in _MEMORY:
        values = []
        for name in names:
            m = reports[name].memory.to_dict()
            values.append((m[part] - (m["alias"] if part == "output" else 0)) / mem_scale)
        if not any(values):
            continue
        lefts = [_left(reports[n], part) / mem_scale for n in names]
        ax_mem.barh(
            rows,
            values,
            height=0.7,
            left=lefts,
            color=color,
            hatch=hatch,
            edgecolor="#333333",
            lw=0.4,
            label=label,
        )
    analytic = [_analytic_total(reports[n]) for n in names]
    shown = [(i, a / mem_scale) for i, a in enumerate(analytic) if a]
    if shown:
        ax_mem.scatter(
            [a for _, a in shown],
            [i for i, _ in shown],
            marker="D",
            s=22,
            color="black",
            zorder=3,
            label="analytic total",
        )
    ax_mem.set_xlabel(f"memory per device at its peak ({mem_unit})")
    ax_mem.set_title("memory per device", fontsize=10)

    wire_unit, wire_scale = _unit(max((r.wire_bytes for r in reports.values()), default=0))
    lefts = [0.0] * len(names)
    for kind in KINDS:
        values = [reports[n].wire_bytes_by_kind.get(kind, 0.0) / wire_scale for n in names]
        if not any(values):
            continue
        color, hatch = _WIRE[kind]
        ax_wire.barh(
            rows,
            values,
            height=0.7,
            left=lefts,
            color=color,
            hatch=hatch,
            edgecolor="#333333",
            lw=0.4,
            label=kind,
        )
        lefts = [a + b for a, b in zip(lefts, values, strict=True)]
    analytic_wire = [
        sum(r.analytic.wire_bytes_by_kind.values()) if r.analytic else 0.0
        for r in (reports[n] for n in names)
    ]
    shown = [(i, a / wire_scale) for i, a in enumerate(analytic_wire) if a]
    if shown:
        ax_wire.scatter(
            [a for _, a in shown],
            [i for i, _ in shown],
            marker="D",
            s=22,
            color="black",
            zorder=3,
            label="analytic total",
        )
    ax_wire.set_xlabel(f"wire bytes per device per step ({wire_unit})")
    ax_wire.set_title("wire bytes per device per step", fontsize=10)

    ax_mem.set_yticks(list(rows), names)
    ax_mem.invert_yaxis()  # the first recipe on top, as in the table
    for ax in (ax_mem, ax_wire):
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(  # under the panel: it hides no bar
            fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False
        )
        low, high = ax.get_xlim()
        ax.set_xlim(0, high * 1.02)
    heading = "Memory and wire bytes per device, by recipe"
    fig.suptitle(heading + (f"\n{title}" if title else ""), fontsize=11)
    bottom = 0.0
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom", ha="left")
        bottom = (0.17 * len(notes) + 0.1) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return save_figure(fig, path)


def _left(report: Report, part: str) -> float:
    """Where ``part``'s bar starts: after the parts drawn before it."""
    m = report.memory.to_dict()
    before = {"arguments": 0.0, "temp": m["arguments"], "output": m["arguments"] + m["temp"]}
    return before[part]


def _analytic_total(report: Report) -> float | None:
    a, w = report.analytic, report.workload
    if a is None:
        return None
    if w is not None and w.has_dims:
        return a.memory.total
    return None


def _footnote(skipped: Mapping[str, str]) -> list[str]:
    """``Not shown: name (reason); ...`` wrapped to the figure's width, reasons cut short."""
    if not skipped:
        return []
    parts = [f"{n} ({textwrap.shorten(why, 130, placeholder=' …')})" for n, why in skipped.items()]
    return textwrap.wrap("Not shown, no layout compiled: " + "; ".join(parts), 150)
