"""The planner's sanity cases, each with the reason it must come out that way."""

import json

import pytest

from shardkit import models, recipes
from shardkit.autoplanner import NoLayoutFitsError, autoplan
from shardkit.autoplanner.cache import Cache
from shardkit.autoplanner.candidates import Candidate
from shardkit.autoplanner.hardware import get
from shardkit.autoplanner.roofline import crosses_nodes
from shardkit.report.tables import to_lines
from shardkit.report.wire_terms import TERMS as WIRE_TERMS

MIB = 2**20


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # One cache for the module: a candidate compiled for one test (the same model, batch,
    # mesh and options) is read back by the next, as the planner reads it across runs.
    return Cache(tmp_path_factory.mktemp("planner-cache"))


def plan(model, cache, **kw):
    kw = {
        "batch": 8,
        "seq": 32,
        "devices": 8,
        "memory_per_device": 2**30,
        "hardware": "h100",
        "remats": ["none"],
        "progress": False,
        **kw,
    }
    return autoplan(model, cache=cache, **kw)


@pytest.fixture(scope="module")
def gpt_tiny_on_8(cache):
    """gpt-tiny, 16k tokens, 8 H100s with 16 GiB each: dp, zero1, fsdp and dp_pp compiled."""
    return plan(
        "gpt-tiny",
        cache,
        batch=128,
        seq=128,
        memory_per_device=16 * 2**30,
        recipes=["dp", "zero1", "fsdp", "dp_pp"],
        max_compiles=4,
    )


def test_a_small_model_on_8_devices_picks_pure_data_parallelism(gpt_tiny_on_8):
    # Every layout does the same useful FLOPs; DP's gradient all-reduce (2Ψ) is the least
    # traffic and the fewest collectives. ZeRO-1 moves as much in more collectives; FSDP
    # moves 3Ψ; a pipeline idles for its bubble and waits on its ticks. With 16k tokens
    # the step's FLOPs take 3.9 µs on an H100: DP's three all-reduces' latency (31 µs)
    # bounds it.
    r = gpt_tiny_on_8
    assert r.best.candidate.recipe == "dp"
    assert r.best.estimate.comm_s >= r.best.estimate.compute_s
    assert r.best.estimate.latency_s >= 0.5 * r.best.estimate.comm_s
    assert r.best.reason.startswith("fastest")
    assert all(c.reason for c in r.candidates)


def test_adam_state_over_one_device_under_dp_picks_an_fsdp_variant(cache):
    # d_model 256: Ψ ≈ 1.6 M, so DP holds 16Ψ ≈ 26 MB of parameters, gradients and Adam
    # state per device: a 10 MiB budget rules it out before compiling; FSDP holds 16Ψ/8.
    model = models.get("gpt-tiny", d_model=256)
    r = plan(
        model, cache, memory_per_device=10 * MIB, recipes=["dp", "fsdp", "dp_fsdp"], max_compiles=3
    )
    assert r.best.candidate.recipe in {"fsdp", "dp_fsdp"}
    (dp,) = [x for x in r.rejected if x.candidate.recipe == "dp"]
    assert dp.stage == "analytic" and "over the 10.0 MiB budget" in dp.reason
    assert all(c.evidence.memory["total"] <= 10 * MIB for c in r.candidates)


def test_a_long_sequence_with_a_small_batch_picks_a_sequence_parallel_variant(cache):
    # One sequence cannot be split over a data axis; of what is left, tensor parallelism
    # all-reduces activations of every token, while context/sequence layouts shard the
    # tokens and move K/V or weights of a tiny model instead.
    r = plan(
        "llama-tiny",
        cache,
        batch=1,
        seq=512,
        max_compiles=3,
        recipes=["dp", "fsdp", "tp", "tp_sp", "cp", "fsdp_cp", "tsp"],
    )
    best = recipes.get(r.best.candidate.recipe)
    spec = best.activation_rules.spec(("batch", "length"), (1, 512), r.best.candidate.mesh_sizes)
    assert spec[1] is not None, (r.best.candidate.label, spec)
    splits_batch = {x.candidate.recipe for x in r.rejected if x.reason.startswith("batch")}
    assert {"dp", "fsdp"} <= splits_batch


