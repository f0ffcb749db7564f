"""``sk.PathAxes``: logical axes for trees nobody annotated, by path regex.

Example:
  >>> import numpy as np, shardkit as sk
  >>> params = {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}}
  >>> pa = sk.PathAxes([("kernel$", ("embed", "mlp")), ("bias$", ("mlp",))])
  >>> pa(params)["dense"]["kernel"]
  ('embed', 'mlp')
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from shardkit.annotate.logical import logical_axes
from shardkit.annotate.patterns import PatternAxes
from shardkit.errors import RuleError

__all__ = ["PathAxes"]


class PathAxes(PatternAxes):
    """Ordered ``(regex, logical_axes)`` pairs matched against ``a/b/c`` leaf paths.

    Args:
      patterns: pairs (or a dict); each regex is searched in the full path.
      on_unmatched: ``"replicate"`` (default) gives unmatched leaves all-``None``
        axes; ``"error"`` raises ``UnmatchedPathError`` listing every unmatched path.

    Calling it on a tree is ``sk.logical_axes(tree, annotations=self)``.
    """

    __slots__ = ("on_unmatched",)
    label = "sk.PathAxes"

    def __init__(
        self,
        patterns: Mapping[str, Sequence[str | None]] | Iterable[Any],
        *,
        on_unmatched: Literal["replicate", "error"] = "replicate",
    ):
        super().__init__(patterns)
        if on_unmatched not in ("replicate", "error"):
            raise RuleError(f"on_unmatched is 'replicate' or 'error', got {on_unmatched!r}.")
        self.on_unmatched = on_unmatched

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and self.on_unmatched == other.on_unmatched  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.entries, self.on_unmatched))

    def __call__(self, tree: Any) -> Any:
        return logical_axes(tree, annotations=self, on_unmatched=self.on_unmatched)
