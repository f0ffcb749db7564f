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

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import is_explicit
from shardkit.errors import ShardingError

__all__ = ["auto", "auto_axes_error", "out_spec"]

#: JAX's refusal of a mesh-axis ``out_sharding=`` (or ``reshard``) under Auto axes.
_AUTO_REFUSAL = re.compile(
    r"PartitionSpec passed to (?P<op>\S+) cannot contain axis names that are of type Auto"
    r".*?Got PartitionSpec: (?P<spec>P\(.*?\)) with axis name: (?P<axis>\S+) of type: "
    r"AxisType\.Auto(?:.*?This error occurs at source:\s*(?P<source>[^\n]*))?",
    re.DOTALL,
)


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


def auto_axes_error(error: BaseException, recipe: str) -> ShardingError | None:
    """A ``ShardingError`` for JAX's refusal of a mesh-axis ``out_sharding=`` under
    Auto axes (the NNX way: ``jnp.einsum(..., out_sharding=P('data', None))``), naming
    the op, its spec and where the model calls it; ``None`` for any other error.

    Such a model annotates with mesh axes and asks for sharding in types: it runs under
    an Explicit mesh, ``sk.Plan(recipe, explicit=True)``.

    Example:
      >>> e = ValueError("PartitionSpec passed to einsum cannot contain axis names that "
      ...                "are of type Auto or Manual. Got PartitionSpec: P('data', None) "
      ...                "with axis name: data of type: AxisType.Auto.")
      >>> print(auto_axes_error(e, "fsdp"))  # doctest: +ELLIPSIS
      The model passes out_sharding=P('data', None) to einsum, ... sk.Plan('fsdp', explicit=True) ...
    """
    match = _AUTO_REFUSAL.search(str(error))
    if match is None:
        return None
    where = f" at {match['source'].strip()}" if match["source"] else ""
    return ShardingError(
        f"The model passes out_sharding={match['spec']} to {match['op']}{where}, but the "
        f"plan's mesh axes are Auto (mesh axis {match['axis']!r}): a mesh-axis sharding on "
        "an op is sharding in types, which JAX allows only on Explicit axes.\n"
        f"Fix: sk.Plan({recipe!r}, explicit=True) (or a mesh from "
        "sk.make_mesh(..., explicit=True)); or drop out_sharding= and let the plan's "
        "rules lay the op out (sk.constrain(x, logical_axes) where it matters)."
    )
