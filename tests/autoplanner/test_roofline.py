"""The roofline: links, bubble, remat, overlap — checked against hand counts."""

import pytest

from shardkit.autoplanner.hardware import Hardware, get, names
from shardkit.autoplanner.roofline import bubble, crosses_nodes, estimate, model_flops
from shardkit.errors import ShardingError

HW = Hardware(
    "toy",
    bf16_flops=200.0,
    f32_flops=100.0,
    memory_bytes=1,
    intra_node_bandwidth=10.0,
    inter_node_bandwidth=1.0,
    devices_per_node=4,
)


def test_a_group_crosses_nodes_only_when_its_devices_sit_in_two():
    assert not crosses_nodes((4, 5, 6, 7), 4)
    assert crosses_nodes((3, 4), 4)
    assert crosses_nodes((0, 4, 8, 12), 4)


def test_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert bubble(4, 4) == pytest.approx(3 / 7)
    assert bubble(1, 8) == 0.0


def test_estimate_by_hand():
    collectives = [("all-reduce", 20.0, (0, 1)), ("all-gather", 3.0, (0, 4)), ("x", 5.0, ())]
    e = estimate(
        flops=50.0,
        collectives=collectives,
        hardware=HW,
        precision="f32",
        useful_flops=300.0,
        devices=8,
    )
    # compute: max(50, 300) / 100 = 3 s; intra: 20/10 = 2 s; inter: 3/1 + 5/1 (no groups:
    # all 8 devices, two nodes) = 8 s; overlapped: max(3, 10) = 10 s.
    assert (e.compute_s, e.intra_node_s, e.inter_node_s) == (3.0, 2.0, 8.0)
    assert e.step_time_s == 10.0 and e.no_overlap_s == 13.0
    assert e.mfu == pytest.approx(300.0 / (10.0 * 100.0))


def test_remat_bubble_and_precision_stretch_compute_by_hand():
    e = estimate(
        flops=0.0,
        collectives=[],
        hardware=HW,
        precision="bf16",
        useful_flops=300.0,
        devices=4,
        stages=2,
        microbatches=2,
        remat="full",
    )
    assert e.compute_s == pytest.approx(300.0 * 4 / 3 / (1 - 1 / 3) / 200.0)


def test_palm_model_flops():
    assert model_flops(params=10, tokens=3) == 180
    assert model_flops(params=10, tokens=3, layers=2, d_model=4, seq=5) == (60 + 480) * 3


def test_every_hardware_number_has_a_source():
    for name in names():
        hw = get(name)
        assert len(hw.sources) >= 3, name
        assert hw.bf16_flops > 0 and hw.intra_node_bandwidth > 0 and hw.memory_bytes > 0


def test_unknown_hardware_names_the_known_ones():
    with pytest.raises(ShardingError, match="h100.*tpu-v5p"):
        get("h1000")


LAT = HW.with_(collective_latency=3.0, intra_node_latency=0.5, inter_node_latency=2.0)


def test_each_collective_pays_its_ring_latency_by_hand():
    collectives = [
        ("all-reduce", 20.0, (0, 1, 2, 3), 5, 4),  # 5 runs of 2·3 steps in a node
        ("all-gather", 4.0, (0, 4), 2, 2),  # 2 runs of 1 step across nodes
        ("collective-permute", 1.0, (0, 1), 3, 2),  # 3 runs of 1 step in a node
    ]
    e = estimate(
        flops=0.0,
        collectives=collectives,
        hardware=LAT,
        precision="f32",
        useful_flops=0.0,
        devices=8,
    )
    intra_alpha = 5 * (3.0 + 6 * 0.5) + 3 * (3.0 + 1 * 0.5)
    inter_alpha = 2 * (3.0 + 1 * 2.0)
    assert e.latency_s == pytest.approx(intra_alpha + inter_alpha)
    assert e.intra_node_s == pytest.approx(21.0 / 10.0 + intra_alpha)
    assert e.inter_node_s == pytest.approx(4.0 / 1.0 + inter_alpha)
    assert e.step_time_s >= e.latency_s


def pipeline(*, permutes: int, **kw):
    """The roofline of a pipeline whose only collectives are ``permutes`` empty sends
    between two neighbours in a node, on :data:`LAT`."""
    return estimate(
        flops=0.0,
        collectives=[("collective-permute", 0.0, (0, 1), permutes, 2)],
        hardware=LAT,
        precision="f32",
        **kw,
    )


def test_a_pipeline_tick_waits_for_its_neighbour_by_hand():
    # 1F1B on p = 2, m = 4: m + 2p - 2 = 6 ticks, each a one-step exchange in a node.
    e = pipeline(permutes=6, useful_flops=0.0, devices=4, stages=2, microbatches=4)
    assert e.ticks_s == pytest.approx(6 * (3.0 + 0.5))
    assert e.compute_s == pytest.approx(e.ticks_s)  # no FLOPs: only the ticks
    assert e.step_time_s == pytest.approx(6 * 3.5)  # the permutes' α hide behind them


def test_nccl_latency_on_a_gpu_node():
    # NCCL's ring model, 8 GPUs of an H100 node: 3.6 µs + 14 steps · 0.47 µs ≈ 10.2 µs
    # per all-reduce.
    e = estimate(
        flops=0.0,
        collectives=[("all-reduce", 0.0, tuple(range(8)), 1, 8)],
        hardware=get("h100"),
        precision="bf16",
        useful_flops=0.0,
        devices=8,
    )
    assert e.step_time_s == pytest.approx(10.18e-6)


def test_each_schedule_stretches_compute_by_its_own_bubble_and_ticks():
    # By hand, p = 4, m = 8: interleaved over v chunks 3 / (v·8 + 3); zb1 and zbv
    # 2·3 / (3·8 + 2·3) (F, B and W of equal length).
    assert bubble(4, 8, "interleaved", 2) == pytest.approx(3 / 19)
    assert bubble(4, 8, "interleaved", 4) == pytest.approx(3 / 35)
    assert bubble(4, 8, "zb1") == bubble(4, 8, "zbv") == pytest.approx(6 / 30)
    from shardkit.parallel.schedules import make

    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb1", 1),
                        ("zbv", 2)):  # fmt: skip
        e = pipeline(
            permutes=1,
            useful_flops=100.0,
            devices=8,
            stages=4,
            microbatches=8,
            schedule=schedule,
            virtual=v,
        )
        # the engine's own table: one neighbour exchange (3.5 s here) per tick
        assert e.ticks_s == pytest.approx(make(schedule, 4, 8, v).ticks * 3.5), schedule
        idle = bubble(4, 8, schedule, v)
        assert e.compute_s - e.ticks_s == pytest.approx(100.0 / (1 - idle) / LAT.peak_flops("f32"))
