"""``@sk.axes``: declare parameter logical axes next to a Flax module definition.

The decorator works for linen and NNX modules and does not touch the layer
calls. Patterns are regexes searched in each parameter's path *relative to the
decorated module*; the innermost decorated module that matches wins, and
parameters already annotated the Flax way keep their annotation.

- linen: parameters are created boxed in ``nn.LogicallyPartitioned`` (the box
  ``nn.scan`` and ``nn.get_partition_spec`` already understand).
- NNX: ``out_sharding`` metadata is set on each matching ``nnx.Variable``
  (so ``nnx.vmap``/``nnx.scan`` with ``transform_metadata`` extend it).

Example:
  >>> import flax.linen as nn, jax, jax.numpy as jnp
  >>> import shardkit as sk
  >>> @sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",)})
  ... class Mlp(nn.Module):
  ...     @nn.compact
  ...     def __call__(self, x):
  ...         return nn.Dense(16)(x)
  >>> params = Mlp().init(jax.random.key(0), jnp.ones((2, 8)))
  >>> sk.logical_axes(params)["params"]["Dense_0"]["kernel"]
  ('embed', 'mlp')
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import flax.linen as nn
import jax
from flax import nnx

from shardkit import context, errors
from shardkit.annotate.constrain import constrain_param
from shardkit.annotate.flax_meta import is_annotated_leaf, stored_axes
from shardkit.annotate.patterns import PatternAxes
from shardkit.paths import path_str

__all__ = ["axes"]

T = TypeVar("T", bound=type)


def axes(patterns: Mapping[str, Sequence[str | None]] | Iterable[Any]):
    """Class decorator: the logical axes of a module's parameters, by path pattern.

    Args:
      patterns: ``{regex: logical_axes}`` (or a list of pairs); each regex is
        searched in the parameter path relative to the module, e.g.
        ``"attn/query/kernel"`` or ``"kernel$"``.

    Returns:
      A decorator for a ``flax.linen.Module`` or ``flax.nnx.Module`` subclass.
    """
    matcher = PatternAxes(patterns)

    def decorate(cls: T) -> T:
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return _decorate_linen(cls, matcher)
        if isinstance(cls, type) and issubclass(cls, nnx.Module):
            return _decorate_nnx(cls, matcher)
        raise errors.ShardingError(
            f"@sk.axes decorates flax.linen or flax.nnx Module classes, got {cls!r}.\n"
            "Fix: for a tree you did not write, use sk.PathAxes([(regex, axes), ...])."
        )

    return decorate


def _map_matched(variables: Any, matcher: PatternAxes, owner: str, fn: Any) -> Any:
    """Apply ``fn(leaf, names, path)`` to each plain parameter a pattern matches.

    Paths are relative to the module; boxed leaves (already annotated) are kept.
    """
    if "params" not in variables:
        return variables

    def visit(path, leaf):
        if is_annotated_leaf(leaf):
            return leaf
        rel = path_str(path)
        names = matcher.match(rel, leaf.shape, where=f"{owner}: {rel}")
        return leaf if names is None else fn(leaf, tuple(names), f"{owner}/{rel}")

    params = jax.tree_util.tree_map_with_path(visit, variables["params"], is_leaf=is_annotated_leaf)
    return {**variables, "params": params}


def _box_tree(variables: Any, matcher: PatternAxes, owner: str) -> Any:
    """At init: box new parameters in ``nn.LogicallyPartitioned`` with their axes."""
    return _map_matched(
        variables, matcher, owner, lambda leaf, names, _: nn.LogicallyPartitioned(leaf, names)
    )


def _pin_params(variables: Any, matcher: PatternAxes, owner: str) -> Any:
    """When applied: pin each parameter the module reads to its planned sharding
    (:func:`~shardkit.annotate.constrain.constrain_param`: a replicated one is left as read)."""
    if context.current().param_rules is None:
        return variables
    return _map_matched(
        variables, matcher, owner, lambda leaf, names, path: constrain_param(leaf, names, path=path)
    )


def _decorate_linen(cls: T, matcher: PatternAxes) -> T:
    boxed = nn.map_variables(
        cls,
        "params",
        trans_in_fn=functools.partial(_pin_params, matcher=matcher, owner=cls.__name__),
        trans_out_fn=functools.partial(_box_tree, matcher=matcher, owner=cls.__name__),
        init=True,
        mutable=True,
    )
    # Keep the user's class identity for auto-naming ("Block_0") and repr.
    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        setattr(boxed, attr, getattr(cls, attr))
    boxed.__shardkit_axes__ = matcher
    boxed.__shardkit_wrapped__ = cls  # not __wrapped__: doctest would collect cls twice
    return boxed  # type: ignore[return-value]


def _annotate_nnx(module: nnx.Module, matcher: PatternAxes) -> None:
    owner = type(module).__name__
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or stored_axes(node) is not None:
            continue
        rel = path_str(path)
        names = matcher.match(rel, node.shape, where=f"{owner}: {rel}")
        if names is not None:
            node.set_metadata(out_sharding=tuple(names))


def _decorate_nnx(cls: T, matcher: PatternAxes) -> T:
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _annotate_nnx(self, matcher)

    cls.__init__ = __init__
    cls.__shardkit_axes__ = matcher
    return cls
