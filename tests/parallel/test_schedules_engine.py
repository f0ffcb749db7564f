"""The pipeline engine on a small layer stack: exact loss and gradients for every schedule.

Expected values come from ``jax.value_and_grad`` of the same stack run layer by layer on
one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.parallel import pipeline, schedules

D, LAYERS, BATCH = 8, 8, 32


def layer(w, x):
    return jnp.tanh(x @ w["k"] + w["b"])


def pre(rest, mb):
    return mb["x"] @ rest["emb"]


def post(rest, y, mb):
    return jnp.mean((y @ rest["emb"].T - mb["y"]) ** 2)  # tied: emb read first and last


def params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    stack = {
        "k": jax.random.normal(k1, (LAYERS, D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k2, (LAYERS, D)),
    }
    rest = {"emb": jax.random.normal(k3, (D, D)) / np.sqrt(D)}
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (BATCH, D)), "y": jax.random.normal(ky, (BATCH, D))}
    return stack, rest, batch


def reference(stack, rest, batch):
    def loss(stack, rest):
        x = pre(rest, batch)
        for i in range(LAYERS):
            x = layer(jax.tree.map(lambda a, i=i: a[i], stack), x)
        return post(rest, x, batch)

    return jax.value_and_grad(loss, argnums=(0, 1))(stack, rest)


def mesh_of(axes):
    return sk.make_mesh(axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])


def assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)


LAYOUTS = {
    # name: (mesh, stack specs, rest specs, batch axes)
    "pp": ({"stage": 4}, None, None, None),
    "dp_pp": ({"stage": 4, "data": 2}, None, None, None),
    "zeropp": (
        {"stage": 2, "fsdp": 4},
        {"k": P("stage", "fsdp"), "b": P("stage", "fsdp")},
        {"emb": P("fsdp")},
        ("fsdp",),
    ),
}


# m in {p, 2p, 4p} for every schedule; each layout meets every schedule once (all 27
# combinations passed on an earlier version of the engine, in ~100 s).
CASES = [
    (s, list(LAYOUTS)[(i + j) % 3], f)
    for i, s in enumerate(("gpipe", "1f1b", "interleaved"))
    for j, f in enumerate((1, 2, 4))
]


# The rolled layer loop: each schedule on each layout once, m in {p, 2p, 4p}.
ROLLED = [
    (s, list(LAYOUTS)[(i + j) % 3], f, True)
    for i, s in enumerate(("gpipe", "1f1b", "interleaved"))
    for j, f in enumerate((1, 2, 4))
    if (i + 2 * j) % 3 == 0
]


# Zero-bubble schedules (rolled only): m in {p, 2p}, each on two layouts.
ZERO_BUBBLE = [
    ("zb1", "pp", 1, True),
    ("zb1", "zeropp", 2, True),
    ("zbv", "dp_pp", 1, True),
    ("zbv", "zeropp", 2, True),
]


@pytest.mark.parametrize(
    "schedule,layout,factor,rolled", [(*c, False) for c in CASES] + ROLLED + ZERO_BUBBLE
)
def test_exact_loss_and_grads(schedule, layout, factor, rolled):
    axes, s_specs, r_specs, b_axes = LAYOUTS[layout]
    mesh = mesh_of(axes)
    p = axes["stage"]
    stack, rest, batch = params()
    fn = pipeline.mesh_value_and_grad(
        layer,
        pre,
        post,
        mesh=mesh,
        microbatches=factor * p,
        schedule=schedule,
        virtual_stages=2,
        unit=p,
        stack_specs=s_specs,
        rest_specs=r_specs,
        batch_axes=b_axes,
        rolled=rolled,
    )
    assert_same(jax.jit(fn)(stack, rest, batch), reference(stack, rest, batch))


def test_one_f_one_b_holds_bounded_microbatches():
    assert schedules.make("1f1b", 4, 4).slots == 4  # m < 2p - 1: all of them
    for m in (8, 16, 64):
        assert schedules.make("1f1b", 4, m).slots == 7  # 2p - 1, whatever m
        assert schedules.make("1f1b", 4, m).ring == 7  # what the engine stores
        assert schedules.make("gpipe", 4, m).slots == m
        assert schedules.make("gpipe", 4, m).ring == m + 7


@pytest.mark.parametrize(
    "name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1), ("zbv", 2)]
)
def test_work_matches_bubble(name, v):
    # The tick tables' busy ticks (a tick costs every stage its F, B, W if any stage runs
    # one) against the formula: (p - 1)/(v·m + p - 1), zb1 / zbv 2(p - 1)/(3m + 2(p - 1)).
    for p, m in ((2, 4), (4, 4), (4, 8), (4, 16)):
        s = schedules.make(name, p, m, v)
        assert s.work_ticks == pytest.approx(m / (1 - s.bubble))
    p, m = 4, 8
    want = 2 * (p - 1) / (3 * m + 2 * (p - 1)) if name in ("zb1", "zbv") else None
    if want is not None:
        assert schedules.make(name, p, m).bubble == pytest.approx(want)


def test_zero_bubble_below_one_f_one_b_at_the_same_m():
    for p, m in ((2, 2), (4, 4), (4, 8), (8, 32)):
        one_f = schedules.make("1f1b", p, m)
        for name in ("zb1", "zbv"):
            s = schedules.make(name, p, m)
            assert s.bubble < one_f.bubble
            assert s.work_ticks < one_f.work_ticks  # the tables' own count agrees
        # zb1 keeps 1f1b's F and B ticks and its residual ring (2p - 1)
        zb1 = schedules.make("zb1", p, m)
        assert (zb1.forward, zb1.backward, zb1.ring) == (one_f.forward, one_f.backward, one_f.ring)


def test_zero_bubble_tables_by_hand():
    # zb1, p = 2, m = 2: F and B as 1f1b; W of micro-batch j on both stages at tick j + 2.
    zb1 = schedules.make("zb1", 2, 2)
    assert zb1.weight == ((None, None), (None, None), ((0, 0), (0, 0)), ((1, 0), (1, 0)))
    # zbv, p = 2, m = 2 (chunks 0, 1 down stages 0, 1; chunks 2, 3 back up stages 1, 0):
    # F of (j, chunk c) at tick 2j + c, B at 2j + 6 - c, W of round 1 at 2j + 5 and of
    # round 0 at 2j + 6 on both stages.
    assert schedules.make("zbv", 2, 2).timeline().splitlines() == [
        "tick   stage 0         stage 1",
        "0      F0.0            .",
        "1      .               F0.0",
        "2      F1.0            F0.1",
        "3      F0.1 B0.1       F1.0",
        "4      .               F1.1 B0.1",
        "5      F1.1 B1.1 W0.1  B0.0 W0.1",
        "6      B0.0 W0.0       B1.1 W0.0",
        "7      W1.1            B1.0 W1.1",
        "8      B1.0 W1.0       W1.0",
    ]
    # Each stage's own slots, counted on this timeline: at most 4 items between their F
    # and W (stage 0 at tick 5: 0.0, 1.0, 0.1, 1.1) and 2 between B and W (tick 6: 1.1,
    # 0.0), each plus a trash slot for idle ticks; the tick-indexed rings: 4p - 1, p + 1.
    v22 = schedules.make("zbv", 2, 2)
    assert (v22.own_slots("f", "w")[1], v22.ring) == (5, 7)
    assert (v22.own_slots("b", "w")[1], v22.w_ring) == (3, 3)
    zbv = schedules.make("zbv", 4, 8)
    assert zbv.ring == 4 * 4 - 1  # chunk slots, half a stage each: 1f1b holds 2p - 1 stages
    assert zbv.chunk(0, 1) == 7 and zbv.chunk(3, 1) == 4  # the loss on stage 0
    assert pipeline.v_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("name,p,m", [("zbv", 4, 16), ("zbv", 2, 4), ("zb1", 4, 8)])
def test_own_slots_hold_each_item_until_its_weight_gradient(name, p, m):
    # The engine's per-stage slots for zb1 / zbv (residuals from F to W, what B leaves W):
    # every reader finds its item's slot, no slot holds two items alive in one tick (a
    # tick's F and B run before its W), and there are as many as a stage holds at once,
    # counted here from the tables, plus the trash slot.
    sched = schedules.make(name, p, m)
    rows = {"f": sched.forward, "b": sched.backward, "w": sched.weight}
    for write in ("f", "b"):
        tables, size = sched.own_slots(write, "w")
        span = {}  # (item, stage) -> (slot, first tick, last tick)
        for kind, table in tables.items():
            for t, row in enumerate(rows[kind]):
                for s, item in enumerate(row):
                    if item is not None:
                        slot, a, b = span.get((item, s), (table[t, s], t, t))
                        assert table[t, s] == slot
                        span[item, s] = (slot, min(a, t), max(b, t))
        for (i, s), (slot, a, b) in span.items():
            for (j, q), (slot2, a2, b2) in span.items():
                if (i, s) != (j, q) and s == q and slot == slot2:
                    assert b < a2 or b2 < a
        held = max(
            sum(a <= t <= b for (_, q), (_, a, b) in span.items() if q == s)
            for s in range(p)
            for t in range(sched.ticks)
        )
        assert size == held + 1
    if name == "zbv":  # fewer than the tick-indexed rings (p = 4: 11 of 15, 4 of 5)
        assert sched.own_slots("f", "w")[1] < sched.ring
        assert sched.own_slots("b", "w")[1] <= sched.w_ring


def test_zero_bubble_bad_input_names_numbers_and_fix():
    with pytest.raises(
        schedules.StageDivisibilityError, match=r"virtual_stages=3(.|\n)*Fix: virtual_stages=2"
    ):
        schedules.make("zbv", 4, 8, virtual=3)
    with pytest.raises(
        schedules.MicrobatchError, match=r"3 micro-batches for 4 stages(.|\n)*--microbatches 4"
    ):
        schedules.make("zb1", 4, 3)
    with pytest.raises(sk.ShardingError, match="needs micro-batches >= 4"):
        schedules.make("zbv", 4, 2)
    stack, rest, batch = params()
    mesh = mesh_of({"stage": 4})
    with pytest.raises(schedules.UnitError, match=r"unit=3(.|\n)*Fix: unit=2 .*\[1, 2, 4, 8\]"):
        pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=8, unit=3)
    with pytest.raises(schedules.PipelineError, match=r"rolled=False(.|\n)*Fix: rolled=True"):
        pipeline.mesh_value_and_grad(
            layer, pre, post, mesh=mesh, microbatches=4, schedule="zb1", rolled=False
        )
    # 8 layers are 8 chunks of zbv on 4 stages; 6 are not
    bad = pipeline.mesh_value_and_grad(
        layer, pre, post, mesh=mesh, microbatches=4, schedule="zbv", rolled=True
    )
    with pytest.raises(schedules.StageDivisibilityError, match=r"6 layers .* 4 stages × 2 virtual"):
        jax.jit(bad)(jax.tree.map(lambda x: x[:6], stack), rest, batch)
    with pytest.warns(schedules.PipelineWarning, match="bubble is 60%"):  # m < p still warns
        pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=2, schedule="1f1b")


def test_bad_input_names_numbers_and_fix():
    stack, rest, batch = params()
    mesh = mesh_of({"stage": 4})
    with pytest.raises(schedules.UnknownScheduleError, match="gpipe, 1f1b, interleaved"):
        pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=4, schedule="zb")
    bad = pipeline.mesh_value_and_grad(
        layer, pre, post, mesh=mesh, microbatches=4, schedule="interleaved", virtual_stages=4
    )
    with pytest.raises(schedules.StageDivisibilityError, match="8 layers .* 4 stages × 4 virtual"):
        jax.jit(bad)(stack, rest, batch)
    odd = pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=5)
    with pytest.raises(schedules.MicrobatchError, match="Batch of 32 rows: 5 micro-batches"):
        jax.jit(odd)(stack, rest, batch)
    with pytest.warns(schedules.PipelineWarning, match="bubble is 60%"):
        pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=2, schedule="1f1b")
    with pytest.raises(schedules.PipelineError, match="mesh axis 'stage'"):
        pipeline.mesh_value_and_grad(
            layer, pre, post, mesh=sk.make_mesh({"data": 8}), microbatches=4
        )


# By hand, 8 layers on 4 stages × 2 chunks of one layer: interleaved, stage s runs chunks
# s and s + 4; zbv, chunks s and 7 − s (down the stages, then back up): its block holds them.
STORED = {"interleaved": [0, 4, 1, 5, 2, 6, 3, 7], "zbv": [0, 7, 1, 6, 2, 5, 3, 4]}


@pytest.mark.parametrize("schedule", sorted(STORED))
def test_a_stack_stored_in_its_schedules_order_moves_no_weights(schedule):
    from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind

    stack, rest, batch = params()
    mesh, p, v = mesh_of({"stage": 4}), 4, 2
    perm = pipeline.stored_order(schedule, LAYERS, p, v)
    assert perm.tolist() == STORED[schedule]
    on_stages = jax.sharding.NamedSharding(mesh, P("stage"))  # as a plan lays out the stack
    stored = jax.device_put(jax.tree.map(lambda x: x[perm], stack), on_stages)
    wire = {}
    for order, st in (("layers", jax.device_put(stack, on_stages)), ("interleaved", stored)):
        fn = pipeline.mesh_value_and_grad(
            layer,
            pre,
            post,
            mesh=mesh,
            microbatches=p,
            schedule=schedule,
            virtual_stages=v,
            stack_order=order,
            rolled=True,
        )
        compiled = jax.jit(fn).lower(st, rest, batch).compile()
        wire[order] = wire_bytes_by_kind(parse_collectives(compiled.as_text()))
        loss, (d_stack, d_rest) = compiled(st, rest, batch)
        if order == "interleaved":  # the gradient comes back in the stored order
            d_stack = jax.tree.map(lambda g: g[np.argsort(perm)], d_stack)
        assert_same((loss, (d_stack, d_rest)), reference(stack, rest, batch))
    # the reorder moves the stack and its gradient: interleaved's by a gather of the stack
    assert sum(wire["layers"].values()) > sum(wire["interleaved"].values())
    if schedule == "interleaved":
        assert wire["layers"].get("all-gather", 0) > 0
    assert "all-gather" not in wire["interleaved"]
    assert set(wire["interleaved"]) == {"collective-permute", "all-reduce"}
    with pytest.raises(schedules.PipelineError, match="stack_order='chunks'(.|\n)*Fix"):
        pipeline.mesh_value_and_grad(
            layer, pre, post, mesh=mesh, microbatches=p, stack_order="chunks"
        )
