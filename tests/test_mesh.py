import jax
import pytest
from jax.sharding import AxisType

import shardkit as sk
from shardkit import errors
from shardkit.mesh import resolve_axis_sizes


def test_minus_one_is_filled_from_device_count():
    mesh = sk.make_mesh({"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    assert mesh.axis_names == ("data", "tensor")
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_explicit_opt_in():
    mesh = sk.make_mesh({"data": 8}, explicit=True)
    assert mesh.axis_types == (AxisType.Explicit,)


def test_subset_of_devices():
    mesh = sk.make_mesh({"data": 2}, devices=jax.devices()[:2])
    assert mesh.devices.size == 2


def test_sizes_that_do_not_factor():
    with pytest.raises(
        errors.MeshError, match=r"\{'data': -1, 'tensor': 3\}.*do not factor 8 devices"
    ):
        sk.make_mesh({"data": -1, "tensor": 3})
    with pytest.raises(errors.MeshError, match=r"multiply to 4, but there are 8 devices"):
        sk.make_mesh({"data": 2, "tensor": 2})


def test_more_than_one_inferred_axis():
    with pytest.raises(errors.MeshError, match="Only one mesh axis may be -1"):
        resolve_axis_sizes({"a": -1, "b": -1}, 8)


@pytest.mark.parametrize("axes", [{}, {"data": 0}, {"data": 2.0}, {"": 8}])
def test_bad_axes(axes):
    with pytest.raises(errors.MeshError):
        resolve_axis_sizes(axes, 8)


def test_dcn_hybrid_mesh_shape():
    # One process here, so the hybrid layout degenerates but must still validate.
    with pytest.raises(errors.MeshError, match="dcn names axes"):
        sk.make_mesh({"data": 8}, dcn={"model": 2})
    with pytest.raises(errors.MeshError, match="must divide"):
        sk.make_mesh({"data": 8}, dcn={"data": 3})


def test_emulate_devices_same_count_is_harmless_other_count_is_clear():
    assert len(sk.emulate_devices(8)) == 8
    with pytest.raises(errors.DeviceError, match=r"already started with 8 CPU device\(s\)"):
        sk.emulate_devices(4)
    with pytest.raises(errors.DeviceError):
        sk.emulate_devices(0)


def test_dcn_sizes_must_match_the_processes():
    with pytest.raises(errors.MeshError, match="positive integers"):
        sk.make_mesh({"data": 8}, dcn={"data": 0})
    with pytest.raises(errors.MeshError, match=r"span 2 hosts, but the devices belong to 1"):
        sk.make_mesh({"data": 8}, dcn={"data": 2})


def test_dcn_on_cpu_devices_without_slices_uses_processes():
    # CPU devices carry no slice_index: each process is one DCN granule (here, one).
    mesh = sk.make_mesh({"data": 4, "tensor": 2}, dcn={"data": 1})
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
