"""Figure helpers every picture shardkit draws shares: its aspect and how it is saved.

matplotlib is needed only to draw (``pip install 'shardkit[plot]'``; the ``test``,
``notebooks`` and ``docs`` extras have it too), so it is imported by :func:`matplotlib`,
the one place that does, when a figure is drawn, never when shardkit is imported.

Example:
  >>> figure_size(11, 3), figure_size(11, 7), figure_size(11, 20)
  ((11, 5.5), (11, 7), (11, 11.0))
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ASPECT", "figure_size", "matplotlib", "save_figure"]

#: What a user without matplotlib is told when a figure is asked for.
INSTALL = (
    "shardkit draws figures with matplotlib, which is not installed: pip install 'shardkit[plot]'"
)

#: (narrowest, widest) width : height of every figure shardkit draws.
ASPECT = (1.0, 2.0)


def figure_size(width: float, height: float) -> tuple[float, float]:
    """``(width, height)`` with the height clamped so the aspect lies within ``ASPECT``."""
    low, high = ASPECT
    return width, min(max(height, width / high), width / low)


def matplotlib() -> ModuleType:
    """The matplotlib package with the submodules shardkit draws with (``pyplot``,
    ``ticker``, ``lines``, ``patches``) imported; an ``ImportError`` that says how to
    install it when it is missing.

    Example:
      >>> mpl = matplotlib()
      >>> mpl.ticker.MaxNLocator(integer=True).__class__.__name__
      'MaxNLocator'
    """
    try:
        import matplotlib.lines  # noqa: PLC0415 (optional dependency: imported to draw)
        import matplotlib.patches  # noqa: PLC0415
        import matplotlib.pyplot  # noqa: PLC0415
        import matplotlib.ticker  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(INSTALL) from error
    return matplotlib


def save_figure(fig: Any, path: str | Path, *, close: bool = True) -> str:
    """Save ``fig`` to ``path`` (format from the suffix; SVG text stays text, searchable)
    and close it unless ``close=False``; returns the path."""
    plt = matplotlib().pyplot
    # No date and fixed ids in an SVG: the same figure saves to the same bytes.
    svg = str(path).endswith(".svg")
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "shardkit"}):
        fig.savefig(path, dpi=120, metadata={"Date": None} if svg else None)
    if close:
        plt.close(fig)
    return str(path)
