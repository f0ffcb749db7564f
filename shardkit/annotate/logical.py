"""``sk.logical_axes``: the logical axes of every leaf of a state tree.

Each leaf is first sorted into a *kind*: optimizer state (it sits inside an optax
state, is an NNX optimizer Variable, or is under a key named ``opt_state``), a
scalar, or a parameter (everything else). Then, for each leaf:

1. axes stored by Flax on the leaf (``nn.LogicallyPartitioned``, NNX
   ``out_sharding``; ``@sk.axes`` produces these);
2. parameters: a ``sk.PathAxes`` passed as ``annotations`` (also where the stored
   names are fewer than the dimensions: a pattern naming more of them applies);
3. optimizer state: *mirroring* — optimizer states copy the params tree (``mu``,
   ``nu``, masked and chained states), so the leaf takes the axes of the parameter
   sharing the longest path ending with it and its shape; no boxed metadata has
   to survive ``tree_map``, and patterns written for parameters never match the
   moments by accident (a moment then gets the parameter's axes, and a recipe's
   optimizer rules);
4. an unannotated leaf that is a deeper copy of an annotated parameter (its path
   ends with that parameter's whole path inside its container, e.g. a hand-made
   ``{"mu": ...}`` next to ``params``) mirrors it too, and counts as optimizer state;
5. scalars (step counters) are replicated;
6. anything else follows ``on_unmatched``: all-``None`` axes, or an error that
   names every unmatched parameter.

Fewer names than dimensions name the leading dimensions, the rest replicated, as Flax
resolves them (its attention layers create a 3-D kernel with 2 names): the axes come
back padded with ``None`` and ``LeafInfo.prefix`` says so. More names is an error.

Parameters never mirror one another: an unannotated parameter that merely shares a
name and shape with an annotated one is unmatched, not a copy.

Example:
  >>> import optax, numpy as np, shardkit as sk
  >>> params = {"w": np.zeros((4, 8))}
  >>> state = (params, optax.adam(1e-3).init(params))
  >>> axes = sk.logical_axes(state, annotations=sk.PathAxes([("w$", ("embed", "mlp"))]))
  >>> axes[1][0].mu["w"], axes[1][0].count
  (('embed', 'mlp'), ())
  >>> [i.kind for i in sk.annotate.describe_leaves(state)[0]]
  ['param', 'scalar', 'optimizer', 'optimizer']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from shardkit import errors
from shardkit.annotate.flax_meta import is_annotated_leaf, leaf_value, stored_axes
from shardkit.annotate.logical_axes_type import LogicalAxes
from shardkit.annotate.patterns import PatternAxes
from shardkit.paths import key_name

__all__ = ["logical_axes", "describe_leaves", "LeafInfo", "OPTIMIZER_KEYS"]

#: Path keys that mark optimizer state when no optax type says so (Flax's
#: ``TrainState.opt_state``, ``nnx.Optimizer.opt_state``).
OPTIMIZER_KEYS = frozenset({"opt_state"})

Source = Literal["flax", "annotation", "mirror", "scalar", "unmatched"]


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One leaf of a state tree, its kind, and where its logical axes came from."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    axes: LogicalAxes
    source: Source
    optimizer: bool = False
    #: the annotation named fewer dimensions than the leaf has (``axes`` is padded with
    #: ``None``): Flax's prefix rule, the rest replicated
    prefix: bool = False

    @property
    def kind(self) -> Literal["param", "optimizer", "scalar"]:
        """``"scalar"`` (no dimensions), ``"optimizer"`` (optimizer state) or ``"param"``."""
        if not self.shape:
            return "scalar"
        return "optimizer" if self.optimizer else "param"


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


def _is_optax_state(x: Any) -> bool:
    """An optax state node: a NamedTuple defined by optax (``ScaleByAdamState``, ...)."""
    t = type(x)
    optax_type = t.__module__ == "optax" or t.__module__.startswith("optax.")
    return isinstance(x, tuple) and hasattr(t, "_fields") and optax_type


def _optimizer_paths(tree: Any) -> set[tuple[Any, ...]]:
    """Key paths of the optax state nodes in ``tree`` (their leaves are optimizer state)."""
    nodes = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_annotated_leaf(x) or _is_optax_state(x)
    )[0]
    return {path for path, node in nodes if _is_optax_state(node)}


def _is_optimizer_leaf(path: tuple[Any, ...], leaf: Any, optax_paths: set) -> bool:
    if isinstance(leaf, nnx.training.optimizer.OptState):
        return True
    if any(path[:i] in optax_paths for i in range(len(path))):
        return True
    return any(key_name(k) in OPTIMIZER_KEYS for k in path)


def describe_leaves(
    tree: Any,
    *,
    annotations: PatternAxes | None = None,
    on_unmatched: Literal["replicate", "error"] = "replicate",
) -> tuple[list[LeafInfo], jax.tree_util.PyTreeDef]:
    """Every leaf's path, shape, dtype, kind and logical axes, plus the tree structure.

    Flax boxes and NNX Variables count as single leaves (their structure is a
    prefix of the unboxed tree, which is what ``jax.jit`` shardings accept).
    """
    if on_unmatched not in ("replicate", "error"):
        raise errors.RuleError(f"on_unmatched is 'replicate' or 'error', got {on_unmatched!r}.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_annotated_leaf)
    optax_paths = _optimizer_paths(tree)
    infos: list[LeafInfo | None] = [None] * len(flat)
    pending_params, pending_optimizer = [], []
    for i, (path, leaf) in enumerate(flat):
        names = _names(path)
        where = "/".join(names) or "<root>"
        shape, dtype = _shape_dtype(leaf)
        optimizer = _is_optimizer_leaf(path, leaf, optax_paths)
        axes, source = stored_axes(leaf, where), "flax"
        # A pattern naming more dimensions replaces names Flax stored as a prefix.
        short = axes is None or len(axes) < len(shape)
        if short and not optimizer and annotations is not None:
            given = annotations.match(where, shape)
            if given is not None and (axes is None or len(given) > len(axes)):
                axes, source = given, "annotation"
        if axes is None:  # decided below, once every annotated parameter is known
            (pending_optimizer if optimizer else pending_params).append(
                (i, path, where, shape, dtype)
            )
            continue
        infos[i] = _info(where, shape, dtype, axes, source, optimizer)

    # Deeper copies of an annotated parameter (an optimizer state made by hand).
    annotated = [
        (_relative(flat[i][0]), len(flat[i][0]), info)
        for i, info in enumerate(infos)
        if info is not None and not info.optimizer
    ]
    for i, path, where, shape, dtype in pending_params:
        names = _names(path)
        copies = [
            info
            for rel, depth, info in annotated
            if rel
            and len(names) > depth
            and names[len(names) - len(rel) :] == rel
            and info.shape == shape
        ]
        if copies:
            ref = _agreed(copies, where)
            infos[i] = LeafInfo(where, shape, dtype, ref.axes, "mirror", True, ref.prefix)
        else:
            source = "scalar" if not shape else "unmatched"
            infos[i] = LeafInfo(where, shape, dtype, LogicalAxes((None,) * len(shape)), source)

    params: dict[tuple[str, ...], list[LeafInfo]] = {}
    for i, info in enumerate(infos):
        if info is not None and not info.optimizer:
            names = _names(flat[i][0])
            for start in range(len(names)):  # every suffix: containers differ in prefix
                params.setdefault(names[start:], []).append(info)
    for i, path, where, shape, dtype in pending_optimizer:
        ref = _mirror(_names(path), shape, params, where)
        if ref is not None:
            infos[i] = LeafInfo(where, shape, dtype, ref.axes, "mirror", True, ref.prefix)
            continue
        axes = annotations.match(where, shape) if annotations is not None else None
        source = "annotation" if axes is not None else "scalar" if not shape else "unmatched"
        axes = axes if axes is not None else LogicalAxes((None,) * len(shape))
        infos[i] = _info(where, shape, dtype, axes, source, True)

    unmatched = [f"{i.path} {i.shape}" for i in infos if i.source == "unmatched"]
    if unmatched and on_unmatched == "error":
        listing = "\n".join(f"  {u}" for u in unmatched[:20])
        more = f"\n  ... and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""
        raise errors.UnmatchedPathError(
            f"{len(unmatched)} leaf/leaves matched no annotation:\n{listing}{more}\n"
            "Fix: add a (regex, logical_axes) pair for each, or pass "
            "on_unmatched='replicate' to replicate them."
        )
    return infos, treedef  # type: ignore[return-value]


def _info(where, shape, dtype, axes, source, optimizer) -> LeafInfo:
    """A leaf's info; fewer names than dimensions name the leading ones (Flax's rule)."""
    if len(axes) > len(shape):
        raise errors.RankMismatchError(
            f"{where}: shape {shape} has {len(shape)} dimension(s) but its logical axes "
            f"{tuple(axes)} name {len(axes)}.\nFix: give one name (or None) per dimension, "
            "at most (fewer name the leading dimensions, as Flax reads them)."
        )
    prefix = len(axes) < len(shape)
    axes = LogicalAxes((*axes, *(None,) * (len(shape) - len(axes))))
    return LeafInfo(where, shape, dtype, axes, source, optimizer, prefix)


def _relative(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A parameter's path inside its container: without the first key when the tree's
    top level is a container of states (a tuple, a NamedTuple or dataclass, or a dict
    key ``params``), the whole path when the tree is the params themselves."""
    names = _names(path)
    top = path[0] if path else None
    contained = isinstance(top, (jax.tree_util.SequenceKey, jax.tree_util.GetAttrKey))
    return names[1:] if names and (contained or names[0] == "params") else names


