"""The search space: factorisations, the registry, micro-batches."""

import dataclasses
import itertools
import math

import pytest

from shardkit import recipes
from shardkit.autoplanner.candidates import Candidate, enumerate_candidates, factorisations


@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (8, 3), (12, 2), (64, 3), (7, 2), (1, 1)])
def test_factorisations_are_every_ordered_split_with_axes_of_at_least_two(n, k):
    brute = [
        t
        for t in itertools.product(range(1, n + 1), repeat=k)
        if math.prod(t) == n and (min(t) >= 2 or n == 1)
    ]
    assert sorted(factorisations(n, k)) == sorted(brute)


def test_a_registered_recipe_joins_the_search(monkeypatch):
    import dataclasses

    mine = dataclasses.replace(recipes.get("fsdp"), name="mine", mesh_axes=(("shard", -1),))
    monkeypatch.setitem(recipes._REGISTRY, "mine", lambda: mine)
    found = [c for c in enumerate_candidates(8, 8, remats=["none"]) if c.recipe == "mine"]
    assert found == [Candidate("mine", (("shard", 8),), "none", None, "f32")]


def test_pipelines_get_p_2p_4p_microbatches_that_split_the_batch():
    got = {
        (c.mesh, c.microbatches)
        for c in enumerate_candidates(8, 16, recipe_names=["dp_pp"], remats=["none"])
    }
    # stage=2 x data=4: 4 rows per replica -> m in {2, 4} (8 does not divide 4 rows);
    # stage=4 x data=2: 8 rows -> m in {4, 8} (16 does not divide 8 rows).
    assert got == {
        ((("stage", 2), ("data", 4)), 2),
        ((("stage", 2), ("data", 4)), 4),
        ((("stage", 4), ("data", 2)), 4),
        ((("stage", 4), ("data", 2)), 8),
    }
    # A batch of 64: 16 and 32 rows per replica take all three, 4p included.
    got = {
        (dict(c.mesh)["stage"], c.microbatches)
        for c in enumerate_candidates(8, 64, recipe_names=["dp_pp"], remats=["none"])
    }
    assert got == {(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)}


def test_a_batch_too_small_to_pipeline_leaves_one_candidate_to_reject():
    got = enumerate_candidates(8, 2, recipe_names=["pp"], remats=["none"])
    assert [c.microbatches for c in got] == [None]


def test_candidates_round_trip_through_json():
    c = Candidate("zeropp", (("data", 2), ("stage", 2), ("fsdp", 2)), "full", 4, "bf16")
    assert Candidate.from_json(c.to_json()) == c
    assert c.label == "zeropp data=2×stage=2×fsdp=2 remat=full m=4 bf16"


def test_the_logits_layout_is_a_dimension_only_where_the_recipe_makes_it_a_choice():
    # fsdp splits the logits' vocabulary over the axis that splits the tokens: "vocab"
    # gathers the tokens' hidden states, "tokens" gathers the head's weight. dp keeps
    # both whole and tp splits the vocabulary but not the tokens: nothing to choose.
    got = enumerate_candidates(8, 8, recipe_names=["dp", "tp", "fsdp"], remats=["none"])
    assert {(c.recipe, c.logits) for c in got} == {
        ("dp", None),
        ("tp", None),
        ("fsdp", "vocab"),
        ("fsdp", "tokens"),
    }
    assert Candidate("fsdp", (("fsdp", 8),), logits="tokens").recipe_object().logits == "tokens"
    assert Candidate("fsdp", (("fsdp", 8),)).recipe_object().logits == "auto"
    # dp_tp_sp_pp's rules split the vocabulary over tensor, which splits the tokens too,
    # but its pipeline's head ignores the layout (measured: the same wire and temp under
    # both on gpt-tiny data=2×stage=2×tensor=2): one candidate per mesh, not two.
    got = enumerate_candidates(8, 8, recipe_names=["dp_tp_sp_pp"], remats=["none"])
    assert got and {c.logits for c in got} == {None}


def test_a_logits_layout_shows_in_the_label_and_survives_json():
    c = Candidate("fsdp", (("fsdp", 8),), "full", None, "f32", "vocab")
    assert Candidate.from_json(c.to_json()) == c
    assert c.label == "fsdp fsdp=8 remat=full logits=vocab f32"


def test_the_expert_axis_takes_each_size_dividing_the_experts_and_a_dense_model_none():
    # 64 devices, 8 experts: ep's expert axis 2, 4 or 8 (the rest data; 16, 32, 64 do
    # not divide 8 experts); ep_tp's expert × tensor (× data) likewise.
    cands = enumerate_candidates(64, 64, recipe_names=["ep", "ep_tp"], remats=["full"], n_experts=8)
    for c in cands:
        sizes = c.mesh_sizes
        assert 8 % sizes["expert"] == 0 and math.prod(sizes.values()) == 64
    assert {c.mesh_sizes["expert"] for c in cands if c.recipe == "ep"} == {2, 4, 8}
    assert {(("data", 8), ("expert", 8))} <= {c.mesh for c in cands}
    assert (("expert", 8), ("tensor", 8)) in {c.mesh for c in cands}
    # the data axis splits the batch with the expert axis
    ep = next(c for c in cands if c.mesh == (("data", 8), ("expert", 8)))
    assert ep.recipe_object().activation_rules.spec(("batch",))[0] == ("data", "expert")
    # a dense model: no expert candidates at all
    dense = enumerate_candidates(64, 64, recipe_names=["dp", "ep", "ep_tp"], remats=["full"])
    assert {c.recipe for c in dense} == {"dp"}


def test_a_pipeline_takes_each_schedule_at_each_microbatch_count_and_others_none():
    got = enumerate_candidates(8, 16, recipe_names=["dp_pp", "fsdp"], remats=["none"])
    pipelined = [(c.mesh, c.microbatches, c.schedule, c.chunks) for c in got if c.recipe == "dp_pp"]
    pairs = {(c.mesh, c.microbatches) for c in got if c.recipe == "dp_pp"}
    # interleaved over 2 (its default: None), 4 and 8 chunks; the others their own
    schedules = [("1f1b", None), ("interleaved", None), ("interleaved", 4), ("interleaved", 8),
                 ("zb1", None), ("zbv", None)]  # fmt: skip
    assert sorted(pipelined, key=str) == sorted(
        [(*pair, *s) for pair in pairs for s in schedules], key=str
    )
    assert {c.schedule for c in got if c.recipe == "fsdp"} == {None}
    # a schedule asked for alone; a batch with no micro-batch count leaves none to try
    only = enumerate_candidates(8, 16, recipe_names=["pp"], remats=["none"], schedules=["zb1"])
    assert {c.schedule for c in only} == {"zb1"}
    assert [
        c.schedule for c in enumerate_candidates(8, 2, recipe_names=["pp"], remats=["none"])
    ] == [None]


def test_a_schedule_shows_in_the_label_survives_json_and_sets_the_chunks():
    c = Candidate("pp", (("stage", 4),), "full", 8, "f32", schedule="interleaved")
    assert Candidate.from_json(c.to_json()) == c
    assert c.label == "pp stage=4 remat=full m=8 interleaved f32"
    assert [Candidate("pp", (("stage", 4),), schedule=s).virtual_stages for s in
            ("1f1b", "interleaved", "zb1", "zbv", None)] == [1, 2, 1, 2, 1]  # fmt: skip
    four = dataclasses.replace(c, chunks=4)
    assert Candidate.from_json(four.to_json()) == four != c
    assert four.label == "pp stage=4 remat=full m=8 interleaved×4 f32"
    assert four.virtual_stages == 4
