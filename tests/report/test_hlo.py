"""Tests for shardkit.report.hlo: the collective inventory of optimized HLO text."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.collectives import KINDS
from shardkit.report import Collective, bytes_by_kind, parse_collectives, wire_bytes_by_kind

ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def module(entry: str, *computations: str, header: str = "HloModule m, num_partitions=8") -> str:
    """An HLO module text with the given ENTRY body (instruction lines) and computations."""
    body = "\n".join("  " + ln.strip() for ln in entry.strip().splitlines())
    return "\n".join([header, ADD, *computations, f"ENTRY %main () -> f32[] {{\n{body}\n}}\n"])


def one(text: str) -> Collective:
    cs = parse_collectives(text)
    assert len(cs) == 1, cs
    return cs[0]


# ------------------------------------------------------------------ hand-made snippets
def test_tuple_all_reduce_counts_every_element():
    c = one(
        module("""
        %a = f32[64]{0} parameter(0)
        %b = bf16[256,64]{1,0} parameter(1)
        %ar = (f32[64]{0}, /*index=1*/bf16[256,64]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/grad"}
    """)
    )
    assert c.kind == "all-reduce"
    assert c.bytes == 64 * 4 + 256 * 64 * 2
    assert c.group_size == 4
    assert c.wire_bytes == pytest.approx(2 * 3 / 4 * c.bytes)
    assert c.count == 1 and c.count_exact
    assert c.op_name == "jit(step)/grad" and c.computation == "main"
    assert c.dtype == "f32,bf16" and c.shapes == ((64,), (256, 64)) and c.shape == (64,)


def test_async_all_gather_start_done_uses_gathered_result():
    c = one(
        module("""
        %p = f32[8,16]{1,0} parameter(0)
        %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
        %agd = f32[64,16]{1,0} all-gather-done((f32[8,16]{1,0}, f32[64,16]{1,0}) %ags)
    """)
    )
    assert (c.kind, c.bytes, c.group_size, c.shape) == ("all-gather", 64 * 16 * 4, 8, (64, 16))
    assert c.wire_bytes == pytest.approx(7 / 8 * 64 * 16 * 4)


def test_async_all_reduce_and_collective_permute_start_done():
    cs = parse_collectives(
        module("""
        %a = f32[1024]{0} parameter(0)
        %b = bf16[512]{0} parameter(1)
        %ars = (f32[1024]{0}, bf16[512]{0}) all-reduce-start(%a, %b), replica_groups={{0,1}}, to_apply=%add
        %ard = (f32[1024]{0}, bf16[512]{0}) all-reduce-done(%ars)
        %ar1 = f32[1024]{0} all-reduce-start(%a), replica_groups=[4,2]<=[8], to_apply=%add
        %ar1d = f32[1024]{0} all-reduce-done(%ar1)
        %cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=4, source_target_pairs={{0,1},{1,0}}
        %cpd = f32[1024]{0} collective-permute-done(%cps)
    """)
    )
    assert [(c.kind, c.bytes, c.group_size) for c in cs] == [
        ("all-reduce", 4096 + 1024, 2),
        ("all-reduce", 4096, 2),
        ("collective-permute", 4096, 2),
    ]
    assert cs[2].wire_bytes == 4096.0


def test_async_wrapped_collectives_count_once_at_the_start():
    wrapped = """
%wrapped_reduce_scatter (param.2: f32[64,16]) -> f32[8,16] {
  %param.2 = f32[64,16]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8,16]{1,0} reduce-scatter(%param.2), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}
