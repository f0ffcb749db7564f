"""Analytic pruning: the reasons, and the state it counts (by hand)."""

import pytest

from shardkit import models
from shardkit.autoplanner.candidates import Candidate, enumerate_candidates
from shardkit.autoplanner.evaluate import Analytic, Pruned, Subject, prune

PSI = 124_672  # gpt-tiny's parameters


@pytest.fixture(scope="module")
def tiny():
    return Subject.of(models.get("gpt-tiny"), batch=8, seq=32)


def test_the_subject_counts_parameters_and_adam_state(tiny):
    assert tiny.param_bytes == 4 * PSI
    assert tiny.optimizer_bytes == pytest.approx(8 * PSI, abs=64)  # m, v (+ step counters)


@pytest.mark.parametrize(
    "recipe, mesh, divisor", [("dp", {"data": 8}, 1), ("fsdp", {"fsdp": 8}, 8)]
)
def test_state_is_params_grads_and_adam_divided_by_the_sharding(tiny, recipe, mesh, divisor):
    got = prune(tiny, Candidate(recipe, tuple(mesh.items())), budget=2**30)
    assert isinstance(got, Analytic)
    assert got.state == pytest.approx(16 * PSI / divisor, rel=1e-3)


def test_state_over_budget_is_pruned_with_the_numbers(tiny):
    got = prune(tiny, Candidate("dp", (("data", 8),)), budget=16 * PSI / 2)
    assert isinstance(got, Pruned) and "1.9 MiB per device" in got.reason


def test_indivisible_heads_and_zigzag_sequences_are_pruned(tiny):
    four_heads = Subject.of(models.get("gpt-tiny", n_heads=4, n_kv_heads=4), batch=8, seq=32)
    got = prune(four_heads, Candidate("tp", (("tensor", 8),)), budget=2**30)
    assert isinstance(got, Pruned) and "'heads'" in got.reason and "tensor=8" in got.reason
    got = prune(tiny, Candidate("cp", (("sequence", 32),)), budget=2**30)
    assert isinstance(got, Pruned) and "64 zigzag chunks" in got.reason
    got = prune(tiny, Candidate("dp", (("data", 16),)), budget=2**30)
    assert isinstance(got, Pruned) and got.reason.startswith("batch")
    got = prune(tiny, Candidate("pp", (("stage", 8),), microbatches=8), budget=2**30)
    assert isinstance(got, Pruned) and "2 layers do not split into 8 stages" in got.reason


@pytest.mark.parametrize(
    "vocab, batch, seq, smaller", [(256, 64, 256, "tokens"), (8192, 8, 4, "vocab")]
)
def test_the_logits_layout_moves_the_head_phase_the_way_its_gathers_say(vocab, batch, seq, smaller):
    # Under fsdp=8, logits="vocab" gathers every token's hidden state (T·h per device,
    # and its gradient) where "tokens" gathers the head's weight (vocab·h, three copies).
    # h = 64. 16,384 tokens over a 256 vocabulary: the hidden states are 64x the weight;
    # 32 tokens over 8,192: the weight is 256x the hidden states (and its copies set
    # the peak).
    subject = Subject.of(models.get("gpt-tiny", vocab=vocab), batch=batch, seq=seq)
    mem = {
        layout: prune(
            subject, Candidate("fsdp", (("fsdp", 8),), logits=layout), budget=2**40
        ).memory
        for layout in ("vocab", "tokens")
    }
    other = "vocab" if smaller == "tokens" else "tokens"
    assert mem[smaller] < mem[other]


