"""Matching ``a/b/c`` paths against ``{regex: logical_axes}`` annotations.

One matcher serves ``@sk.axes`` (paths relative to the decorated module) and
``sk.PathAxes`` (paths from the root of a tree). A pattern is a regular
expression searched in the path (``re.search``); anchor it with ``^``/``$``
for exact matches. Several patterns may match one path only if they agree.

Example:
  >>> m = PatternAxes([("attn/.*/kernel$", ("embed", "heads", "kv")), ("bias$", ("mlp",))])
  >>> m.match("layers/attn/query/kernel", (8, 2, 4))
  ('embed', 'heads', 'kv')
  >>> m.match("norm/scale", (8,)) is None
  True
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardkit import errors
from shardkit.annotate.logical_axes_type import LogicalAxes

__all__ = ["PatternAxes", "as_logical_axes"]


def as_logical_axes(axes: Any, *, where: str) -> LogicalAxes:
    """Validate ``axes`` as a tuple of logical names (``str`` or ``None``)."""
    if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
        raise errors.RuleError(
            f"{where}: logical axes must be a tuple with one name (or None) per dimension, "
            f"got {axes!r}.\nFix: write ({axes!r},) for a 1-D parameter."
        )
    if not all(a is None or (isinstance(a, str) and a) for a in axes):
        raise errors.RuleError(
            f"{where}: logical axes {tuple(axes)!r} may only hold names (str) or None."
        )
    return LogicalAxes(axes)


class PatternAxes:
    """An ordered list of ``(regex, logical_axes)`` annotations."""

    __slots__ = ("entries",)
    #: How users call it, for error messages.
    label = "@sk.axes"

    def __init__(self, patterns: Mapping[str, Sequence[str | None]] | Iterable[Any]):
        if isinstance(patterns, (str, bytes)) or not isinstance(patterns, (Mapping, Iterable)):
            raise errors.ArgumentTypeError(
                f"{self.label} takes a list of (regex, logical_axes) pairs (or a dict), "
                f"got {type(patterns).__name__} {patterns!r}.\nFix: e.g. "
                "[('attn/query/kernel$', ('embed', 'heads', 'kv'))]."
            )
        items = list(patterns.items() if isinstance(patterns, Mapping) else patterns)
        entries = []
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise errors.RuleError(
                    f"Annotation #{i} is {item!r}; each is a pair (regex, logical_axes), "
                    "e.g. ('attn/query/kernel$', ('embed', 'heads', 'kv'))."
                )
            pattern, axes = item
            if not isinstance(pattern, str):
                raise errors.ArgumentTypeError(
                    f"Annotation #{i}: the pattern {pattern!r} is a {type(pattern).__name__}; "
                    "patterns are regexes as str, searched in 'a/b/c' paths.\nFix: e.g. "
                    "'attn/query/kernel$'."
                )
            try:
                compiled = re.compile(pattern)
            except (re.error, TypeError) as e:
                raise errors.RuleError(
                    f"Annotation #{i}: {pattern!r} is not a valid regex: {e}."
                ) from None
            entries.append((compiled, as_logical_axes(axes, where=f"annotation {pattern!r}")))
        self.entries: tuple[tuple[re.Pattern[str], LogicalAxes], ...] = tuple(entries)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[(p.pattern, tuple(a)) for p, a in self.entries]!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.entries == other.entries  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.entries)

    def match(
        self, path: str, shape: Sequence[int], *, where: str | None = None
    ) -> LogicalAxes | None:
        """The logical axes for ``path``, ``None`` if no pattern matches.

        Fewer names than dimensions name the leading ones (Flax's rule: the rest are
        replicated); the names are returned as given.

        Raises:
          AmbiguousAxesError: two matching patterns give different axes.
          RankMismatchError: the matched axes name more dimensions than ``shape`` has.
        """
        where = where or path
        hits = [(p.pattern, a) for p, a in self.entries if p.search(path)]
        if not hits:
            return None
        distinct = {a for _, a in hits}
        if len(distinct) > 1:
            listing = "\n".join(f"  {p!r} -> {tuple(a)}" for p, a in hits)
            raise errors.AmbiguousAxesError(
                f"{where} (shape {tuple(shape)}) matches several annotations that disagree:\n"
                f"{listing}\nFix: anchor the patterns (e.g. with '$' or a parent name) so "
                "exactly one applies."
            )
        pattern, axes = hits[0]
        if len(axes) > len(shape):
            raise errors.RankMismatchError(
                f"{where}: shape {tuple(shape)} has {len(shape)} dimension(s) but annotation "
                f"{pattern!r} gives {len(axes)} logical axes {tuple(axes)}.\nFix: give one "
                "name (or None) per dimension, at most."
            )
        return axes
