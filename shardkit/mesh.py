"""Named device meshes from ``{axis_name: size}`` with one size inferred.

Example:
  >>> import shardkit as sk
  >>> _ = sk.emulate_devices(8)
  >>> mesh = sk.make_mesh({"data": -1, "tensor": 2})
  >>> dict(mesh.shape)
  {'data': 4, 'tensor': 2}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.errors import MeshError

__all__ = ["divisors", "make_mesh", "resolve_axis_sizes"]


def _describe(axes: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in axes.items()) + "}"


def resolve_axis_sizes(axes: Mapping[str, int], device_count: int) -> dict[str, int]:
    """Fill in the one ``-1`` size of ``axes`` so the sizes multiply to ``device_count``.

    Example:
      >>> resolve_axis_sizes({"data": -1, "tensor": 2}, 8)
      {'data': 4, 'tensor': 2}
    """
    if not axes:
        raise MeshError("A mesh needs at least one axis, e.g. {'data': -1}.")
    bad = {k: v for k, v in axes.items() if not isinstance(k, str) or not k}
    if bad:
        raise MeshError(f"Mesh axis names must be non-empty strings, got {list(bad)}.")
    for name, size in axes.items():
        if (
            isinstance(size, bool)
            or not isinstance(size, (int, np.integer))
            or (size < 1 and size != -1)
        ):
            raise MeshError(
                f"Mesh axis {name!r} has size {size!r}; sizes are positive integers, "
                f"or -1 for one axis to take the remaining devices. Axes: {_describe(axes)}."
            )
    inferred = [k for k, v in axes.items() if v == -1]
    if len(inferred) > 1:
        raise MeshError(
            f"Only one mesh axis may be -1, got {inferred} in {_describe(axes)}.\n"
            f"Fix: give all but one of them a size, e.g. {{{inferred[0]!r}: -1, "
            f"{inferred[1]!r}: 1, ...}}."
        )
    known = math.prod(int(v) for v in axes.values() if v != -1)
    sizes = {k: int(v) for k, v in axes.items()}
    if inferred:
        if device_count % known:
            raise MeshError(
                f"Mesh axes {_describe(axes)} do not factor {device_count} devices: the fixed "
                f"sizes multiply to {known}, which does not divide {device_count}.\n"
                f"Fix: choose fixed sizes whose product divides {device_count} "
                f"(divisors: {divisors(device_count)})."
            )
        sizes[inferred[0]] = device_count // known
    elif known != device_count:
        raise MeshError(
            f"Mesh axes {_describe(axes)} multiply to {known}, but there are {device_count} "
            f"devices.\nFix: make the sizes multiply to {device_count}, or set one axis to -1."
        )
    return sizes


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(
    axes: Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    explicit: bool = False,
    dcn: Mapping[str, int] | None = None,
) -> Mesh:
    """Build a named :class:`jax.sharding.Mesh` over ``devices`` (default: all).

    Args:
      axes: ordered ``{axis_name: size}``; at most one size may be ``-1``.
      devices: the devices to use; defaults to ``jax.devices()`` (every process's).
      explicit: make every axis ``AxisType.Explicit``; the default ``Auto`` lets
        XLA's partitioner propagate shardings.
      dcn: for multi-host runs, the part of each axis that spans hosts
        (``{"data": 2}`` with ``axes={"data": 8}`` puts 4 devices per host on
        ``data`` and 2 hosts across it); the remaining part stays within a host.

    Returns:
      A ``Mesh`` whose device order follows JAX's topology-aware utilities.

    Raises:
      MeshError: sizes that do not factor the device count, or a bad ``dcn``.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(axes, len(devices))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    axis_types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    if dcn:
        unknown = set(dcn) - set(sizes)
        if unknown:
            raise MeshError(f"dcn names axes {sorted(unknown)} that are not in {_describe(sizes)}.")
        bad = {
            k: v for k, v in dcn.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1
        }
        if bad:
            raise MeshError(f"dcn sizes must be positive integers, got {bad}.")
        dcn_shape = tuple(int(dcn.get(n, 1)) for n in names)
        if any(s % d for s, d in zip(shape, dcn_shape, strict=True)):
            raise MeshError(
                f"dcn sizes {_describe(dict(dcn))} must divide the axis sizes {_describe(sizes)}."
            )
        hosts = len({d.process_index for d in devices})
        if math.prod(dcn_shape) != hosts:
            raise MeshError(
                f"dcn sizes {_describe(dict(dcn))} span {math.prod(dcn_shape)} hosts, but the "
                f"devices belong to {hosts} process(es).\nFix: make the dcn sizes multiply to "
                f"{hosts} (one process per host, after jax.distributed.initialize())."
            )
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape, strict=True))
        # Multi-slice TPUs lay DCN axes across slices (``slice_index``). Devices without
        # one (CPU in one process), or all in one slice (CPU and GPU processes), are laid
        # out with each process (host) as one granule of the DCN mesh.
        slices = {getattr(d, "slice_index", None) for d in devices}
        by_process = None in slices or len(slices) != math.prod(dcn_shape)
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, process_is_granule=by_process
        )
        return Mesh(device_array, names, axis_types=axis_types)
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=devices)