def test_the_3d_pipeline_state_is_the_stage_share_split_over_tensor(tiny):
    # dp_tp_sp_pp on data 2 × stage 2 × tensor 2: the 2-layer stack / (p·t), the tied
    # vocab table (vocab-parallel) / t, the rest (position table, final norm) whole;
    # params, grads and Adam's m and v: 16 bytes per value.
    cfg = tiny.model.config
    stack, table = cfg.n_layers * cfg.dims().layer_params, cfg.vocab * cfg.d_model
    per_device = stack / 4 + table / 2 + (PSI - stack - table)
    mesh = (("data", 2), ("stage", 2), ("tensor", 2))
    got = prune(tiny, Candidate("dp_tp_sp_pp", mesh, microbatches=2), budget=2**30)
    assert isinstance(got, Analytic), got
    assert got.state == pytest.approx(16 * per_device, rel=1e-3)
    assert got.wire > 0


def test_usp_is_tried_on_every_ulysses_ring_split_and_pruned_where_heads_do_not_divide():
    got = enumerate_candidates(8, 8, recipe_names=["cp_usp"], remats=("full",))
    meshes = sorted({c.mesh for c in got})  # each with both logits layouts
    assert meshes == [(("sequence", 2), ("ulysses", 4)), (("sequence", 4), ("ulysses", 2))]
    assert {c.recipe_object().attention for c in got} == {"usp"}
    two_kv = Subject.of(models.get("llama-tiny", n_kv_heads=2), batch=8, seq=32)
    wide, narrow = (next(c for c in got if c.mesh == m) for m in meshes)
    pruned = prune(two_kv, wide, budget=2**30)  # 2 K/V heads over Ulysses 4
    assert isinstance(pruned, Pruned) and "'ulysses' (size 4)" in pruned.reason
    assert "2 K/V heads" in pruned.reason
    assert isinstance(prune(two_kv, narrow, budget=2**30), Analytic)


def test_a_schedule_the_layers_do_not_allow_is_pruned_and_its_options_reach_the_step(tiny):
    # gpt-tiny's 2 layers: 2 stages run one layer each, never two chunks of a layer.
    from shardkit.autoplanner.evaluate import _pipeline_options

    for schedule in ("interleaved", "zbv"):
        c = Candidate("pp", (("stage", 2),), microbatches=4, schedule=schedule)
        got = prune(tiny, c, budget=2**30)
        assert isinstance(got, Pruned)
        assert got.reason == f"2 layers do not split into 2 stages × 2 chunks ({schedule})"
    c = Candidate("pp", (("stage", 2),), microbatches=4, schedule="zb1")
    assert isinstance(prune(tiny, c, budget=2**30), Analytic)
    assert _pipeline_options(c)["schedule"] == "zb1"
    assert _pipeline_options(c)["virtual_stages"] == 1
    assert _pipeline_options(c)["stack_order"] == "layers"
    c = Candidate("pp", (("stage", 2),), microbatches=4, schedule="interleaved", chunks=4)
    assert prune(tiny, c, budget=2**30).reason.endswith("2 stages × 4 chunks (interleaved)")
    assert _pipeline_options(c)["virtual_stages"] == 4
    c = Candidate("pp", (("stage", 2),), microbatches=4, schedule="interleaved")
    assert _pipeline_options(c)["virtual_stages"] == 2
    assert _pipeline_options(c)["stack_order"] == "interleaved"  # nothing moves each step
    zbv = Candidate("pp", (("stage", 2),), microbatches=4, schedule="zbv")
    assert _pipeline_options(zbv)["stack_order"] == "interleaved"  # its V, stored
    assert _pipeline_options(Candidate("pp", (("stage", 2),), microbatches=4))["schedule"] == "1f1b"


def test_a_schedule_that_refuses_its_microbatches_is_pruned_with_its_reason(tiny):
    # zb1 warms up with p forwards: fewer micro-batches than stages is refused.
    deep = Subject.of(models.get("gpt-tiny", n_layers=8), batch=8, seq=32)
    got = prune(
        deep, Candidate("pp", (("stage", 4),), microbatches=2, schedule="zb1"), budget=2**30
    )
    assert isinstance(got, Pruned) and got.reason.startswith("Schedule 'zb1': 2 micro-batches")
