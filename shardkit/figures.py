"""Figure helpers every picture shardkit draws shares: its aspect and how it is saved.

matplotlib is needed only to draw (the ``test`` and ``docs`` extras have it), so it is
imported inside the functions that use it, never when shardkit is imported.

Example:
  >>> figure_size(11, 3), figure_size(11, 7), figure_size(11, 20)
  ((11, 5.5), (11, 7), (11, 11.0))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ASPECT", "figure_size", "save_figure"]

#: (narrowest, widest) width : height of every figure shardkit draws.
ASPECT = (1.0, 2.0)


def figure_size(width: float, height: float) -> tuple[float, float]:
    """``(width, height)`` with the height clamped so the aspect lies within ``ASPECT``."""
    low, high = ASPECT
    return width, min(max(height, width / high), width / low)


def save_figure(fig: Any, path: str | Path, *, close: bool = True) -> str:
    """Save ``fig`` to ``path`` (format from the suffix; SVG text stays text, searchable)
    and close it unless ``close=False``; returns the path."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: only drawing needs it)

    # No date and fixed ids in an SVG: the same figure saves to the same bytes.
    svg = str(path).endswith(".svg")
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "shardkit"}):
        fig.savefig(path, dpi=120, metadata={"Date": None} if svg else None)
    if close:
        plt.close(fig)
    return str(path)
