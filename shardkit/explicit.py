"""What model code gives JAX under Explicit axes: ``out_sharding``s from logical axes.

Under an Explicit mesh (``sk.Plan(recipe, explicit=True)``) every array's sharding is
part of its type, and JAX refuses an op whose result's sharding it cannot infer without
collectives — a lookup in an embedding table whose rows are split over devices, with
token ids split over others, is one. :func:`out_spec` names that sharding the way the
rest of shardkit does: logical axes resolved by the active activation rules, never a
mesh axis name. :func:`take` is the embedding lookup with it: under Explicit axes it
runs the gather with the mesh's axes Auto (``jax.sharding.auto_axes``: XLA lays it out
as it does under an Auto mesh) and gives the result the sharding its logical axes map
to; under Auto axes, or outside a plan, it is ``jnp.take``.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from shardkit import context, explicit
  >>> mesh = sk.make_mesh({"data": 2}, devices=jax.devices()[:2], explicit=True)
  >>> rules = sk.Rules([("batch", "data")])
  >>> with jax.set_mesh(mesh), context.using(activation_rules=rules):
  ...     explicit.out_spec(("batch", "length", "embed"), (4, 3, 8))
  PartitionSpec('data', None, None)
  >>> explicit.out_spec(("batch",), (4,)) is None   # no plan: nothing to say
  True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import is_explicit

__all__ = ["auto", "out_spec"]


def out_spec(logical: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec | None:
    """The ``out_sharding`` for a result with ``logical`` axes under an Explicit mesh.

    ``None`` (let JAX infer it) when the active mesh is not Explicit, or there is no
    mesh or no activation rules.
    """
    mesh, rules = context.active_mesh(), context.current().activation_rules
    if mesh is None or rules is None or not is_explicit(mesh):
        return None
    return rules.spec(tuple(logical), shape=tuple(shape), mesh=mesh, path="out_sharding")


def auto(fn: Callable[..., Any], logical: Sequence[str | None], shape: Sequence[int]):
    """``fn`` run with the mesh's axes Auto when they are Explicit; its result typed.

    The result (one array of ``shape``) gets the sharding its ``logical`` axes map to
    (:func:`out_spec`). Under Auto axes, or outside a plan, ``fn`` itself.

    Example:
      >>> auto(jnp.sum, (), ())(jnp.ones(3)).tolist()   # no plan: fn itself
      3.0
    """
    spec = out_spec(logical, shape)
    if spec is None:
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=spec)
