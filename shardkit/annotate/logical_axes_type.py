"""``LogicalAxes``: a tuple of logical names that pytrees treat as one leaf.

Example:
  >>> import jax
  >>> jax.tree.leaves({"w": LogicalAxes(("embed", None))})
  [('embed', None)]
"""

from __future__ import annotations

__all__ = ["LogicalAxes"]


class LogicalAxes(tuple):
    """One logical name (``str``) or ``None`` per dimension of an array.

    A plain ``tuple`` subclass, so it compares equal to the tuple it holds, but
    JAX treats it as a leaf: trees of ``LogicalAxes`` mirror trees of arrays.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return tuple.__repr__(self)
