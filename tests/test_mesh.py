import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import shardkit as sk
from shardkit import errors
from shardkit.mesh import check_devices, divisors, resolve_axis_sizes


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


# -- every error names what was passed and a fix (exact texts, written from the spec) -----
def message(error, call, *args, **kwargs) -> str:
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "axes, fix",
    [([("data", 8)], "dict([('data', 8)])"), ((("data", 8),), "dict((('data', 8),))")],
)
def test_axes_as_pairs_suggest_a_dict_of_them(axes, fix):
    text = message(errors.ArgumentTypeError, resolve_axis_sizes, axes, 8)
    kind = type(axes).__name__
    assert text == (
        f"Mesh axes are a mapping {{axis_name: size}}, got {kind} {axes!r}.\nFix: pass {fix}."
    )


def test_axes_of_another_type_suggest_a_data_axis():
    assert message(errors.ArgumentTypeError, resolve_axis_sizes, "data", 8) == (
        "Mesh axes are a mapping {axis_name: size}, got str 'data'.\nFix: pass {'data': -1}."
    )


@pytest.mark.parametrize("count", ["8", 8.0, True, None])
def test_device_count_must_be_an_integer(count):
    text = message(errors.ArgumentTypeError, resolve_axis_sizes, {"data": -1}, count)
    assert text == f"The device count is an integer, got {count!r}."


def test_one_device_is_enough_and_none_is_an_error():
    assert resolve_axis_sizes({"data": -1}, 1) == {"data": 1}
    assert resolve_axis_sizes({"data": 1}, 1) == {"data": 1}
    assert message(errors.MeshError, resolve_axis_sizes, {"data": -1}, 0) == (
        "Mesh axes {'data': -1} need at least one device, got 0.\n"
        "Fix: pass a non-empty list of devices (or leave devices out for all of them)."
    )


def test_mesh_without_axes_or_with_bad_names():
    assert message(errors.MeshError, resolve_axis_sizes, {}, 8) == (
        "A mesh needs at least one axis, e.g. {'data': -1}."
    )
    assert message(errors.MeshError, resolve_axis_sizes, {"": 8, 3: 1, "ok": 1}, 8) == (
        "Mesh axis names must be non-empty strings, got ['', 3]."
    )


@pytest.mark.parametrize("size", [0, -2, 2.0, "2", True, None])
def test_axis_sizes_are_positive_integers_or_minus_one(size):
    axes = {"data": -1, "tensor": size}
    assert message(errors.MeshError, resolve_axis_sizes, axes, 8) == (
        f"Mesh axis 'tensor' has size {size!r}; sizes are positive integers, or -1 for one "
        f"axis to take the remaining devices. Axes: {{'data': -1, 'tensor': {size}}}."
    )


def test_one_is_a_valid_axis_size_and_numpy_sizes_are_plain_ints():
    sizes = resolve_axis_sizes({"data": np.int64(-1), "tensor": np.int32(1)}, np.int64(8))
    assert sizes == {"data": 8, "tensor": 1}
    assert all(type(v) is int for v in sizes.values())


def test_the_inferred_size_is_an_int():
    sizes = resolve_axis_sizes({"a": 2, "b": -1, "c": 2}, 16)
    assert sizes == {"a": 2, "b": 4, "c": 2} and type(sizes["b"]) is int
    assert list(sizes) == ["a", "b", "c"]  # the order of the axes is kept


def test_two_inferred_axes_name_both_and_a_fix():
    assert message(errors.MeshError, resolve_axis_sizes, {"a": -1, "b": 2, "c": -1}, 8) == (
        "Only one mesh axis may be -1, got ['a', 'c'] in {'a': -1, 'b': 2, 'c': -1}.\n"
        "Fix: give all but one of them a size, e.g. {'a': -1, 'c': 1, ...}."
    )


def test_sizes_that_do_not_factor_exact_text():
    assert message(errors.MeshError, resolve_axis_sizes, {"data": -1, "tensor": 3}, 8) == (
        "Mesh axes {'data': -1, 'tensor': 3} do not factor 8 devices: the fixed sizes "
        "multiply to 3, which does not divide 8.\n"
        "Fix: choose fixed sizes whose product divides 8 (divisors: [1, 2, 4, 8])."
    )
    assert message(errors.MeshError, resolve_axis_sizes, {"data": 2, "tensor": 2}, 8) == (
        "Mesh axes {'data': 2, 'tensor': 2} multiply to 4, but there are 8 devices.\n"
        "Fix: make the sizes multiply to 8, or set one axis to -1."
    )


@pytest.mark.parametrize(
    "n, expected", [(1, [1]), (7, [1, 7]), (12, [1, 2, 3, 4, 6, 12]), (16, [1, 2, 4, 8, 16])]
)
def test_divisors(n, expected):
    assert divisors(n) == expected


def test_devices_of_the_wrong_kind():
    fix = "Fix: devices=jax.devices()[:8] (or leave it out for all devices)."
    for devices in ("cpu", 8):
        text = message(errors.ArgumentTypeError, check_devices, devices)
        assert text == (
            f"devices is a list of jax.Device, got {type(devices).__name__} {devices!r}.\n{fix}"
        )
    text = message(errors.ArgumentTypeError, check_devices, [jax.devices()[0], 3, "x"])
    assert text == f"devices holds 3 (int), not a jax.Device.\n{fix}"