def test_a_mesh_axis_that_does_not_divide_the_head_count_is_never_proposed(cache):
    # 4 heads: tensor=8 cannot split them; tensor=2 and 4 can.
    model = models.get("gpt-tiny", n_heads=4, n_kv_heads=4)
    r = plan(model, cache, recipes=["tp", "fsdp_tp"])
    assert r.candidates
    for c in r.candidates:
        assert 4 % c.candidate.mesh_sizes["tensor"] == 0, c.candidate.label
    (tp8,) = [x for x in r.rejected if x.candidate.recipe == "tp"]
    assert "heads" in tp8.reason and "tensor=8" in tp8.reason


def test_a_slow_cross_node_link_keeps_the_heavy_traffic_inside_a_node(cache):
    # 4 nodes of 2 devices and a 1 GB/s link between them. data=4 x fsdp=2 keeps FSDP's
    # 3Ψ of gathers and scatters inside a node and sends only the data all-reduce of a
    # half-sharded gradient (0.75Ψ) across; data=2 x fsdp=4 or pure DP/FSDP send more
    # across nodes.
    hw = get("h100").with_(devices_per_node=2, inter_node_bandwidth=1e9)
    r = plan("gpt-tiny", cache, hardware=hw, recipes=["dp", "fsdp", "dp_fsdp"])
    best = r.best
    assert best.candidate.mesh_sizes == {"data": 4, "fsdp": 2}
    inter = sum(w for _, w, g, *_ in best.evidence.collectives if crosses_nodes(g, 2))
    intra = sum(w for _, w, g, *_ in best.evidence.collectives if not crosses_nodes(g, 2))
    assert intra > inter > 0
    for other in r.candidates[1:]:
        assert (
            sum(w for _, w, g, *_ in other.evidence.collectives if crosses_nodes(g or range(8), 2))
            > inter
        )


