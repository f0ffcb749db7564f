"""What restoring a checkpoint into another layout reads, before it is run.

A checkpoint stores each array in chunks: under orbax, one chunk per distinct shard of
the layout that saved it, and a replicated shard is further split between its replicas
along its first dimension that their count divides (replica-parallel writing). A
restore reads, for each distinct shard of the new layout, every chunk that shard
overlaps, whole. :func:`reshard_plan` counts those bytes from the two layouts alone
(shapes, dtypes and ``NamedSharding``\\ s, e.g. two ``plan.abstract_init`` results),
with no checkpoint and no compile.

Example: a 256 × 64 float32 embedding saved row-split over 8 devices (chunks of 32
rows) and restored row-split over 4 (64 rows each) reads exactly its 2 chunks per
device:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> def abstract(n, spec):
  ...     mesh = sk.make_mesh({"x": n}, devices=jax.devices()[:n])
  ...     return {"wte": jax.ShapeDtypeStruct((256, 64), jnp.float32,
  ...                                         sharding=NamedSharding(mesh, spec))}
  >>> plan = reshard_plan(abstract(8, P("x")), abstract(4, P("x")))
  >>> leaf = plan.leaves[0]
  >>> leaf.chunk_shape, leaf.held_per_device, leaf.read_per_device
  ((32, 64), 16384, 16384)
  >>> reshard_plan(abstract(8, P("x")), abstract(2, P())).leaves[0].read_per_device
  65536
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from shardkit.checkpoint import leaf_paths
from shardkit.dtypes import dtype_name
from shardkit.dtypes import itemsize as dtype_itemsize
from shardkit.errors import CheckpointMismatchError

__all__ = ["LeafRead", "ReshardPlan", "reshard_plan", "saved_chunk_shape"]


@dataclasses.dataclass(frozen=True)
class LeafRead:
    """One leaf: its saved chunks and what each device of the new layout reads."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    saved_spec: str
    restored_spec: str
    chunk_shape: tuple[int, ...]
    held_per_device: int  # bytes of the largest shard a device holds after the restore
    read_per_device: int  # bytes of the chunks the largest reader reads
    read_total: int  # bytes read by all processes (each distinct shard once per process)


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The reads of a whole restore."""

    leaves: list[LeafRead]
    read_by_device: dict[int, int]  # device id -> bytes of chunks its shards overlap
    held_by_device: dict[int, int]  # device id -> bytes it holds after the restore
    peak_host_bytes: int  # largest process: host buffers of all leaves in flight at once
    processes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "leaves": [dataclasses.asdict(leaf) for leaf in self.leaves],
            "read_by_device": {str(k): v for k, v in self.read_by_device.items()},
            "held_by_device": {str(k): v for k, v in self.held_by_device.items()},
            "peak_host_bytes": self.peak_host_bytes,
            "processes": self.processes,
        }


def saved_chunk_shape(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[int, ...]:
    """The chunk shape orbax writes ``shape`` in under ``sharding``.

    Example:
      >>> import shardkit as sk
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = sk.make_mesh({"x": 8})
      >>> saved_chunk_shape((64, 256), NamedSharding(mesh, P("x")))
      (8, 256)
      >>> saved_chunk_shape((2, 256), NamedSharding(mesh, P()))  # 8 replicas split dim 1
      (2, 32)
    """
    shard = tuple(sharding.shard_shape(shape))
    indices = sharding.devices_indices_map(shape)
    distinct = {_box(idx, shape) for idx in indices.values()}
    replicas = len(indices) // max(len(distinct), 1)
    if replicas <= 1 or math.prod(shard) == 0:
        return shard
    for axis, size in enumerate(shard):
        if size % replicas == 0:
            return tuple(s // replicas if a == axis else s for a, s in enumerate(shard))
    return shard


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (sl.start or 0, size if sl.stop is None else sl.stop)
        for sl, size in zip(index, shape, strict=True)
    )


def _chunk_bytes_read(box, chunk, shape, itemsize) -> int:
    """Bytes of the chunks of a regular ``chunk`` grid that ``box`` overlaps."""
    covered = 1
    for (start, stop), c, size in zip(box, chunk, shape, strict=True):
        if stop <= start:
            return 0
        first, last = start // c, (stop - 1) // c
        covered *= min((last + 1) * c, size) - first * c
    return covered * itemsize


def reshard_plan(
    saved: Any, restored: Any, *, process_of: Callable[[jax.Device], int] | None = None
) -> ReshardPlan:
    """Bytes each device reads when state saved as ``saved`` is restored as ``restored``.

    Both are trees (or objects with ``.tree``) of arrays or ``ShapeDtypeStruct``\\ s with
    shardings, leaf for leaf the same names, shapes and dtypes. ``process_of`` maps a
    restoring device to its process (default: ``device.process_index``); a process
    reads each distinct shard once for all its devices.

    Raises:
      CheckpointMismatchError: the two trees do not hold the same leaves.
    """
    saved, restored = getattr(saved, "tree", saved), getattr(restored, "tree", restored)
    names, targets = leaf_paths(restored), jax.tree.leaves(restored)
    sources = dict(zip(leaf_paths(saved), jax.tree.leaves(saved), strict=True))
    leaves: list[LeafRead] = []
    read_by_device: dict[int, int] = {}
    held_by_device: dict[int, int] = {}
    host_by_process: dict[int, int] = {}
    processes: set[int] = set()
    for name, target in zip(names, targets, strict=True):
        source = sources.get(name)
        if source is None or tuple(source.shape) != tuple(target.shape):
            found = "no such leaf" if source is None else f"shape {tuple(source.shape)}"
            raise CheckpointMismatchError(
                f"{name}: the restored layout has shape {tuple(target.shape)}, the saved one "
                f"{found}.\nFix: compare layouts of the same model."
            )
        shape, itemsize = tuple(target.shape), dtype_itemsize(target.dtype)
        chunk = saved_chunk_shape(shape, source.sharding) if shape else ()
        per_device_read, per_device_held = {}, {}
        per_process: dict[int, set] = {}
        for device, index in target.sharding.devices_indices_map(shape).items():
            box = _box(index, shape)
            held = math.prod(b - a for a, b in box) * itemsize
            read = _chunk_bytes_read(box, chunk, shape, itemsize) if shape else itemsize
            per_device_read[device.id], per_device_held[device.id] = read, held
            process = device.process_index if process_of is None else process_of(device)
            per_process.setdefault(process, set()).add((box, read))
            processes.add(process)
        for d, b in per_device_read.items():
            read_by_device[d] = read_by_device.get(d, 0) + b
        for d, b in per_device_held.items():
            held_by_device[d] = held_by_device.get(d, 0) + b
        total = 0
        for p, reads in per_process.items():
            process_bytes = sum(r for _, r in reads)
            host_by_process[p] = host_by_process.get(p, 0) + process_bytes
            total += process_bytes
        leaves.append(
            LeafRead(
                path=name,
                shape=shape,
                dtype=dtype_name(target.dtype),
                saved_spec=_spec(source.sharding),
                restored_spec=_spec(target.sharding),
                chunk_shape=chunk,
                held_per_device=max(per_device_held.values()),
                read_per_device=max(per_device_read.values()),
                read_total=total,
            )
        )
    return ReshardPlan(
        leaves=leaves,
        read_by_device=dict(sorted(read_by_device.items())),
        held_by_device=dict(sorted(held_by_device.items())),
        peak_host_bytes=max(host_by_process.values(), default=0),
        processes=len(processes),
    )


def _spec(sharding: Any) -> str:
    spec = getattr(sharding, "spec", None)
    return "P()" if spec is None else str(spec)
