"""``sk.logical_axes``: the logical axes of every leaf of a state tree.

Sources, in order, for each leaf:

1. axes stored by Flax on the leaf (``nn.LogicallyPartitioned``, NNX
   ``out_sharding``; ``@sk.axes`` produces these);
2. a ``sk.PathAxes`` passed as ``annotations``;
3. *mirroring*: optimizer states copy the params tree (``mu``, ``nu``, masked
   and chained states), so a leaf whose path ends with an annotated leaf's path
   and has its shape gets its axes; no boxed metadata has to survive ``tree_map``;
4. scalars (step counters) are replicated;
5. anything else follows ``on_unmatched``: all-``None`` axes, or an error.

Example:
  >>> import optax, numpy as np, shardkit as sk
  >>> params = {"w": np.zeros((4, 8))}
  >>> state = (params, optax.adam(1e-3).init(params))
  >>> axes = sk.logical_axes(state, annotations=sk.PathAxes([("^0/w$", ("embed", "mlp"))]))
  >>> axes[1][0].mu["w"], axes[1][0].count
  (('embed', 'mlp'), ())
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import numpy as np

from shardkit import errors
from shardkit.annotate.flax_meta import is_annotated_leaf, leaf_value, stored_axes
from shardkit.annotate.logical_axes_type import LogicalAxes
from shardkit.annotate.patterns import PatternAxes
from shardkit.paths import key_name

__all__ = ["logical_axes", "describe_leaves", "LeafInfo"]


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One leaf of a state tree and where its logical axes came from."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    axes: LogicalAxes
    source: Literal["flax", "annotation", "mirror", "scalar", "unmatched"]


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    v = leaf_value(x)
    shape = getattr(v, "shape", None)
    if shape is None:
        shape = np.shape(v)
    dtype = getattr(v, "dtype", None)
    if dtype is None:
        dtype = np.asarray(v).dtype
    return tuple(int(d) for d in shape), dtype


def describe_leaves(
    tree: Any,
    *,
    annotations: PatternAxes | None = None,
    on_unmatched: Literal["replicate", "error"] = "replicate",
) -> tuple[list[LeafInfo], jax.tree_util.PyTreeDef]:
    """Every leaf's path, shape, dtype and logical axes, plus the tree structure.

    Flax boxes and NNX Variables count as single leaves (their structure is a
    prefix of the unboxed tree, which is what ``jax.jit`` shardings accept).
    """
    if on_unmatched not in ("replicate", "error"):
        raise errors.RuleError(f"on_unmatched is 'replicate' or 'error', got {on_unmatched!r}.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_annotated_leaf)
    infos: list[LeafInfo | None] = [None] * len(flat)
    reference: dict[tuple[str, ...], list[tuple[tuple[int, ...], LogicalAxes]]] = {}
    pending = []
    for i, (path, leaf) in enumerate(flat):
        names = _names(path)
        where = "/".join(names) or "<root>"
        shape, dtype = _shape_dtype(leaf)
        axes, source = stored_axes(leaf, where), "flax"
        if axes is None and annotations is not None:
            axes, source = annotations.match(where, shape), "annotation"
        if axes is None:
            pending.append((i, names, where, shape, dtype))
            continue
        if len(axes) != len(shape):
            raise errors.RankMismatchError(
                f"{where}: shape {shape} has {len(shape)} dimension(s) but its logical axes "
                f"{tuple(axes)} name {len(axes)}.\nFix: give one name (or None) per dimension."
            )
        infos[i] = LeafInfo(where, shape, dtype, axes, source)
        for start in range(len(names)):  # index every suffix: containers differ in prefix
            reference.setdefault(names[start:], []).append((shape, axes, len(names)))

    unmatched = []
    for i, names, where, shape, dtype in pending:
        axes = _mirror(names, shape, reference)
        if axes is not None:
            infos[i] = LeafInfo(where, shape, dtype, axes, "mirror")
        elif not shape:
            infos[i] = LeafInfo(where, shape, dtype, LogicalAxes(()), "scalar")
        else:
            unmatched.append(f"{where} {shape}")
            infos[i] = LeafInfo(where, shape, dtype, LogicalAxes((None,) * len(shape)), "unmatched")
    if unmatched and on_unmatched == "error":
        listing = "\n".join(f"  {u}" for u in unmatched[:20])
        more = f"\n  ... and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""
        raise errors.UnmatchedPathError(
            f"{len(unmatched)} leaf/leaves matched no annotation:\n{listing}{more}\n"
            "Fix: add a (regex, logical_axes) pair for each, or pass "
            "on_unmatched='replicate' to replicate them."
        )
    return infos, treedef  # type: ignore[return-value]


def _mirror(names, shape, reference) -> LogicalAxes | None:
    """Axes of the annotated leaf sharing the longest path suffix (and the shape).

    Only leaves nested deeper than that annotated leaf qualify: optimizer states wrap
    the params tree (``opt_state/0/mu/...``), while an unannotated *parameter* that
    merely shares a name and shape with an annotated one is not its copy.
    """
    for start in range(len(names)):
        for ref_shape, axes, ref_depth in reference.get(names[start:], ()):
            if ref_shape == shape and len(names) > ref_depth:
                return axes
    return None


def logical_axes(
    tree: Any,
    *,
    annotations: PatternAxes | None = None,
    on_unmatched: Literal["replicate", "error"] = "replicate",
) -> Any:
    """A tree of ``LogicalAxes`` (one per leaf) for params, optimizer state, or both.

    Args:
      tree: params (boxed linen params, an NNX ``State``, plain arrays or
        ``ShapeDtypeStruct``s), any optax state built from them, or a container
        of both (e.g. ``(params, opt_state)`` or a ``TrainState``).
      annotations: a ``sk.PathAxes`` for leaves Flax did not annotate.
      on_unmatched: what to do with non-scalar leaves nothing annotates.

    Returns:
      A tree shaped like ``tree`` with Flax boxes / NNX Variables as single
      leaves, holding ``LogicalAxes``.
    """
    infos, treedef = describe_leaves(tree, annotations=annotations, on_unmatched=on_unmatched)
    return jax.tree_util.tree_unflatten(treedef, [info.axes for info in infos])
