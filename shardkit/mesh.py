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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.errors import ArgumentTypeError, MeshError

__all__ = ["check_devices", "divisors", "make_mesh", "resolve_axis_sizes"]


def _describe(axes: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in axes.items()) + "}"


def resolve_axis_sizes(axes: Mapping[str, int], device_count: int) -> dict[str, int]:
    """Fill in the one ``-1`` size of ``axes`` so the sizes multiply to ``device_count``.

    Example:
      >>> resolve_axis_sizes({"data": -1, "tensor": 2}, 8)
      {'data': 4, 'tensor': 2}
    """
    if not isinstance(axes, Mapping):
        fix = f"dict({axes!r})" if isinstance(axes, (list, tuple)) else "{'data': -1}"
        raise ArgumentTypeError(
            f"Mesh axes are a mapping {{axis_name: size}}, got {type(axes).__name__} {axes!r}.\n"
            f"Fix: pass {fix}."
        )
    if isinstance(device_count, bool) or not isinstance(device_count, (int, np.integer)):
        raise ArgumentTypeError(f"The device count is an integer, got {device_count!r}.")
    if device_count < 1:
        raise MeshError(
            f"Mesh axes {_describe(axes)} need at least one device, got {device_count}.\n"
            "Fix: pass a non-empty list of devices (or leave devices out for all of them)."
        )
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
        sizes[inferred[0]] = int(device_count) // known
    elif known != device_count:
        raise MeshError(
            f"Mesh axes {_describe(axes)} multiply to {known}, but there are {device_count} "
            f"devices.\nFix: make the sizes multiply to {device_count}, or set one axis to -1."
        )
    return sizes


def check_devices(devices: Any) -> list[jax.Device]:
    """``devices`` as a list of distinct ``jax.Device``s.

    Raises:
      ArgumentTypeError: not a sequence of devices. MeshError: empty, or a device twice.
    """
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise ArgumentTypeError(
            f"devices is a list of jax.Device, got {type(devices).__name__} {devices!r}.\n"
            "Fix: devices=jax.devices()[:8] (or leave it out for all devices)."
        )
    devices = list(devices)
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise ArgumentTypeError(
            f"devices holds {bad[0]!r} ({type(bad[0]).__name__}), not a jax.Device.\n"
            "Fix: devices=jax.devices()[:8] (or leave it out for all devices)."
        )
    if not devices:
        raise MeshError(
            "devices is empty: a mesh needs at least one device.\nFix: pass a non-empty list "
            "(e.g. jax.devices()[:8]), or leave devices out for all of them."
        )
    twice = [d for i, d in enumerate(devices) if d in devices[:i]]
    if twice:
        raise MeshError(
            f"devices lists {twice[0]} more than once ({len(devices)} entries, "
            f"{len(set(devices))} distinct): a device can hold one place in a mesh.\n"
            "Fix: pass each device once, e.g. jax.devices()[:8]."
        )
    return devices


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
    devices = check_devices(jax.devices() if devices is None else devices)
    if not isinstance(explicit, bool):
        raise ArgumentTypeError(f"make_mesh(explicit=...) is True or False, got {explicit!r}.")
    if dcn is not None and not isinstance(dcn, Mapping):
        raise ArgumentTypeError(
            f"make_mesh(dcn=...) is a mapping {{axis_name: hosts}}, got {dcn!r}.\n"
            "Fix: e.g. dcn={'data': 2}."
        )
    sizes = resolve_axis_sizes(axes, len(devices))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    axis_types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    if dcn:
        unknown = set(dcn) - set(sizes)
        if unknown:  # sorted by their repr: the names may be of any (mixed) types
            raise MeshError(
                f"dcn names axes {sorted(unknown, key=repr)} that are not in {_describe(sizes)}."
            )
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
