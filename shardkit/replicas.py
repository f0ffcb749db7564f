"""One gradient all-reduce for a replicated parameter that is read more than once.

Under data parallelism the gradient of a replicated parameter is a sum over
replicas, and GSPMD inserts that all-reduce at *each* op that reads the
parameter. A parameter read twice, such as a tied embedding (the token lookup
and the logits), is therefore all-reduced twice: GPT-2-small on 8 devices moves
1.31× the data-parallel limit, all of it the extra 50304×768 all-reduce. XLA's
CPU pipeline keeps the pair. Its GPU pipeline runs a pass that can merge
``all-reduce(a) + all-reduce(b)`` (AllReduceReassociate), but nothing here
measured it on a GPU.

``per_replica`` makes the replicas explicit instead. It takes a free broadcast
of the parameter to ``[n, ...]``, sharded over the mesh axes that split the batch
but not the parameter, with ``n`` the product of their sizes, so each device
holds its own copy. It runs every use under ``vmap`` over that axis, on the
batch split into ``n`` groups. Each use's gradient then stays a local partial
sum on its own replica, the contributions add up locally, and the broadcast's
transpose, a sum over the replica axis, is the one all-reduce. This is the
"device-indexed axis" form of JAX's ``unreduced`` type. Under Auto meshes it
does the job that type does under Explicit meshes, and it also covers gathers,
which JAX 0.10.2 gives no ``reduced`` rule.

Nothing changes where there is no such axis: no mesh or no rules, a batch that
is not sharded, or a parameter sharded on every axis of the batch (FSDP). Under
Explicit meshes ``per_replica`` also leaves the parameter alone, and JAX's own
sharding rules decide (for a lookup, they all-gather the output's cotangent).

Example:
  >>> import jax.numpy as jnp, shardkit as sk
  >>> table, tokens = jnp.ones((16, 4)), jnp.zeros((2, 3), jnp.int32)
  >>> view = sk.per_replica(table, ("vocab", "embed"), batch_size=2)
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
from jax.sharding import AxisType, PartitionSpec

from shardkit.annotate.constrain import (
    _active_mesh,
    current_activation_rules,
    current_param_rules,
)

__all__ = ["ReplicaView", "per_replica"]


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """A parameter with an explicit replica axis; see ``per_replica``.

    Attributes:
      value: ``[n, *param.shape]`` sharded over ``axes`` on its first dimension,
        or the parameter itself when ``n == 1``.
      axes: the mesh axes of the replica dimension (empty when ``n == 1``).
      n: the number of replicas.
    """

    value: jax.Array
    axes: tuple[str, ...] = ()
    n: int = 1

    def map(self, fn: Callable[..., Any], *batched: jax.Array) -> Any:
        """``fn(param, *batched)``, run once per replica on its share of the batch.

        Every array in ``batched`` has the batch as its first dimension. The
        result (any pytree of arrays with the batch first) comes back merged,
        as ``fn`` would have returned it for the whole batch.
        """
        if self.n == 1:
            return fn(self.value, *batched)
        split = [self._split(x) for x in batched]
        out = jax.vmap(fn)(self.value, *split)
        return jax.tree.map(lambda y: y.reshape(y.shape[0] * y.shape[1], *y.shape[2:]), out)

    def _split(self, x: jax.Array) -> jax.Array:
        groups = x.reshape(self.n, x.shape[0] // self.n, *x.shape[1:])
        rest = (PartitionSpec.UNCONSTRAINED,) * (groups.ndim - 1)
        return jax.lax.with_sharding_constraint(groups, PartitionSpec(self.axes, *rest))


def per_replica(
    param: jax.Array,
    logical: Sequence[str | None],
    *,
    batch_size: int,
    batch_axis: str = "batch",
) -> ReplicaView:
    """A view of ``param`` with one copy per data-parallel replica.

    Args:
      param: a parameter, as the model reads it.
      logical: its logical axes (to find the mesh axes it is sharded on).
      batch_size: the global batch size of the arrays ``map`` will split.
      batch_axis: the logical name of the batch dimension.

    Returns:
      A ``ReplicaView`` whose ``map`` runs a use of the parameter per replica. It
      has ``n == 1``, and is a plain call, when the batch has no mesh axis that
      leaves the parameter replicated.
    """
    axes = _replica_axes(param, tuple(logical), batch_size, batch_axis)
    if not axes:
        return ReplicaView(param)
    mesh = _active_mesh()
    n = math.prod(mesh.shape[a] for a in axes)
    rules = current_param_rules()
    spec = rules.spec(tuple(logical), shape=param.shape, mesh=mesh) if rules else PartitionSpec()
    spec = (*spec, *(None,) * (param.ndim - len(spec)))
    value = jnp.broadcast_to(param, (n, *param.shape))
    value = jax.lax.with_sharding_constraint(value, PartitionSpec(axes, *spec))
    return ReplicaView(value, axes, n)


def _replica_axes(
    param: jax.Array, logical: tuple[str | None, ...], batch_size: int, batch_axis: str
) -> tuple[str, ...]:
    """The leading mesh axes of the batch that do not shard ``param`` (Auto axes only)."""
    mesh, act = _active_mesh(), current_activation_rules()
    if mesh is None or act is None:
        return ()
    batch = act.spec((batch_axis,), shape=(batch_size,), mesh=mesh, path=batch_axis)[0]
    batch_axes = (batch,) if isinstance(batch, str) else tuple(batch or ())
    rules = current_param_rules()
    spec = rules.spec(logical, shape=param.shape, mesh=mesh) if rules else PartitionSpec()
    used = {a for p in spec for a in ((p,) if isinstance(p, str) else (p or ()))}
    axes: list[str] = []
    # Only a leading run of the batch's axes: splitting the batch into [n, B/n] keeps
    # the device order (and so costs nothing) only when the replica axes come first.
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    for a in batch_axes:
        if a in used or types[a] != AxisType.Auto:
            break
        axes.append(a)
    return tuple(axes)
