"""The collective kinds XLA emits, named once for recipes, plans and the report.

Example:
  >>> from shardkit.collectives import KINDS
  >>> KINDS[:2]
  ('all-reduce', 'all-gather')
"""

from __future__ import annotations

from typing import Literal

__all__ = ["KINDS", "Kind"]

Kind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]

#: Every kind, in the order reports list them.
KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