"""
    text = module(
        """
        %x = f32[64,16]{1,0} parameter(0)
        %rss = ((f32[64,16]{1,0}), f32[8,16]{1,0}, s32[]) async-start(%x), calls=%wrapped_reduce_scatter, metadata={op_name="rs"}
        %rsd = f32[8,16]{1,0} async-done(%rss), calls=%wrapped_reduce_scatter
        %a2as = ((f32[8,16]{1,0}), f32[8,16]{1,0}) all-to-all-start(%rsd), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
        %a2ad = f32[8,16]{1,0} all-to-all-done(%a2as)
        """,
        wrapped,
    )
    rs, a2a = parse_collectives(text)
    assert (rs.kind, rs.bytes, rs.group_size, rs.count) == ("reduce-scatter", 64 * 16 * 4, 8, 1)
    assert rs.computation == "main" and rs.op_name == "rs"
    assert rs.wire_bytes == pytest.approx(7 / 8 * 4096)
    assert (a2a.kind, a2a.bytes, a2a.group_size) == ("all-to-all", 512, 4)
    assert a2a.wire_bytes == pytest.approx(3 / 4 * 512)


def test_reduce_scatter_uses_operand():
    c = one(
        module("""
        %p = f32[64,32]{1,0} parameter(0)
        %rs = f32[64,4]{1,0} reduce-scatter(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={1}, to_apply=%add
    """)
    )
    assert (c.kind, c.bytes, c.group_size, c.shape) == ("reduce-scatter", 64 * 32 * 4, 8, (64, 32))
    assert c.wire_bytes == pytest.approx(7 / 8 * 64 * 32 * 4)
    # operand not in the text: the scatter dimension times N
    c = one(
        module("""
        %rs = f32[64,4]{1,0} reduce-scatter(%missing), replica_groups=[1,8]<=[8], dimensions={1}, to_apply=%add
    """)
    )
    assert (c.bytes, c.shape) == (64 * 32 * 4, (64, 32))


def test_all_to_all_and_collective_permute_sync():
    cs = parse_collectives(
        module("""
        %p = s8[4096]{0} parameter(0)
        %a2a = s8[4096]{0} all-to-all(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
        %cp = s8[4096]{0} collective-permute(%p), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
    """)
    )
    assert [(c.kind, c.bytes, c.group_size, c.wire_bytes) for c in cs] == [
        ("all-to-all", 4096, 8, 3584.0),
        ("collective-permute", 4096, 4, 4096.0),
    ]


@pytest.mark.parametrize(
    "groups,n",
    [
        ("{{0,1,2,3,4,5,6,7}}", 8),
        ("{{0,4},{1,5},{2,6},{3,7}}", 2),
        ("{}", 8),  # all devices: replica_count * num_partitions
        ("[2,4]<=[8]", 4),
        ("[4,2]<=[2,4]T(1,0)", 2),
        ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", 8),
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", 4),
        ("mesh['x'=2,'y'=4] {'x','y'}", 8),
        ("mesh[a=8,b=2] {a:(2)4}", 4),
    ],
)
def test_replica_group_forms(groups, n):
    c = one(
        module(f"""
        %p = f32[10]{{0}} parameter(0)
        %ar = f32[10]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
    """)
    )
    assert c.group_size == n
    assert c.wire_bytes == pytest.approx(2 * (n - 1) / n * 40)


@pytest.mark.parametrize(
    "dtype,nbytes",
    [
        ("pred", 1),
        ("s8", 1),
        ("u8", 1),
        ("s16", 2),
        ("u16", 2),
        ("f16", 2),
        ("bf16", 2),
        ("s32", 4),
        ("u32", 4),
        ("f32", 4),
        ("s64", 8),
        ("u64", 8),
        ("f64", 8),
        ("c64", 8),
        ("c128", 16),
        ("f8e4m3fn", 1),
        ("f8e5m2", 1),
        ("f8e4m3b11fnuz", 1),
    ],
)
def test_element_sizes(dtype, nbytes):
    c = one(
        module(f"""
        %p = {dtype}[3,5]{{1,0}} parameter(0)
        %ag = {dtype}[24,5]{{1,0}} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={{0}}
    """)
    )
    assert c.bytes == 24 * 5 * nbytes and c.dtype == dtype


def test_while_trip_counts_multiply_along_nested_calls():
    inner = """
%inner_body (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %ar = f32[256]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
%helper (q: f32[256]) -> f32[256] {
  %q = f32[256]{0} parameter(0)
  ROOT %w2 = f32[256]{0} while(%q), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}
%cond (c: f32[256]) -> pred[] {
  %c = f32[256]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}
%outer_body (r: f32[256]) -> f32[256] {
  %r = f32[256]{0} parameter(0)
  %call = f32[256]{0} call(%r), to_apply=%helper
  ROOT %ag = f32[256]{0} all-gather(%call), replica_groups=[4,2]<=[8], dimensions={0}
}
"""
    text = module(
        """
        %x = f32[256]{0} parameter(0)
        %w = f32[256]{0} while(%x), condition=%cond, body=%outer_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"12"}}
        %ar0 = f32[256]{0} all-reduce(%w), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
        """,
        inner,
    )
    ar_inner, ag, ar0 = parse_collectives(text)
    assert (ar_inner.count, ar_inner.computation) == (36, "inner_body")
    assert ar_inner.wire_bytes == pytest.approx(36 * 2 * 7 / 8 * 1024)
    assert (ag.count, ag.computation) == (12, "outer_body")
    assert ar0.count == 1
    assert bytes_by_kind([ar_inner, ag, ar0]) == {"all-reduce": 37 * 1024, "all-gather": 12 * 1024}


def test_while_without_trip_count_counts_once_and_says_so():
    body = """
%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}
"""
    c = one(module("%x = f32[8]{0} parameter(0)\n%w = f32[8]{0} while(%x), body=%body", body))
    assert c.count == 1 and not c.count_exact


def test_summaries_and_empty_input():
    assert parse_collectives("") == []
    assert wire_bytes_by_kind([]) == {} and bytes_by_kind([]) == {}
    cs = [
        Collective(kind="all-gather", bytes=10, group_size=2, wire_bytes=5.0, count=1),
        Collective(kind="all-reduce", bytes=10, group_size=2, wire_bytes=30.0, count=3),
        Collective(kind="all-gather", bytes=10, group_size=2, wire_bytes=10.0, count=2),
    ]
    assert wire_bytes_by_kind(cs) == {"all-reduce": 30.0, "all-gather": 15.0}
    assert bytes_by_kind(cs) == {"all-reduce": 30, "all-gather": 30}
    assert set(KINDS) == {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
    }


def test_large_module_parses_whole():
    """40,000 collectives in an 8 MB module, each found once (no timing assert: a reader
    that went quadratic would show as a suite taking minutes, not as a flaky failure)."""
    line = (
        "  %f{i} = f32[1024,1024]{{1,0}} fusion(%p), kind=kLoop, calls=%fused, "
        'metadata={{op_name="jit(step)/layer/dot_general"}}\n'
        "  %ar{i} = f32[1024]{{0}} all-reduce(%p), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, "
        "to_apply=%add\n"
    )
    text = module(
        "%p = f32[1024]{0} parameter(0)\n" + "".join(line.format(i=i) for i in range(40_000))
    )
    assert len(text) > 8_000_000
    cs = parse_collectives(text)
    assert len(cs) == 40_000
    assert {c.kind for c in cs} == {"all-reduce"} and all(c.group_size == 8 for c in cs)


SLICE_FUSION = """
%fused_slice (param_0.1: f32[64,32], param_1.1: s32[]) -> f32[{rows},32] {{
  %param_0.1 = f32[64,32]{{1,0}} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds.1 = f32[{rows},32]{{1,0}} dynamic-slice(%param_0.1, %param_1.1, %zero), dynamic_slice_sizes={{{rows},32}}
}}
"""


# The two ways XLA prints a use of one element of a tuple: a get-tuple-element
# instruction (jax 0.10) or the operand %x#k (what jax 0.12's dumps print).
GTE_FORM = """
        %gte.0 = f32[64,32]{{1,0}} get-tuple-element(%ar.182), index=0
        %gte.1 = bf16[128]{{0}} get-tuple-element(%ar.182), index=1
        %fus = f32[{rows},32]{{1,0}} fusion(%gte.0, %off), kind=kLoop, calls=%fused_slice
        ROOT %sum = bf16[128]{{0}} add(%gte.1, %b)