def test_json_fields_and_the_cache_makes_a_second_call_compile_nothing(cache, monkeypatch):
    from shardkit.autoplanner import planner

    first = plan("gpt-tiny", cache, recipes=["dp", "fsdp"]).to_json()
    for c in first["candidates"]:
        for key in (
            "recipe",
            "mesh",
            "remat",
            "microbatches",
            "precision",
            "wire_bytes",
            "step_time_s",
            "mfu",
            "reason",
        ):
            assert key in c
        assert c["memory_per_device_bytes"]["total"] > 0
    assert all(r["reason"] for r in first["rejected"])

    def no_compiling(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(planner, "compile_candidate", no_compiling)
    again = plan("gpt-tiny", cache, recipes=["dp", "fsdp"]).to_json()
    assert json.dumps(again["candidates"]) == json.dumps(first["candidates"])


def test_nothing_fits_names_the_smallest_memory_that_would(cache):
    with pytest.raises(
        NoLayoutFitsError, match=r"smallest memory that would fit: about [\d.]+ MiB"
    ):
        plan("gpt-tiny", cache, memory_per_device=1000, recipes=["dp", "fsdp"])


def test_a_device_count_nothing_divides_names_counts_that_would_work(cache):
    # 7 devices: no recipe's axes split gpt-tiny's batch of 8, 64-wide matrices or 8 heads.
    with pytest.raises(NoLayoutFitsError, match=r"divide the model and batch: 2, 4, 8\."):
        plan("gpt-tiny", cache, devices=7, recipes=["dp", "fsdp", "tp"])


def test_both_logits_layouts_compile_and_each_gap_to_the_analytic_memory_is_itemised(cache):
    # fsdp=8 at 4,096 tokens over gpt-tiny's 256-word vocabulary: logits="vocab" gathers
    # every token's hidden state (4,096 x 64 floats, 16x the head's weight), "tokens"
    # gathers the weight instead; the compiled programs must show it on the wire: each
    # device receives the other 7/8 of the hidden states at least once more.
    r = plan("gpt-tiny", cache, batch=64, seq=64, recipes=["fsdp"], max_compiles=2, remats=["full"])
    by = {c.candidate.logits: c for c in r.candidates}
    assert set(by) == {"vocab", "tokens"}
    hidden_gather = 4096 * 64 * 4 * 7 / 8
    assert by["vocab"].evidence.wire_bytes - by["tokens"].evidence.wire_bytes >= hidden_gather
    for c in r.candidates:
        j = c.to_json()
        assert j["logits"] == c.candidate.logits
        assert j["analytic_over_compiled_memory"] == pytest.approx(
            c.analytic.memory / c.evidence.memory["total"]
        )
        # the temp memory split into terms adds up to XLA's temp size ...
        assert sum(t["bytes"] for t in j["memory_terms"]) == j["memory_per_device_bytes"]["temp"]
        # ... and every term off its analytic value by more than 10 % says why
        off = {
            t["term"]
            for t in j["memory_terms"]
            if t["bytes"] and (t["ratio"] is None or abs(t["ratio"] - 1) > 0.10)
        }
        assert off and off <= {e["term"] for e in j["memory_explanations"]}
        # ... and only memory's: the report's wire-term lines stay out of them
        assert not {e["term"] for e in j["memory_explanations"]} & set(WIRE_TERMS)
    # At 80 columns the two rows differ only by the logits' layout: the table shows it,
    # one line per row, the names whole.
    table = to_lines(r.table(width=80), 80)
    assert max(map(len, table)) <= 80
    header = table[1].split()
    assert header[:3] == ["#", "recipe", "mesh"] and "logits" in header
    rows = [dict(zip(header, line.split(), strict=False)) for line in table[3:5]]
    assert {(row["recipe"], row["mesh"], row["logits"]) for row in rows} == {
        ("fsdp", "fsdp=8", "vocab"),
        ("fsdp", "fsdp=8", "tokens"),
    }
    narrow = to_lines(r.table(width=40), 40)  # narrower than the names: they still win
    ranked = [line.split() for line in narrow if line.split()[:1] in (["1"], ["2"])]
    assert {cells[-3] for cells in ranked} == {"vocab", "tokens"}
    # the CLI prints #1's gap by term (at any tolerance below its own ratio's distance)
    lines = r.memory_gap_lines(tolerance=0.0)
    assert lines[0].startswith("#1's analytic memory is")
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        e["term"] for e in r.best.evidence.explanations
    ]


def test_the_3d_pipeline_is_estimated_and_compiled_like_the_other_pipelines(cache):
    # dp_tp_sp_pp has an analytic model (data × stage × tensor, TP+SP per stage): on 8
    # devices its one mesh, 2 × 2 × 2, with m = p = 2 micro-batches of 8 / (2·2) rows,
    # passes the analytic checks and is compiled, not pruned for want of an estimate;
    # only the schedules that need two chunks of its 2 layers a stage are pruned.
    r = plan("gpt-tiny", cache, recipes=["dp_tp_sp_pp"], max_compiles=1)
    pruned = [x for x in r.rejected if x.stage == "analytic"]
    assert {x.candidate.schedule for x in pruned} == {"interleaved", "zbv"}
    assert all(
        x.reason.endswith(f"× {x.candidate.virtual_stages} chunks ({x.candidate.schedule})")
        for x in pruned
    )
    assert {x.candidate.virtual_stages for x in pruned} == {2, 4, 8}
    best = r.best
    assert best.candidate.mesh_sizes == {"data": 2, "stage": 2, "tensor": 2}
    assert best.candidate.microbatches in (2, 4)
    # The stage-to-stage permutes alone: 2·(m + p − 1 − 1) ticks × (8/(m·2))·(32/2)·64·4 B.
    m = best.candidate.microbatches
    assert best.analytic.wire > 2 * (m + 2 - 2) * (8 // (m * 2)) * 16 * 64 * 4
    assert best.evidence.memory["total"] > 0


def test_candidates_are_ranked_by_the_estimate_and_each_compiled_says_how_far_it_was(cache):
    # sk.estimate ranks every survivor; the 2 compiled say how far their estimate was
    # from the compiled total, and the rest are "not compiled".
    from shardkit.report.estimator import estimate

    r = plan("gpt-tiny", cache, recipes=["dp", "fsdp", "tp_sp"], max_compiles=2)
    assert len(r.candidates) == 2
    for c in r.candidates:
        e = estimate(
            c.candidate.recipe,
            models.get("gpt-tiny", remat="none"),
            mesh=c.candidate.mesh_sizes,
            batch=8,
            seq=32,
        )
        assert c.analytic.estimated == e.total
        off = e.total / c.evidence.memory["total"] - 1
        assert f"{off:+.0%} off the compiled" in c.reason
        assert c.to_json()["estimated_memory_per_device_bytes"] == e.total
    assert any(x.stage == "not compiled" for x in r.rejected)


def test_gpt_tiny_ranks_dp_first_and_no_step_beats_its_collectives_latencies(gpt_tiny_on_8):
    # gpt-tiny's step is microseconds of FLOPs on an H100: latency decides. dp_pp (stage 2
    # × data 4, m = 2) ranked first at 1.34 µs by bandwidth alone; its four 1F1B ticks each
    # wait on a neighbour and it runs more collectives than dp's gradient all-reduces.
    r = gpt_tiny_on_8
    assert r.best.candidate.recipe == "dp"
    assert any(c.candidate.recipe == "dp_pp" for c in r.candidates)
    for ranked in r.candidates:
        # NCCL's ring model by hand (3.6 µs + 0.47 µs per NVLink step; one node of 8):
        # 2(n - 1) steps for an all-reduce, n - 1 for a gather or scatter, 1 for a permute.
        alpha = 0.0
        for kind, _, _, count, n in ranked.evidence.collectives:
            steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)
            alpha += count * (3.6e-6 + steps * 0.47e-6) if n > 1 or steps == 1 else 0.0
        assert ranked.estimate.latency_s == pytest.approx(alpha)
        assert ranked.estimate.step_time_s >= alpha


