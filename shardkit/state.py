"""``AbstractState``: a train state before it exists, with its layout per leaf.

``plan.abstract_init(init_fn, key)`` returns one. It is explicit data — nothing
is remembered inside the plan — and every part of shardkit that needs a state's
layout takes it: ``plan.init`` (creates the state, born sharded), ``plan.jit``
(in/out shardings for state that comes back as host arrays), ``sk.report.build_report``
(logical axes for the table) and orbax (``abstract.tree`` is a restore target).

Example:
  >>> import jax, optax, shardkit as sk
  >>> from shardkit.models import get
  >>> model, tx = get("gpt-tiny"), optax.adam(1e-3)
  >>> init = lambda key: (p := model.init(key), tx.init(sk.unbox(p)))
  >>> abstract = sk.Plan("fsdp").abstract_init(init, jax.random.key(0))
  >>> leaf = abstract.leaf("0/wte/embedding")
  >>> leaf.axes, leaf.spec, leaf.kind
  (('vocab', 'embed'), P('fsdp', None), 'param')
  >>> abstract.tree[0]["wte"]["embedding"].sharding.spec        # what orbax restores into
  P('fsdp', None)
  >>> abstract.leaf("1/0/mu/wte/embedding").kind
  'optimizer'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.annotate.logical import LeafInfo
from shardkit.annotate.logical_axes_type import LogicalAxes
from shardkit.dtypes import itemsize
from shardkit.errors import ShardingError

__all__ = ["AbstractState", "PlannedLeaf", "TracedInit"]


@dataclasses.dataclass(frozen=True)
class PlannedLeaf:
    """One leaf of a state tree: its path, shape, kind, logical axes and planned spec."""

    info: LeafInfo
    spec: PartitionSpec

    @property
    def path(self) -> str:
        return self.info.path

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def axes(self) -> LogicalAxes:
        return self.info.axes

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def prefix(self) -> bool:
        """Its logical names were fewer than its dimensions (Flax's prefix rule)."""
        return self.info.prefix

    def shard_shape(self, mesh: Mesh) -> tuple[int, ...]:
        """The shape each device holds on ``mesh``."""
        return tuple(NamedSharding(mesh, self.spec).shard_shape(self.info.shape))

    def bytes_per_device(self, mesh: Mesh) -> int:
        """Bytes of this leaf on each device of ``mesh``."""
        return math.prod(self.shard_shape(mesh)) * itemsize(self.info.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class TracedInit:
    """``init_fn(*args)`` traced once: its jaxpr (a ``jax.extend.core.ClosedJaxpr``)
    and what it was traced from. It holds the context of that trace (precision, x64)."""

    init_fn: Callable[..., Any]
    args: tuple[Any, ...]
    jaxpr: Any

    def of(self, init_fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> bool:
        """Whether this is the trace of ``init_fn`` on ``args`` (the same objects)."""
        return self.init_fn is init_fn and self.args is args


@dataclasses.dataclass(frozen=True, eq=False)
class AbstractState:
    """Shapes, dtypes, logical axes and shardings of every leaf of a state.

    Attributes:
      tree: the state as unboxed ``jax.ShapeDtypeStruct``s carrying their planned
        ``NamedSharding`` (``jax.jit`` lowering and orbax restore take it as is).
      leaves: one :class:`PlannedLeaf` per leaf of ``tree``, in flattening order.
      mesh: the mesh the shardings live on.
      init_fn, args: how the state is made; ``plan.init(abstract)`` computes
        ``init_fn(*args)`` with its outputs born in these shardings.
      traced: the program of the trace that gave the shapes (``shardkit.state.TracedInit``),
        which ``plan.init`` compiles instead of tracing ``init_fn`` again; ``None``
        where that program holds large constants, which would stay alive with it.
        A copy with another ``init_fn`` or ``args`` (``dataclasses.replace``) is
        traced again.
    """

    tree: Any
    leaves: tuple[PlannedLeaf, ...]
    mesh: Mesh
    init_fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    traced: TracedInit | None = dataclasses.field(default=None, repr=False)

    @property
    def shardings(self) -> Any:
        """A tree of ``NamedSharding`` shaped like ``tree``."""
        return jax.tree.map(lambda x: x.sharding, self.tree)

    @property
    def axes(self) -> Any:
        """A tree of ``LogicalAxes`` shaped like ``tree``."""
        treedef = jax.tree.structure(self.tree)
        return jax.tree.unflatten(treedef, [leaf.axes for leaf in self.leaves])

    def leaf(self, path: str) -> PlannedLeaf:
        """The leaf at ``path`` (``a/b/c``).

        Raises:
          ShardingError: no leaf has that path (the message lists a few that do).
        """
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        known = ", ".join(leaf.path for leaf in self.leaves[:5])
        raise ShardingError(f"No state leaf at {path!r}. Leaves include: {known}, ...")

    def bytes_per_device(self, kind: str | None = None) -> int:
        """Bytes each device holds of the leaves of ``kind`` (default: all)."""
        return sum(
            leaf.bytes_per_device(self.mesh)
            for leaf in self.leaves
            if kind is None or leaf.kind == kind
        )

    def __repr__(self) -> str:
        mib = self.bytes_per_device() / 2**20
        return (
            f"AbstractState({len(self.leaves)} leaves, {mib:,.2f} MiB per device "
            f"on {dict(self.mesh.shape)})"
        )
