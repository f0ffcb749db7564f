"""A picture of an autoplan: each compiled candidate's memory per device against its
estimated step time, the budget as a line, the best ones named.

Each recipe has its own marker shape as well as its colour (it reads in greyscale); the
figure is between 1:1 and 2:1; the path's suffix picks the format (``.png``, ``.svg``).

Example:
  >>> # result = sk.autoplan(...); plot_autoplan(result, "plan.png")
"""

from __future__ import annotations

from pathlib import Path

from shardkit.figures import figure_size, matplotlib, save_figure

__all__ = ["plot_autoplan"]

_GIB = 2**30
#: One marker shape per recipe, so the recipes differ in greyscale too.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def plot_autoplan(result, path: str | Path, *, label: int = 5) -> str:
    """Scatter of ranked candidates (and compiled ones over budget, hollow); returns path."""
    mpl = matplotlib()  # optional: imported when a figure is asked for
    plt = mpl.pyplot

    top = result.candidates[:label]
    fig, ax = plt.subplots(figsize=figure_size(9, 6 + 0.15 * len(top)))
    recipes = sorted({r.candidate.recipe for r in result.candidates})
    cmap = plt.get_cmap("viridis")
    for k, name in enumerate(recipes):
        rows = [r for r in result.candidates if r.candidate.recipe == name]
        ax.scatter(
            [r.evidence.memory["total"] / _GIB for r in rows],
            [r.estimate.step_time_s for r in rows],
            color=cmap(k / max(1, len(recipes) - 1) * 0.9),
            marker=_MARKERS[k % len(_MARKERS)],
            edgecolor="black",
            linewidth=0.5,
            label=name,
            s=40,
            zorder=3,
        )
    for i, r in enumerate(top, 1):
        ax.annotate(
            f"#{i}",
            (r.evidence.memory["total"] / _GIB, r.estimate.step_time_s),
            fontsize=8,
            xytext=(4, 3 + 7 * (i % 2)),
            textcoords="offset points",
        )
    budget = result.memory_per_device / _GIB
    ax.axvline(budget, color="crimson", linestyle="--", linewidth=1)
    ax.text(budget, ax.get_ylim()[1], " budget", color="crimson", va="top", fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(mpl.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(mpl.ticker.FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(mpl.ticker.NullFormatter())
    ax.set_xlabel("compiled memory per device (GiB)")
    ax.set_ylabel(f"estimated step time on {result.hardware.name} (s, roofline)")
    ax.set_title(
        "Compiled memory per device against estimated step time, per layout\n"
        f"{result.model} on {result.devices} {result.hardware.name} devices: batch "
        f"{result.batch}, seq {result.seq}",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2, loc="best")
    ax.grid(True, which="both", alpha=0.3)
    lines = [
        f"#{i} {r.candidate.label}: {r.estimate.step_time_s * 1e3:.3g} ms, "
        f"{r.evidence.memory['total'] / _GIB:.1f} GiB"
        for i, r in enumerate(top, 1)
    ]
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.01 + 0.026 * len(top), 1, 1))
    return save_figure(fig, path)
