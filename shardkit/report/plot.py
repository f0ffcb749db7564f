"""Pictures of reports: what each recipe costs per device, one row per recipe, and how
that cost moves as the device count or the sequence grows.

:func:`plot_reports`: two panels share the recipes' rows: memory per device at its peak (stacked: arguments,
temp, output less what aliases the arguments) and wire bytes per device per step (stacked
by collective kind), each with the analytic model's total as a marker. Colours step in
lightness and carry hatches, so they read in greyscale; the figure is between 1:1 and 2:1
whatever the number of recipes; recipes that could not be compiled are listed in a
footnote. :func:`plot_sweep`: the same two quantities as lines against a swept number (the
devices, the sequence length), one line per recipe, each with its own colour, marker and
dash. The path's suffix picks the format (``.png``, ``.svg``, ``.pdf``).

Example:
  >>> import shardkit as sk
  >>> r = sk.report.build_report(sk.Plan("dp"), model=sk.models.get("gpt-tiny"), batch=8, seq=32)
  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "dp.png")
  >>> plot_reports({"dp": r}, path)   # doctest: +ELLIPSIS
  '...dp.png'
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardkit.collectives import KINDS
from shardkit.errors import ShardingError
from shardkit.figures import figure_size, matplotlib, save_figure
from shardkit.report.report import Report

__all__ = ["plot_reports", "plot_sweep"]

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
    plt = matplotlib().pyplot  # optional: imported when a figure is asked for

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
    _analytic_markers(ax_mem, [_analytic_total(reports[n]) for n in names], mem_scale)
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
    _analytic_markers(ax_wire, analytic_wire, wire_scale)
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


def _analytic_markers(ax: Any, totals: Sequence[float | None], scale: float) -> None:
    """A black diamond at each recipe's analytic total (rows without one get none)."""
    shown = [(i, a / scale) for i, a in enumerate(totals) if a]
    if shown:
        ax.scatter(
            [a for _, a in shown],
            [i for i, _ in shown],
            marker="D",
            s=22,
            color="black",
            zorder=3,
            label="analytic total",
        )


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


#: Lines of a sweep, one per recipe: (colour, marker, dash). The colours step in lightness
#: (0.1 apart in greyscale) and each line has its own marker, so print tells them apart.
_LINES = (
    ("#0b1e3f", "o", "-"),
    ("#7a1f12", "s", "--"),
    ("#2f6f3f", "^", "-."),
    ("#3f7fbf", "D", ":"),
    ("#e0875e", "v", "-"),
    ("#e6b84a", "P", "--"),
)

#: One point of a sweep: a report, or ``(memory bytes, wire bytes)`` per device, either
#: ``None`` where it was not measured.
Point = Report | tuple[float | None, float | None]


def plot_sweep(
    results: Mapping[str, Mapping[float, Point]],
    path: str | Path,
    *,
    x_label: str,
    title: str,
    notes: Sequence[str] = (),
) -> str:
    """Draw memory and wire bytes per device of each recipe against a swept number.

    ``results`` maps a recipe (or any line's name) to ``{x: point}``: ``x`` the swept
    number (devices, sequence length), the point a :class:`Report` or ``(memory bytes,
    wire bytes)`` per device. ``x_label`` names the axis with its unit, ``title`` says what
    was swept on what; ``notes`` go in a footnote. The x axis is in doublings where it
    spans 4× or more (ticks at the points: 64, 512, 1K = 1024), the y axes logarithmic
    where the values span more than 10×. At most six lines. Returns the path written.

    Example:
      >>> import tempfile, os
      >>> gib = 2**30
      >>> path = os.path.join(tempfile.mkdtemp(), "devices.svg")
      >>> plot_sweep(
      ...     {"fsdp": {64: (7.7 * gib, 73 * gib), 512: (6.3 * gib, 74 * gib)}},
      ...     path, x_label="devices", title="gpt-7b against the device count",
      ... )  # doctest: +ELLIPSIS
      '...devices.svg'
    """

    if not results or not any(results.values()):
        raise ShardingError("plot_sweep: no points to draw; pass {name: {x: point}}.")
    if len(results) > len(_LINES):
        raise ShardingError(
            f"plot_sweep: {len(results)} lines ({', '.join(results)}); at most "
            f"{len(_LINES)} read apart in one figure: split them over two figures."
        )

    mpl = matplotlib()  # optional: imported when a figure is asked for
    plt, ticker, Line2D = mpl.pyplot, mpl.ticker, mpl.lines.Line2D

    series = {
        name: sorted((x, _bytes(name, x, pt)) for x, pt in pts.items())
        for name, pts in results.items()
    }
    width = 11.0
    lines_of_notes = [line for note in notes for line in textwrap.wrap(note, 150)]
    legend_rows = -(-len(series) // 3)
    fig, axes = plt.subplots(
        1,
        2,
        figsize=figure_size(width, 4.6 + 0.2 * legend_rows + 0.17 * len(lines_of_notes)),
    )
    xs = sorted({x for pts in series.values() for x, _ in pts})
    panels = (
        (0, "memory per device at its peak"),
        (1, "wire bytes per device per step"),
    )
    for ax, (k, what) in zip(axes, panels, strict=True):
        values = [b[k] for pts in series.values() for _, b in pts if b[k] is not None]
        unit, scale = _unit(max(values, default=0))
        for (name, pts), (color, marker, dash) in zip(series.items(), _LINES, strict=False):
            shown = [(x, b[k] / scale) for x, b in pts if b[k] is not None]
            if shown:
                ax.plot(
                    *zip(*shown, strict=True),
                    color=color,
                    marker=marker,
                    ls=dash,
                    lw=1.6,
                    ms=6,
                    label=name,
                )
        if values and max(values) > 10 * min(values) > 0:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        else:
            ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
        if xs[-1] >= 4 * xs[0] > 0:  # doublings: evenly spaced
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(ticker.FixedLocator(xs))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _count(v)))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"{what} ({unit})")
        ax.set_title(what, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if not values:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="#555555")
    handles = [
        Line2D([], [], color=c, marker=m, ls=d, lw=1.6, ms=6, label=name)
        for name, (c, m, d) in zip(series, _LINES, strict=False)
    ]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=min(3, len(handles)),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, (0.17 * len(lines_of_notes) + 0.05) / fig.get_figheight()),
    )
    fig.suptitle(title, fontsize=11)
    if lines_of_notes:
        fig.text(0.01, 0.01, "\n".join(lines_of_notes), fontsize=7, va="bottom", ha="left")
    bottom = (0.17 * len(lines_of_notes) + 0.22 * legend_rows + 0.15) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return save_figure(fig, path)


def _bytes(name: str, x: float, point: Point) -> tuple[float | None, float | None]:
    """``(memory, wire)`` bytes per device of one point of a sweep."""
    if isinstance(point, Report):
        return float(point.memory.total), float(point.wire_bytes)
    try:
        memory, wire = point
    except (TypeError, ValueError):
        raise ShardingError(
            f"plot_sweep: results[{name!r}][{x!r}] is {point!r}; give a Report or "
            "(memory bytes, wire bytes) per device, None for either not measured."
        ) from None
    return memory, wire


def _count(value: float) -> str:
    """A tick's number, short: 64, 512, 1K, 64K (K = 1024), 2M."""
    for size, suffix in ((2**20, "M"), (2**10, "K")):
        if value >= size and value % size == 0:
            return f"{int(value // size)}{suffix}"
    return f"{value:g}"
