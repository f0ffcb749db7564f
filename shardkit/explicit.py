"""Explicit mesh axes: run a model's layers with the axes Auto, its result typed.

Under an Explicit mesh (``sk.Plan(recipe, explicit=True)``, JAX's sharding in types)
every array's sharding is part of its type, and JAX refuses an op whose result's
sharding it cannot infer without collectives. Typed op by op, the reference models meet
that at the embedding lookup (a table split over devices, ids split over others), at
every weight an activation split differently meets (FSDP's norm scales and biases), at
contractions over a split dimension (TP), at ``jnp.repeat`` (Llama's K/V heads) and
where the sequence and the heads share a mesh axis (TP+SP). Only ``dp``, ``cp`` and the
pipelines (``shard_map``) ran with the lookup typed alone.

:func:`auto` is how the reference models (``shardkit.models.Model``'s ``loss`` and
``apply``) run instead: the model with the mesh's axes Auto (``jax.sharding.auto_axes``:
inside, ``sk.constrain``, ``@sk.axes`` and ``sk.per_replica`` lay it out as under an
Auto mesh), and its result typed by its logical axes through the active activation
rules (:func:`out_spec`), never a mesh axis name. The step around it — gradients, the
optimizer, the new state — stays Explicit. Under Auto axes, or outside a plan, both
functions step aside.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from shardkit import context, explicit
  >>> mesh = sk.make_mesh({"data": 2}, devices=jax.devices()[:2], explicit=True)
  >>> rules = sk.Rules([("batch", "data")])
  >>> with jax.set_mesh(mesh), context.using(activation_rules=rules):
  ...     explicit.out_spec(("batch", "length", "embed"), (4, 3, 8))
  P('data', None, None)
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
      >>> import jax.numpy as jnp
      >>> auto(jnp.sum, (), ())(jnp.ones(3)).tolist()   # no plan: fn itself
      3.0
    """
    spec = out_spec(logical, shape)
    if spec is None:
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=spec)