"""
HASH_FORM = """
        %fus = f32[{rows},32]{{1,0}} fusion(%ar.182#0, %off), kind=kLoop, calls=%fused_slice
        ROOT %sum = bf16[128]{{0}} add(%ar.182#1, %b)
"""
FORMS = pytest.mark.parametrize("form", [GTE_FORM, HASH_FORM], ids=["get-tuple-element", "x#k"])


def tuple_all_reduce(rows: int, form: str = GTE_FORM) -> str:
    """A tuple all-reduce: element 0 (f32[64,32]) sliced to ``rows`` rows in a fusion,
    element 1 (bf16[128]) added to something; its elements used in the text ``form``."""
    return module(
        """
        %a = f32[64,32]{1,0} parameter(0)
        %b = bf16[128]{0} parameter(1)
        %off = s32[] parameter(2)
        %ar.182 = (f32[64,32]{1,0}, bf16[128]{0}) all-reduce(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="grad"}
        """
        + form.format(rows=rows),
        SLICE_FUSION.format(rows=rows),
    )


@FORMS
def test_tuple_all_reduce_splits_into_reduce_scatter_and_all_reduce(form):
    rs, ar = parse_collectives(tuple_all_reduce(8, form))
    assert (rs.kind, rs.bytes, rs.group_size, rs.shape) == (
        "reduce-scatter",
        64 * 32 * 4,
        8,
        (64, 32),
    )
    assert rs.lowered_as == "all-reduce+dynamic-slice"
    assert rs.wire_bytes == pytest.approx(7 / 8 * 64 * 32 * 4)
    assert (ar.kind, ar.bytes, ar.dtype, ar.lowered_as) == ("all-reduce", 128 * 2, "bf16", "")
    assert ar.wire_bytes == pytest.approx(2 * 7 / 8 * 128 * 2)
    assert (rs.op_name, rs.computation, rs.count) == (ar.op_name, ar.computation, ar.count)
    [c] = parse_collectives(tuple_all_reduce(8, form), fuse_reduce_scatter=False)
    assert (c.kind, c.bytes, c.lowered_as) == ("all-reduce", 64 * 32 * 4 + 256, "")


@FORMS
def test_slice_of_the_wrong_size_stays_all_reduce(form):
    [c] = parse_collectives(tuple_all_reduce(16, form))  # 1/4 of the element, N = 8
    assert (c.kind, c.bytes, c.lowered_as) == ("all-reduce", 64 * 32 * 4 + 256, "")


@pytest.mark.parametrize(
    "uses",
    [
        "ROOT %t = (f32[64,32]{1,0}, bf16[128]{0}) tuple(%ar#0, %ar#1)",  # both escape
        "%f = f32[8,32]{1,0} fusion(%ar#0, %off), kind=kLoop, calls=%fused_slice\n"
        "ROOT %n = f32[64,32]{1,0} negate(%ar#0)",  # element 0 sliced, but also used whole
        "%f = f32[8,32]{1,0} fusion(%ar#0, %off), kind=kLoop, calls=%fused_slice\n"
        "ROOT %t = (f32[64,32]{1,0}, bf16[128]{0}) copy(%ar)",  # the whole tuple escapes
    ],
)
def test_tuple_element_used_whole_stays_all_reduce(uses):
    text = module(
        f"""
        %a = f32[64,32]{{1,0}} parameter(0)
        %b = bf16[128]{{0}} parameter(1)
        %off = s32[] parameter(2)
        %ar = (f32[64,32]{{1,0}}, bf16[128]{{0}}) all-reduce(%a, %b), replica_groups=[1,8]<=[8], to_apply=%add
        {uses}
        """,
        SLICE_FUSION.format(rows=8),
    )
    [c] = parse_collectives(text)
    assert (c.kind, c.bytes, c.lowered_as) == ("all-reduce", 64 * 32 * 4 + 128 * 2, "")


NESTED_GTE = """
%nest = (f32[4]{0}, (f32[64,16]{1,0}, s32[])) parameter(0)
%e1 = (f32[64,16]{1,0}, s32[]) get-tuple-element(%nest), index=1
%e10 = f32[64,16]{1,0} get-tuple-element(%e1), index=0
ROOT %rs = f32[8,16]{1,0} reduce-scatter(%e10), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
"""
NESTED_HASH = """
%nest = (f32[4]{0}, /*index=1*/(f32[64,16]{1,0}, s32[])) parameter(0)
ROOT %rs = f32[8,16]{1,0} reduce-scatter(%nest#1#0), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
"""


@pytest.mark.parametrize("body", [NESTED_GTE, NESTED_HASH], ids=["get-tuple-element", "x#i#j"])
def test_reduce_scatter_operand_shape_from_a_nested_tuple_element(body):
    c = one(module(body))
    assert (c.kind, c.bytes, c.shape, c.group_size) == ("reduce-scatter", 64 * 16 * 4, (64, 16), 8)
    assert c.wire_bytes == pytest.approx(7 / 8 * 64 * 16 * 4)


def test_reduce_scatter_through_bitcast_copy_and_direct_dynamic_slice():
    c = one(
        module("""
        %p = f32[64,32]{1,0} parameter(0)
        %i = s32[] parameter(1)
        %ar = f32[64,32]{1,0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
        %bc = f32[2048]{0} bitcast(%ar)
        %cp = f32[2048]{0} copy(%bc)
        %ds = f32[512]{0} dynamic-slice(%cp, %i), dynamic_slice_sizes={512}
        %ds2 = f32[16,32]{1,0} dynamic-slice(%ar, %i, %i), dynamic_slice_sizes={16,32}
        ROOT %t = (f32[512]{0}, f32[16,32]{1,0}) tuple(%ds, %ds2)
    """)
    )
    assert (c.kind, c.group_size, c.lowered_as) == ("reduce-scatter", 4, "all-reduce+dynamic-slice")


def all_reduce_used_by(uses: str, *computations: str) -> str:
    """A module whose f32[64,32] all-reduce %ar over 8 devices (index %i) has ``uses``."""
    return module(
        """
        %p = f32[64,32]{1,0} parameter(0)
        %i = s32[] parameter(1)
        %ar = f32[64,32]{1,0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add
        """
        + uses,
        *computations,
    )


@pytest.mark.parametrize(
    "uses",
    [
        "ROOT %t = (f32[64,32]{1,0}) tuple(%ar)",  # the whole result escapes
        "%ds = f32[8,32]{1,0} dynamic-slice(%ar, %i, %i), dynamic_slice_sizes={8,32}\n"
        "ROOT %n = f32[64,32]{1,0} negate(%ar)",  # sliced, but also used whole
        "ROOT %f = f32[8,32]{1,0} fusion(%ar, %i), kind=kLoop, calls=%fused_both",
        "%ds = f32[8,32]{1,0} dynamic-slice(%p, %i, %i), dynamic_slice_sizes={8,32}",  # unused
    ],
)
def test_all_reduce_used_whole_stays_all_reduce(uses):
    both = """
%fused_both (param_0.2: f32[64,32], param_1.2: s32[]) -> f32[8,32] {
  %param_0.2 = f32[64,32]{1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %ds.2 = f32[8,32]{1,0} dynamic-slice(%param_0.2, %param_1.2, %param_1.2), dynamic_slice_sizes={8,32}
  %sl = f32[8,32]{1,0} slice(%param_0.2), slice={[0:8], [0:32]}
  ROOT %s.2 = f32[8,32]{1,0} add(%ds.2, %sl)
}
"""
    c = one(all_reduce_used_by(uses, both))
    assert (c.kind, c.lowered_as) == ("all-reduce", "")


# ------------------------------------------------------------------ real compiled programs
@pytest.fixture(scope="module")
def mesh8():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (emulated) devices")
    return jax.make_mesh((8,), ("d",))


def test_compiled_data_parallel_gradient(mesh8):
    def loss(w, x):
        return jnp.sum((x @ w) ** 2)

    rep, batch = NamedSharding(mesh8, P()), NamedSharding(mesh8, P("d"))
    step = jax.jit(jax.grad(loss), in_shardings=(rep, batch), out_shardings=rep)
    text = step.lower(jnp.zeros((64, 32)), jnp.zeros((16, 64))).compile().as_text()
    [c] = parse_collectives(text)
    assert (c.kind, c.group_size, c.bytes, c.count) == ("all-reduce", 8, 64 * 32 * 4, 1)
    assert c.wire_bytes == pytest.approx(2 * 7 / 8 * 64 * 32 * 4)
    assert "transpose" in c.op_name


def test_compiled_shard_map_collectives_have_exact_bytes(mesh8):
    @partial(jax.shard_map, mesh=mesh8, in_specs=P("d"), out_specs=P("d"))
    def f(x):  # x: f32[8, 16] per device
        a = jax.lax.all_gather(x, "d", tiled=True)  # result f32[64, 16]
        b = jax.lax.psum_scatter(x, "d", tiled=True)  # operand f32[8, 16]
        c = jax.lax.all_to_all(x, "d", 0, 0, tiled=True)  # operand f32[8, 16]
        d = jax.lax.ppermute(x, "d", [(i, (i + 1) % 8) for i in range(8)])  # operand f32[8, 16]
        return a[:8] + b.sum() + c + d

    arg = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh8, P("d")))
    cs = parse_collectives(jax.jit(f).lower(arg).compile().as_text())
    by_kind = {c.kind: c for c in cs}
    assert sorted(by_kind) == sorted(
        ["all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
    )
    assert len(cs) == 4
    local = 8 * 16 * 4
    assert by_kind["all-gather"].bytes == 8 * local
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert by_kind[kind].bytes == local, kind
    assert all(c.group_size == 8 and c.count == 1 for c in cs)
    assert wire_bytes_by_kind(cs) == pytest.approx(
        {
            "all-gather": 7 * local,
            "reduce-scatter": 7 / 8 * local,
            "all-to-all": 7 / 8 * local,
            "collective-permute": local,
        }
    )


def test_compiled_scan_counts_each_iteration(mesh8):
    @partial(jax.shard_map, mesh=mesh8, in_specs=P("d"), out_specs=P("d"))
    def h(x):
        def body(c, _):
            return c + jax.lax.psum(c, "d") * 0.5, None

        return jax.lax.scan(body, x, None, length=3)[0]

    arg = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh8, P("d")))
    [c] = parse_collectives(jax.jit(h).lower(arg).compile().as_text())
    assert (c.kind, c.count, c.count_exact, c.bytes) == ("all-reduce", 3, True, 8 * 16 * 4)
    assert c.computation != "main" and "while/body" in c.op_name
    assert c.wire_bytes == pytest.approx(3 * 2 * 7 / 8 * 512)


def test_compiled_dp_scan_moves_all_parameter_bytes(mesh8):
    """DP over a scanned layer stack all-reduces every gradient byte once per step."""
    layers = 4
    params = {
        "w1": jnp.zeros((layers, 64, 256)),
        "w2": jnp.zeros((layers, 256, 64)),
        "b": jnp.zeros((layers, 64)),
        "emb": jnp.zeros((100, 64)),
    }

    def loss(p, tokens):
        def body(h, lp):
            return h + jnp.tanh(h @ lp["w1"]) @ lp["w2"] + lp["b"], None

        stack = {k: p[k] for k in ("w1", "w2", "b")}
        h, _ = jax.lax.scan(jax.checkpoint(body), p["emb"][tokens], stack)
        return jnp.mean(h**2)

    rep = jax.tree.map(lambda _: NamedSharding(mesh8, P()), params)
    step = jax.jit(
        jax.grad(loss), in_shardings=(rep, NamedSharding(mesh8, P("d"))), out_shardings=rep
    )
    text = step.lower(params, jnp.zeros((16, 32), jnp.int32)).compile().as_text()
    cs = parse_collectives(text)
    param_bytes = sum(np.prod(v.shape) * 4 for v in params.values())
    assert bytes_by_kind(cs) == {"all-reduce": param_bytes}
    assert wire_bytes_by_kind(cs)["all-reduce"] == pytest.approx(2 * 7 / 8 * param_bytes)
    assert max(c.count for c in cs) == layers  # the in-scan all-reduce runs once per layer


def test_compiled_nested_scans_multiply_trip_counts(mesh8):
    @partial(jax.shard_map, mesh=mesh8, in_specs=P("d"), out_specs=P("d"))
    def h(x):
        def inner(c, _):
            return c + jax.lax.psum(c, "d") * 0.5, None

        def outer(c, _):
            c = jax.lax.scan(inner, c, None, length=3)[0]
            return c + jax.lax.all_gather(c, "d", tiled=True)[:8], None

        return jax.lax.scan(outer, x, None, length=5)[0]

    arg = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh8, P("d")))
    cs = parse_collectives(jax.jit(h).lower(arg).compile().as_text())
    assert sorted((c.kind, c.count) for c in cs) == [("all-gather", 5), ("all-reduce", 15)]
    assert bytes_by_kind(cs) == {"all-reduce": 15 * 512, "all-gather": 5 * 4096}


def test_compiled_all_reduce_then_dynamic_slice_is_a_reduce_scatter(mesh8):
    """XLA:CPU keeps all-reduce + dynamic-slice where GPU/TPU form a reduce-scatter."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("d", None))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=rows)
    g = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=rows)
    f = jax.jit(lambda x, g: (x.T @ g) * 2, out_shardings=rows)
    text = f.lower(x, g).compile().as_text()
    assert "reduce-scatter(" not in text and "all-reduce(" in text
    [c] = parse_collectives(text)
    assert (c.kind, c.bytes, c.group_size, c.count) == ("reduce-scatter", 128 * 256 * 4, 8, 1)
    assert c.lowered_as == "all-reduce+dynamic-slice"
    assert c.wire_bytes == pytest.approx(7 / 8 * 128 * 256 * 4)
    [c] = parse_collectives(text, fuse_reduce_scatter=False)
    assert (c.kind, c.bytes, c.lowered_as) == ("all-reduce", 128 * 256 * 4, "")
    assert c.wire_bytes == pytest.approx(2 * 7 / 8 * 128 * 256 * 4)


def test_compiled_fsdp_gradient_is_a_reduce_scatter(mesh8):
    def loss(w, x):
        return jnp.sum((x @ w) ** 2)

    shard = NamedSharding(mesh8, P("d"))
    step = jax.jit(jax.grad(loss), in_shardings=(shard, shard), out_shardings=shard)
    text = step.lower(jnp.zeros((64, 32)), jnp.zeros((16, 64))).compile().as_text()
    by_kind = {c.kind: c for c in parse_collectives(text)}
    assert sorted(by_kind) == ["all-gather", "reduce-scatter"]
    rs = by_kind["reduce-scatter"]
    assert (rs.bytes, rs.group_size, rs.count) == (64 * 32 * 4, 8, 1)
    assert rs.lowered_as == "all-reduce+dynamic-slice" and by_kind["all-gather"].lowered_as == ""
    assert "transpose" in rs.op_name
    assert wire_bytes_by_kind(parse_collectives(text)) == pytest.approx(
        {"all-gather": 7 / 8 * 8192, "reduce-scatter": 7 / 8 * 8192}
    )


def test_compiled_fsdp_scan_reduce_scatters_once_per_layer(mesh8):
    layers = 3

    def loss(w, x):
        def body(c, wi):
            return c + jnp.sum((x @ wi) ** 2), None

        return jax.lax.scan(body, 0.0, w)[0]

    shard = NamedSharding(mesh8, P(None, "d"))
    step = jax.jit(
        jax.grad(loss), in_shardings=(shard, NamedSharding(mesh8, P("d"))), out_shardings=shard
    )
    text = step.lower(jnp.zeros((layers, 64, 32)), jnp.zeros((16, 64))).compile().as_text()
    cs = parse_collectives(text)
    [rs] = [c for c in cs if c.kind == "reduce-scatter"]
    assert (rs.bytes, rs.group_size, rs.count, rs.count_exact) == (64 * 32 * 4, 8, layers, True)
    assert rs.lowered_as == "all-reduce+dynamic-slice" and rs.computation != "main"
    assert rs.wire_bytes == pytest.approx(layers * 7 / 8 * 64 * 32 * 4)
    assert "all-reduce" not in bytes_by_kind(cs)
    assert bytes_by_kind(parse_collectives(text, fuse_reduce_scatter=False))["all-reduce"] == (
        layers * 64 * 32 * 4
    )


def test_xla_dump_text_reads_as_the_compiled_text(mesh8, tmp_path):
    """The module XLA dumps (``xla_dump_to``) gives the collectives of ``as_text()``.

    jax 0.12's dump writes tuple elements as ``%x#k`` operands where ``as_text()`` keeps
    get-tuple-element instructions; jax 0.10 writes both the same way.
    """
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(p, x):
        def body(c, w):
            return c + jnp.tanh(c @ w["a"]) @ w["b"], None

        return jnp.sum(jax.lax.scan(body, x, p)[0] ** 2)

    shardings = {"a": NamedSharding(mesh, P(None, "d")), "b": NamedSharding(mesh, P())}
    step = jax.jit(
        jax.grad(loss),
        in_shardings=(shardings, NamedSharding(mesh, P("d"))),
        out_shardings=shardings,
    )
    params = {"a": jnp.zeros((3, 64, 32)), "b": jnp.zeros((3, 32, 64))}
    lowered = step.lower(params, jnp.zeros((16, 64)))
    compiled = lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    [dumped] = tmp_path.glob("*after_optimizations.txt")
    dump = dumped.read_text()
    if jax.__version_info__ >= (0, 12):
        assert re.search(r"%[\w.\-]+#\d", dump) and "get-tuple-element(" not in dump

    def key(c):
        return (c.kind, c.bytes, c.group_size, c.count, c.lowered_as, c.shapes, c.op_name)

    from_dump = sorted(map(key, parse_collectives(dump)))
    assert from_dump == sorted(map(key, parse_collectives(compiled.as_text())))
    # the case that follows tuple elements: a gradient all-reduced, then cut to its shard
    assert any(k[4] == "all-reduce+dynamic-slice" for k in from_dump)


def gather_used_by(gather_name: str, user_name: str) -> str:
    """An all-gather named ``gather_name``, copied by a fusion of the same name, whose
    result a dot fusion named ``user_name`` uses."""
    meta = f'metadata={{op_name="jit(step)/transpose(jvp(GPT))/while/body/{gather_name}"}}'
    return module(f"""
    %p = f32[8,256]{{1,0}} parameter(0)
    %x = f32[4,64]{{1,0}} parameter(1)
    %ag = f32[64,256]{{1,0}} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={{0}}, {meta}
    %cp = f32[64,256]{{1,0}} fusion(%ag), kind=kLoop, calls=%copy_computation, {meta}
    ROOT %dot = f32[4,256]{{1,0}} fusion(%x, %cp), kind=kCustom, calls=%dot_computation, metadata={{op_name="jit(step)/transpose(jvp(GPT))/while/body/{user_name}"}}
    """)


@pytest.mark.parametrize(
    "gather_name, user_name, named",
    [
        # jax 0.12's XLA names a weight's all-gather in a scan after the slice of the
        # stacked weight; jax 0.10's after the dot of the layer that uses the weight
        ("jit(dynamic_index_in_dim)/squeeze", "eval_jaxpr/layers/mlp/up/dot_general", "user"),
        ("eval_jaxpr/layers/sharding_constraint", "eval_jaxpr/layers/mlp/up/dot_general", "user"),
        # named after an op that computes: kept, though a layer uses the result
        ("jit(dynamic_index_in_dim)/mul", "eval_jaxpr/layers/mlp/up/dot_general", "gather"),
        # the user lies outside the gather's model path: kept
        ("eval_jaxpr/layers/sharding_constraint", "eval_jaxpr/ln_f/dot_general", "gather"),
        # the user is no deeper in the model than the gather: kept
        ("eval_jaxpr/layers/sharding_constraint", "eval_jaxpr/layers/dot_general", "gather"),
    ],
)
def test_a_gather_named_after_a_slice_takes_the_name_of_the_layer_using_it(
    gather_name, user_name, named
):
    c = one(gather_used_by(gather_name, user_name))
    expected = gather_name if named == "gather" else user_name
    assert (c.kind, c.op_name) == (
        "all-gather",
        "jit(step)/transpose(jvp(GPT))/while/body/" + expected,
    )


CONVERT_FUSIONS = """
%wrapped_convert (param_0.3: f32[64,32]) -> bf16[64,32] {
  %param_0.3 = f32[64,32]{1,0} parameter(0)
  ROOT %cv.3 = bf16[64,32]{1,0} convert(%param_0.3)
}

%fused_convert_slice (param_0.4: bf16[64,32], param_1.4: s32[]) -> f32[8,32] {
  %param_0.4 = bf16[64,32]{1,0} parameter(0)
  %param_1.4 = s32[] parameter(1)
  %cv.4 = f32[64,32]{1,0} convert(%param_0.4)
  %zero = s32[] constant(0)
  ROOT %ds.4 = f32[8,32]{1,0} dynamic-slice(%cv.4, %param_1.4, %zero), dynamic_slice_sizes={8,32}
}
"""


@pytest.mark.parametrize(
    ("uses", "kind"),
    [
        (
            "ROOT %s = f32[8,32]{1,0} fusion(%cv, %i), kind=kLoop, calls=%fused_convert_slice",
            "reduce-scatter",
        ),
        # the converted values also used whole, outside the fusion that converts them
        (
            "%s = f32[8,32]{1,0} fusion(%cv, %i), kind=kLoop, calls=%fused_convert_slice\n"
            "ROOT %n = bf16[64,32]{1,0} negate(%cv)",
            "all-reduce",
        ),
    ],
)
def test_reduce_scatter_through_a_convert_fusion_and_back(uses, kind):
    """XLA:CPU all-reduces a bfloat16 partial sum in float32, converts it back in one
    fusion and slices it (converted to float32 again) in another: a reduce-scatter in
    effect, where the converted values are used only sliced."""
    convert = "%cv = bf16[64,32]{1,0} fusion(%ar), kind=kLoop, calls=%wrapped_convert\n"
    c = one(all_reduce_used_by(convert + uses, CONVERT_FUSIONS))
    assert (c.kind, c.bytes, c.group_size) == (kind, 64 * 32 * 4, 8)


def test_compiled_bf16_fsdp_gradient_is_a_reduce_scatter(mesh8):
    """Under bfloat16 compute XLA:CPU all-reduces the weight's partial gradients in
    float32 and converts them back before the slice: still the fsdp reduce-scatter."""

    def loss(w, x):
        y = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    shard = NamedSharding(mesh8, P("d"))
    step = jax.jit(jax.grad(loss), in_shardings=(shard, shard), out_shardings=shard)
    text = step.lower(jnp.zeros((64, 32)), jnp.zeros((16, 64))).compile().as_text()
    assert "reduce-scatter(" not in text
    assert re.search(r"ROOT %\S+ = bf16\[[^\]]*\]\S* convert\(", text)  # a fusion casts back
    by_kind = {c.kind: c for c in parse_collectives(text)}
    assert sorted(by_kind) == ["all-gather", "reduce-scatter"]
    assert by_kind["reduce-scatter"].group_size == 8


def _branch(name: str, elements: int) -> str:
    return f"""
%{name} (p.{name}: f32[{elements}]) -> f32[{elements}] {{
  %p.{name} = f32[{elements}]{{0}} parameter(0)
  ROOT %cp.{name} = f32[{elements}]{{0}} collective-permute(%p.{name}), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
}}
"""


@pytest.mark.parametrize(("down", "up"), [(1024, 1024), (1024, 256)])
def test_a_conditional_counts_its_costliest_branch(down, up):
    # zbv's rolled engine picks a tick's send direction with lax.cond: one permute runs.
    text = module(
        f"""
        %x = f32[{max(down, up)}]{{0}} parameter(0)
        %i = s32[] parameter(1)
        %d = f32[{down}]{{0}} slice(%x), slice={{[0:{down}]}}
        %u = f32[{up}]{{0}} slice(%x), slice={{[0:{up}]}}
        ROOT %c = f32[{down}]{{0}} conditional(%i, %d, %u), branch_computations={{%down, %up}}
        """,
        _branch("down", down),
        _branch("up", up),
    )
    cs = parse_collectives(text)
    assert sorted((c.bytes, c.count) for c in cs) == sorted([(down * 4, 1), (up * 4, 0)])
    assert wire_bytes_by_kind(cs) == {"collective-permute": down * 4}


def test_a_shared_convert_computation_follows_the_fusion_it_was_entered_by():
    # Two fusions call one convert computation: the all-reduce's (then sliced) and an
    # unrelated one whose result is used whole. Only the first one's users count.
    c = one(
        all_reduce_used_by(
            """
            %q = f32[64,32]{1,0} parameter(2)
            %cv = bf16[64,32]{1,0} fusion(%ar), kind=kLoop, calls=%wrapped_convert
            %other = bf16[64,32]{1,0} fusion(%q), kind=kLoop, calls=%wrapped_convert
            %s = f32[8,32]{1,0} fusion(%cv, %i), kind=kLoop, calls=%fused_convert_slice
            ROOT %t = (f32[8,32]{1,0}, bf16[64,32]{1,0}) tuple(%s, %other)
            """,
            CONVERT_FUSIONS,
        )
    )
    assert (c.kind, c.bytes) == ("reduce-scatter", 64 * 32 * 4)


def test_a_nested_conditional_counts_by_its_costliest_branches():
    # Outer branch a holds an inner conditional of two 100-element permutes (one of them
    # runs: 100 elements), outer branch b a 150-element one: b is the costlier (summing
    # the inner branches, 200, would pick a). A computation called from the dropped
    # branch a and from ENTRY keeps ENTRY's one run.
    outer_a = """
%outer_a (p.outer_a: f32[100]) -> f32[100] {
  %p.outer_a = f32[100]{0} parameter(0)
  %j = s32[] constant(0)
  %s = f32[10]{0} call(%p.outer_a), to_apply=%shared
  ROOT %ic = f32[100]{0} conditional(%j, %p.outer_a, %p.outer_a), branch_computations={%in1, %in2}
}
"""
    text = module(
        """
        %x = f32[100]{0} parameter(0)
        %y = f32[150]{0} parameter(1)
        %i = s32[] parameter(2)
        %a = f32[10]{0} call(%x), to_apply=%shared
        ROOT %c = f32[100]{0} conditional(%i, %x, %y), branch_computations={%outer_a, %b}
        """,
        _branch("in1", 100),
        _branch("in2", 100),
        _branch("b", 150),
        _branch("shared", 10),
        outer_a,
    )
    cs = parse_collectives(text)
    assert {c.computation: c.count for c in cs} == {"in1": 0, "in2": 0, "b": 1, "shared": 1}
    assert wire_bytes_by_kind(cs) == {"collective-permute": (150 + 10) * 4}