def test_no_devices_or_a_device_twice():
    assert message(errors.MeshError, check_devices, []) == (
        "devices is empty: a mesh needs at least one device.\nFix: pass a non-empty list "
        "(e.g. jax.devices()[:8]), or leave devices out for all of them."
    )
    d0, d1, d2 = jax.devices()[:3]
    assert message(errors.MeshError, check_devices, [d0, d1, d2, d1, d0]) == (
        f"devices lists {d1} more than once (5 entries, 3 distinct): a device can hold one "
        "place in a mesh.\nFix: pass each device once, e.g. jax.devices()[:8]."
    )


def test_devices_come_back_as_a_list_in_order():
    devices = jax.devices()[:4][::-1]
    assert check_devices(iter(devices)) == devices


def test_make_mesh_uses_the_devices_given_in_order():
    devices = jax.devices()[4:8]
    mesh = sk.make_mesh({"data": -1}, devices=devices)
    assert dict(mesh.shape) == {"data": 4}
    assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]


def test_make_mesh_argument_types():
    assert message(errors.ArgumentTypeError, sk.make_mesh, {"data": 8}, explicit=1) == (
        "make_mesh(explicit=...) is True or False, got 1."
    )
    assert message(errors.ArgumentTypeError, sk.make_mesh, {"data": 8}, dcn=[("data", 2)]) == (
        "make_mesh(dcn=...) is a mapping {axis_name: hosts}, got [('data', 2)].\n"
        "Fix: e.g. dcn={'data': 2}."
    )


def test_dcn_errors_exact_text():
    assert message(errors.MeshError, sk.make_mesh, {"data": 8}, dcn={"model": 2, "a": 1}) == (
        "dcn names axes ['a', 'model'] that are not in {'data': 8}."
    )
    for bad in (0, True, "2", 2.0):
        text = message(errors.MeshError, sk.make_mesh, {"data": 8}, dcn={"data": bad})
        assert text == f"dcn sizes must be positive integers, got {{'data': {bad!r}}}."
    assert message(errors.MeshError, sk.make_mesh, {"data": 4, "t": 2}, dcn={"data": 3}) == (
        "dcn sizes {'data': 3} must divide the axis sizes {'data': 4, 't': 2}."
    )
    assert message(errors.MeshError, sk.make_mesh, {"data": 4, "t": 2}, dcn={"t": 2}) == (
        "dcn sizes {'t': 2} span 2 hosts, but the devices belong to 1 process(es).\n"
        "Fix: make the dcn sizes multiply to 1 (one process per host, after "
        "jax.distributed.initialize())."
    )


def test_dcn_mesh_keeps_the_axis_types():
    mesh = sk.make_mesh({"data": 4, "tensor": 2}, dcn={"data": 1}, explicit=True)
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert mesh.axis_names == ("data", "tensor")


class _SliceDevice:
    """Stands in for a TPU device of a multi-slice job (CPU devices have no slice_index)."""

    def __init__(self, i, slice_index):
        self.id, self.process_index, self.slice_index = i, i // 2, slice_index


@pytest.mark.parametrize(
    "slices, granule_is_process",
    [
        ((0, 0, 1, 1), False),  # a slice per host: the slices are the DCN granules
        ((0, 0, 0, 0), True),  # one slice over 2 hosts: each process is a granule
    ],
)
def test_dcn_lays_slices_or_processes_out_as_granules(monkeypatch, slices, granule_is_process):
    from shardkit import mesh as mesh_module

    fake = [_SliceDevice(i, s) for i, s in enumerate(slices)]  # processes 0, 0, 1, 1
    processes = 2
    calls = []

    def hybrid(ici_shape, dcn_shape, devices, process_is_granule):
        calls.append((ici_shape, dcn_shape, devices, process_is_granule))
        return np.array(jax.devices()[:4]).reshape(4, 1)

    monkeypatch.setattr(mesh_module, "check_devices", lambda d: list(d))
    monkeypatch.setattr(mesh_module.mesh_utils, "create_hybrid_device_mesh", hybrid)
    dcn = {"data": processes}
    mesh = mesh_module.make_mesh({"data": 4, "tensor": 1}, devices=fake, dcn=dcn)
    [(ici, dcn_shape, devices, granule)] = calls
    assert ici == (4 // processes, 1) and all(type(s) is int for s in ici)
    assert dcn_shape == (processes, 1) and devices == fake
    assert granule is granule_is_process
    assert dict(mesh.shape) == {"data": 4, "tensor": 1}


def test_dcn_naming_unknown_axes_of_mixed_types_is_a_mesh_error():
    # hypothesis found it (tests/test_bad_input.py): sorting the unknown names raised a
    # TypeError when they mixed strings and ints
    with pytest.raises(sk.ShardingError, match=r"dcn names axes \['', 0\]"):
        sk.make_mesh({"data": -1}, dcn={"": None, 0: None})
