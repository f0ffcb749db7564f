"""Pictures of reports: memory per device by kind, wire bytes by collective kind,
measured next to analytic.

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

from collections.abc import Mapping
from pathlib import Path

from shardkit.collectives import KINDS
from shardkit.report.report import Report

__all__ = ["plot_reports"]

_MIB = 1 / 2**20


def plot_reports(
    reports: Mapping[str, Report],
    path: str | Path,
    *,
    title: str | None = None,
    skipped: Mapping[str, str] | None = None,
) -> str:
    """Two panels per figure: memory per device (stacked by kind) and wire bytes per
    device per step (stacked by collective kind), each recipe's measured bar next to its
    analytic bar. ``title`` heads the figure (model, devices, workload); ``skipped``
    recipes are listed under it with their reason. Returns the path written."""
    # matplotlib is an optional dependency (the ``plot`` extra): imported here, when a
    # figure is asked for, so that the report works without it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports)
    fig, (ax_mem, ax_wire) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.5))
    width = 0.38
    xs = range(len(names))

    mem_parts = ("arguments", "temp", "output")
    colors = {"arguments": "#4C72B0", "temp": "#DD8452", "output": "#55A868"}
    for i, name in enumerate(names):
        m = reports[name].memory.to_dict()
        bottom = 0.0
        for part in mem_parts:
            value = (m[part] - (m["alias"] if part == "output" else 0)) * _MIB
            ax_mem.bar(
                i - width / 2,
                value,
                width,
                bottom=bottom,
                color=colors[part],
                label=part if i == 0 else None,
            )
            bottom += value
        a = reports[name].analytic
        if a is not None:
            state = (a.memory.params + a.memory.optimizer) * _MIB
            ax_mem.bar(
                i + width / 2,
                state,
                width,
                color="#4C72B0",
                alpha=0.35,
                hatch="//",
                label="analytic state" if i == 0 else None,
            )
            ax_mem.bar(
                i + width / 2,
                (a.memory.grads + a.memory.activations) * _MIB,
                width,
                bottom=state,
                color="#DD8452",
                alpha=0.35,
                hatch="//",
                label="analytic grads + activations" if i == 0 else None,
            )
    ax_mem.set_title("memory per device (MiB)")

    palette = dict(zip(KINDS, ("#C44E52", "#8172B2", "#937860", "#DA8BC3", "#8C8C8C"), strict=True))
    for i, name in enumerate(names):
        r = reports[name]
        for offset, by_kind, alpha in (
            (-width / 2, r.wire_bytes_by_kind, 1.0),
            (width / 2, r.analytic.wire_bytes_by_kind if r.analytic else {}, 0.35),
        ):
            bottom = 0.0
            for kind in KINDS:
                value = by_kind.get(kind, 0.0) * _MIB
                if value:
                    ax_wire.bar(
                        i + offset,
                        value,
                        width,
                        bottom=bottom,
                        color=palette[kind],
                        alpha=alpha,
                        label=kind if alpha == 1.0 else None,
                    )
                    bottom += value
    handles, labels = ax_wire.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax_wire.legend(unique.values(), unique.keys(), fontsize=8)
    ax_wire.set_title("wire bytes per device per step (MiB)\nleft: measured, right: analytic")
    for ax in (ax_mem, ax_wire):
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax_mem.legend(fontsize=8)
    for ax in (ax_mem, ax_wire):  # headroom above the tallest bar for the legend
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 1.25)
    lines = [title] if title else []
    if skipped:
        lines.append("skipped: " + "; ".join(f"{n} ({why[:60]})" for n, why in skipped.items()))
    if lines:
        fig.suptitle("\n".join(lines), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