def test_an_moe_model_searches_the_expert_axis_and_can_choose_ep(cache):
    # moe-tiny's whole state is 16 B × 279,872 parameters = 4.27 MiB: over a 4.25 MiB
    # budget replicated (dp), while ep holds 1/e of the experts' 196,608. The planner
    # tries every expert axis dividing the 8 experts (the rest of the devices data).
    budget = 4.25 * MIB
    result = plan("moe-tiny", cache, recipes=["dp", "ep"], memory_per_device=budget, max_compiles=1)
    considered = [r.candidate for r in result.rejected] + [r.candidate for r in result.candidates]
    meshes = {c.mesh for c in considered if c.recipe == "ep"}
    assert meshes == {
        (("expert", 8),),
        (("data", 2), ("expert", 4)),
        (("data", 4), ("expert", 2)),
    }
    dp = [r for r in result.rejected if r.candidate.recipe == "dp"]
    assert dp and all("over the" in r.reason for r in dp)
    best = result.best
    assert best.candidate.recipe == "ep" and best.evidence.memory["total"] <= budget
    split = best.candidate.mesh_sizes["expert"]
    assert f"(1/{split} of " in best.reason and "all-to-all" in best.reason


def test_pipelined_candidates_are_ranked_by_the_estimate_like_the_others():
    # The rolled pipeline engine (the default) has estimator terms: every pipelined
    # candidate, zeropp and 3D included, carries sk.estimate's total for its schedule
    # and micro-batches, not the analytic memory in its place (no compile here).
    from shardkit.autoplanner.candidates import enumerate_candidates
    from shardkit.autoplanner.evaluate import Analytic, Subject, prune
    from shardkit.report.estimator import estimate
    from shardkit.step import PIPELINE_DEFAULTS

    model = models.get("gpt-tiny", remat="full")
    subject = Subject.of(model, batch=8, seq=32)
    pipelined = enumerate_candidates(
        8, 8, recipe_names=["pp", "dp_pp", "zeropp", "dp_tp_sp_pp"], remats=["full"]
    )
    checked = 0
    for c in pipelined:
        got = prune(subject, c, budget=2**30)
        if not isinstance(got, Analytic):
            continue
        e = estimate(
            c.recipe_object(),
            model,
            mesh=c.mesh_sizes,
            batch=8,
            seq=32,
            pipeline={
                **PIPELINE_DEFAULTS,
                "microbatches": c.microbatches,
                "schedule": c.schedule,
                "virtual_stages": c.virtual_stages,
            },
        )
        assert got.estimated == e.total
        assert got.ranking_memory == e.total  # what the planner ranks by
        checked += 1
    assert checked >= 3


