"""One gradient all-reduce for a replicated parameter that is read more than once.

Under data parallelism the gradient of a replicated parameter is a sum over
replicas, and GSPMD inserts that all-reduce at *each* op that reads the
parameter. A parameter read twice, such as a tied embedding (the token lookup
and the logits), is therefore all-reduced twice. Without this module, GPT-2-small
under ``dp`` on 8 devices moved 1.31× the data-parallel limit, the excess being
exactly the extra 50304×768 all-reduce. XLA's CPU pipeline keeps the pair. Its
GPU pipeline runs a pass that can merge ``all-reduce(a) + all-reduce(b)``
(AllReduceReassociate), but that has not been measured on a GPU here.

``per_replica`` makes the replicas explicit:

- it broadcasts the parameter to ``[n, ...]`` for free, sharded over the mesh
  axes that split the data but not the parameter, so each device holds its own
  copy;
- ``map`` runs each use under ``vmap`` over that axis, on the data split into
  ``n`` blocks;
- each use's gradient stays a partial sum on its own replica, the uses add up
  locally, and the broadcast's transpose (a sum over the replica axis) is the
  one all-reduce.

The data is split along every dimension the mesh shards. Under context
parallelism (the length split over ``sequence``) the replicas are therefore
(batch, length) blocks, and ``fn`` must treat each token on its own, as a lookup
or a projection does. This is the "device-indexed axis" form of JAX's
``unreduced`` type: it works under Auto meshes, and around gathers, which have
no ``reduced`` rule in JAX 0.10.2.

Nothing changes (``map`` is a plain call) where there is no such axis: data
that is not sharded, or a parameter sharded on every axis of the data (FSDP).
Nor where the layouts are unknown or not GSPMD's to choose: no mesh, no
activation or parameter rules (``plan.jit`` enters both), or Explicit axes.
There JAX's sharding types decide, and each use's gradient is reduced on its
own: a tied 50304 × 768 table under ``dp`` on 8 devices moves 516 MiB of
all-reduce per device instead of 258 (``benchmarks/explicit.py --per-replica``).
JAX's ``unreduced`` type would keep the uses' partial sums apart until one
reduction, but this JAX has no rule for gathers (the lookup). The reference
models do not meet this case: under an Explicit mesh they run with the mesh's
axes Auto (``shardkit.explicit.auto``), where this function works as above.

Example:
  >>> import jax.numpy as jnp, shardkit as sk
  >>> table, tokens = jnp.ones((16, 4)), jnp.zeros((2, 3), jnp.int32)
  >>> view = sk.per_replica(table, ("vocab", "embed"), data=tokens, data_axes=("batch", "length"))
  >>> view.map(lambda t, ids: jnp.take(t, ids, axis=0), tokens).shape   # no mesh: plain call
  (2, 3, 4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from shardkit import context
from shardkit.rules import entry_axes
from shardkit.scopes import block, model_code

__all__ = ["ReplicaView", "per_replica"]


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """A parameter with an explicit replica axis; see ``per_replica``.

    Attributes:
      value: ``[n, *param.shape]`` sharded over ``axes`` on its first dimension,
        or the parameter itself when ``n == 1``.
      groups: per leading data dimension, the number of replicas along it.
      axes: the mesh axes of the replica dimension (empty when ``n == 1``).
    """

    value: jax.Array
    groups: tuple[int, ...] = ()
    axes: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        """The number of replicas."""
        return math.prod(self.groups)

    def map(self, fn: Callable[..., Any], *data: jax.Array) -> Any:
        """``fn(param, *data)``, run once per replica on its block of the data.

        Every array in ``data`` leads with the dimensions ``per_replica`` was given
        (e.g. batch and length). The result (any pytree of arrays with the same
        leading dimensions) comes back merged, as ``fn`` would have returned it for
        all the data.
        """
        fn = model_code(fn)  # the caller's code, run per replica
        if self.n == 1:
            return fn(self.value, *data)
        out = jax.vmap(fn)(self.value, *(self._split(x) for x in data))
        return jax.tree.map(self._merge, out)

    @block("replicas.split")
    def _split(self, x: jax.Array) -> jax.Array:
        """``[D0, D1, ..., rest]`` to ``[n, D0/g0, D1/g1, ..., rest]``, replica-major."""
        k = len(self.groups)
        blocks = [d // g for g, d in zip(self.groups, x.shape[:k], strict=True)]
        pairs = [e for g, b in zip(self.groups, blocks, strict=True) for e in (g, b)]
        x = x.reshape(*pairs, *x.shape[k:])
        x = x.transpose(*range(0, 2 * k, 2), *range(1, 2 * k, 2), *range(2 * k, x.ndim))
        x = x.reshape(self.n, *blocks, *x.shape[2 * k :])
        rest = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)
        return jax.lax.with_sharding_constraint(x, PartitionSpec(self.axes, *rest))

    @block("replicas.merge")
    def _merge(self, y: jax.Array) -> jax.Array:
        k = len(self.groups)
        blocks = y.shape[1 : 1 + k]
        y = y.reshape(*self.groups, *blocks, *y.shape[1 + k :])
        y = y.transpose(*(i for j in range(k) for i in (j, k + j)), *range(2 * k, y.ndim))
        merged = [g * b for g, b in zip(self.groups, blocks, strict=True)]
        return y.reshape(*merged, *y.shape[2 * k :])


@block("replicas")
def per_replica(
    param: jax.Array,
    logical: Sequence[str | None],
    *,
    data: jax.Array,
    data_axes: Sequence[str | None] = ("batch",),
) -> ReplicaView:
    """A view of ``param`` with one copy per data-parallel replica.

    Args:
      param: a parameter, as the model reads it.
      logical: its logical axes (to find the mesh axes it is sharded on).
      data: an array ``map`` will split (only the shape of its leading dimensions
        is used), e.g. the tokens.
      data_axes: the logical names of those leading dimensions.

    Returns:
      A ``ReplicaView`` whose ``map`` runs a use of the parameter per replica. It
      has ``n == 1``, and is a plain call, when no Auto mesh axis splits the data
      but leaves the parameter replicated.

    Raises:
      ShardingError: the data's shape does not fit the activation rules (e.g. a
        batch the data axis does not divide).
    """
    ctx, mesh = context.current(), context.active_mesh()
    act, rules = ctx.activation_rules, ctx.param_rules
    if mesh is None or act is None or rules is None:
        return ReplicaView(param)  # the layouts are unknown: leave them to XLA
    spec = rules.spec(tuple(logical), shape=param.shape, mesh=mesh)
    used = {a for entry in spec for a in entry_axes(entry)}
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] != AxisType.Auto for a in used):
        return ReplicaView(param)  # Explicit axes: JAX's sharding types decide
    data_axes = tuple(data_axes)
    data_spec = act.spec(data_axes, shape=np.shape(data)[: len(data_axes)], mesh=mesh, path="data")
    groups, axes = [], []
    for entry in data_spec:
        # Only a leading run of a dimension's mesh axes: splitting it into [g, D/g]
        # keeps the device order (so costs nothing) when the replica axes come first.
        run = []
        for a in entry_axes(entry):
            if a in used or types[a] != AxisType.Auto:
                break
            run.append(a)
        groups.append(math.prod(mesh.shape[a] for a in run))
        axes += run
    if math.prod(groups) == 1:
        return ReplicaView(param)
    value = jnp.broadcast_to(param, (math.prod(groups), *param.shape))
    value = jax.lax.with_sharding_constraint(value, PartitionSpec(tuple(axes), *spec))
    return ReplicaView(value, tuple(groups), tuple(axes))