def _mirror(names, shape, params, where) -> LeafInfo | None:
    """The parameter sharing the longest path suffix with ``names`` (and its shape).

    Among parameters with the same suffix, the one with the shortest path wins: it is
    the parameter itself rather than a deeper one that happens to end the same way.
    """
    for start in range(len(names)):
        hits = [info for info in params.get(names[start:], ()) if info.shape == shape]
        if hits:
            shortest = min(len(h.path.split("/")) for h in hits)
            return _agreed([h for h in hits if len(h.path.split("/")) == shortest], where)
    return None


def _agreed(candidates: list[LeafInfo], where: str) -> LeafInfo:
    """The one candidate to mirror; candidates that disagree on axes are an error."""
    if len({tuple(c.axes) for c in candidates}) > 1:
        listing = "\n".join(f"  {c.path} -> {tuple(c.axes)}" for c in candidates)
        raise errors.AmbiguousAxesError(
            f"{where} copies one of several parameters with its shape, which disagree on "
            f"logical axes:\n{listing}\nFix: annotate {where} itself (a sk.PathAxes pattern), "
            "or give the parameters distinct names."
        )
    return candidates[0]


def logical_axes(
    tree: Any,
    *,
    annotations: PatternAxes | None = None,
    on_unmatched: Literal["replicate", "error"] | None = None,
) -> Any:
    """A tree of ``LogicalAxes`` (one per leaf) for params, optimizer state, or both.

    Args:
      tree: params (boxed linen params, an NNX ``State``, plain arrays or
        ``ShapeDtypeStruct``s), any optax state built from them, or a container
        of both (e.g. ``(params, opt_state)`` or a ``TrainState``).
      annotations: a ``sk.PathAxes`` for leaves Flax did not annotate.
      on_unmatched: what to do with non-scalar leaves nothing annotates; default:
        the ``annotations``' own policy (a ``sk.PathAxes`` carries one), else
        ``"replicate"``. ``sk.logical_axes(tree, annotations=pa)`` is ``pa(tree)``.

    Returns:
      A tree shaped like ``tree`` with Flax boxes / NNX Variables as single
      leaves, holding ``LogicalAxes``.
    """
    if on_unmatched is None:
        on_unmatched = getattr(annotations, "on_unmatched", "replicate")
    infos, treedef = describe_leaves(tree, annotations=annotations, on_unmatched=on_unmatched)
    return jax.tree_util.tree_unflatten(treedef, [info.axes for info in infos])