def test_an_unknown_schedule_is_refused_before_anything_compiles(cache):
    from shardkit.errors import ShardingError

    with pytest.raises(ShardingError, match=r"schedule 'pipedream'.*gpipe, 1f1b, interleaved"):
        plan("gpt-tiny", cache, recipes=["pp"], schedules=["pipedream"])


def test_each_schedule_compiles_its_own_program(cache):
    # pp on 2 stages, m = 2 micro-batches: 1F1B and zb1 tie before compiling (gpt-tiny's
    # wire outweighs its FLOPs), both compile, and zb1's program holds what each B hands
    # its W besides the residuals: more temp than 1F1B's (5.5 against 7.2 MB measured).
    r = plan(
        "gpt-tiny", cache, devices=2, recipes=["pp"], schedules=["1f1b", "zb1"], max_compiles=2
    )
    got = {x.candidate.schedule: x for x in r.candidates if x.candidate.microbatches == 2}
    assert set(got) == {"1f1b", "zb1"}
    assert got["zb1"].evidence.memory["temp"] > got["1f1b"].evidence.memory["temp"]


def test_interleaved_chunks_reach_the_step_one_send_per_item():
    # pp on 2 stages, m = 2, gpt-tiny with 8 layers: over v chunks a stage runs v·m
    # forward and v·m backward items, each handing its neighbour one send: 2·v·m sends
    # a step (8 and 16 by hand), each chunk's activation the same size.
    import jax

    from shardkit.autoplanner.evaluate import Subject, compile_candidate

    subject = Subject.of(models.get("gpt-tiny", n_layers=8), batch=8, seq=32)
    sends = {}
    for chunks in (None, 4):
        c = Candidate("pp", (("stage", 2),), "none", 2, schedule="interleaved", chunks=chunks)
        got = compile_candidate(subject, c, jax.devices()[:2])
        sends[c.virtual_stages] = sum(
            count for kind, _, _, count, _ in got.collectives if kind == "collective-permute"
        )
    assert sends == {2: 2 * 2 * 2, 4: 2 * 4 * 2}


def test_each_wire_term_goes_over_the_link_its_axes_use():
    # zeropp on data 4 × stage 16 × fsdp 8, 8 devices a node, devices row-major (fsdp
    # fastest): fsdp's groups are 8 neighbours (one node), stage's and data's span nodes.
    # Gradient reductions reduce-scatter over fsdp, (8-1)/8 of G, and all-reduce the shard
    # over data, 2·(4-1)/(4·8) of G: 7/8 : 3/16 of the term, by hand.
    from shardkit.autoplanner.evaluate import Analytic
    from shardkit.autoplanner.planner import term_links

    c = Candidate("zeropp", (("data", 4), ("stage", 16), ("fsdp", 8)))
    terms = (
        ("weight all-gathers", 10.0),
        ("gradient reductions", 17.0),
        ("pipeline transfers", 3.0),
        ("expert dispatch", 1.0),
    )
    got = term_links(c, Analytic(0.0, 0.0, 32.0, wire_terms=terms), per_node=8)
    assert got[0] == (10.0, False)
    (rs, rs_crosses), (ar, ar_crosses) = got[1], got[2]
    assert (rs_crosses, ar_crosses) == (False, True)
    assert rs == pytest.approx(17.0 * (7 / 8) / (7 / 8 + 3 / 16))
    assert rs + ar == pytest.approx(17.0)
    assert got[3] == (3.0, True)
    assert got[4] == (1.0, True)  # no axis of its own here: every axis
    assert got[5] == (1.0, True)  # the 1 B the terms do not name
    # with 256 devices a node, stage's groups (stride 8, ids 120 apart) sit in one
    assert (
        term_links(c, Analytic(0.0, 0.0, 3.0, wire_terms=terms[2:3]), per_node=256)[0][1] is False
    )
