"""Tests for shardkit.report.analytic: the ZeRO / Megatron analytic cost of a layout."""

import dataclasses

import pytest

from shardkit import recipes
from shardkit.errors import ShardingError
from shardkit.models import CONFIGS, ModelConfig
from shardkit.report import build_report
from shardkit.report.analytic import (
    AnalyticMemory,
    analytic_model,
    megatron_activations_per_layer,
    wire_bytes,
    wire_bytes_hybrid,
    with_phases,
    zero_memory,
)
from shardkit.workload import Workload

PSI = 1_234_567


def ring(n: int) -> float:
    return (n - 1) / n


# ---------------------------------------------------------------- ZeRO memory


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(stage, gb):
    """ZeRO paper, figure 1: Ψ = 7.5B, N = 64, K = 12."""
    m = zero_memory(7.5e9, 64, stage)
    assert abs(m.total - gb * 1e9) < 0.05e9
    assert m.activations == 0


def test_zero_stages_shard_what_they_say():
    m = [zero_memory(PSI, 8, s, k=8, param_bytes=4, grad_bytes=4) for s in range(4)]
    assert m[0] == AnalyticMemory(4 * PSI, 4 * PSI, 8 * PSI, 0.0)
    assert m[1] == AnalyticMemory(4 * PSI, 4 * PSI, PSI, 0.0)
    assert m[2] == AnalyticMemory(4 * PSI, PSI / 2, PSI, 0.0)
    assert m[3].total == pytest.approx(16 * PSI / 8)


def test_memory_to_dict():
    d = AnalyticMemory(1.0, 2.0, 3.0, 4.0).to_dict()
    assert d == {"params": 1.0, "grads": 2.0, "optimizer": 3.0, "activations": 4.0, "total": 10.0}


@pytest.mark.parametrize("stage, n", [(4, 8), (1, 0)])
def test_zero_rejects_bad_input(stage, n):
    with pytest.raises(ShardingError, match="stage"):
        zero_memory(PSI, n, stage)


# ---------------------------------------------------------------- Megatron activations

SBH = 2048 * 1 * 12288  # GPT-3 175B layer: s=2048, b=1, h=12288, a=96, t=8; 5as/h = 80
GPT3 = {"none": SBH * 114, "tp": SBH * 23, "tp_sp": SBH * 14.25, "full_recompute": SBH * 2}


@pytest.mark.parametrize("mode", list(GPT3))
def test_megatron_gpt3_layer(mode):
    got = megatron_activations_per_layer(2048, 1, 12288, 96, t=8, mode=mode)
    assert got == pytest.approx(GPT3[mode])
    f32 = megatron_activations_per_layer(2048, 1, 12288, 96, t=8, mode=mode, bytes_per_value=4)
    assert f32 == pytest.approx(2 * GPT3[mode])


def test_megatron_ordering_and_t1():
    def act(mode, t=8):
        return megatron_activations_per_layer(2048, 1, 12288, 96, t=t, mode=mode)

    assert act("none") > act("tp") > act("tp_sp") > act("full_recompute")
    assert act("tp", t=1) == act("tp_sp", t=1) == act("none")


def test_megatron_unknown_mode():
    with pytest.raises(ShardingError, match="full_recompute"):
        megatron_activations_per_layer(8, 1, 8, 1, mode="selective")


# ---------------------------------------------------------------- wire bytes

ACT = dict(layers=3, b=8, s=16, h=32)


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_wire_dp_fsdp_zero(n):
    dp = wire_bytes("dp", psi=PSI, n=n)
    assert sum(dp.values()) == pytest.approx(2 * PSI * 4 * ring(n))
    assert set(dp) <= {"all-reduce"}
    fsdp = wire_bytes("fsdp", psi=PSI, n=n)
    assert sum(fsdp.values()) == pytest.approx(3 * PSI * 4 * ring(n))
    assert fsdp.get("all-gather", 0) == pytest.approx(2 * PSI * 4 * ring(n))
    assert wire_bytes("zero3", psi=PSI, n=n) == fsdp
    for kind in ("zero1", "zero2"):
        z = wire_bytes(kind, psi=PSI, n=n)
        assert sum(z.values()) == pytest.approx(sum(dp.values()))
        assert z.get("reduce-scatter", 0) == pytest.approx(z.get("all-gather", 0))


def test_wire_one_device_moves_nothing():
    for kind in ("dp", "zero1", "fsdp", "tp", "tp_sp", "cp"):
        assert wire_bytes(kind, psi=PSI, n=1, vocab=64, **ACT) == {}


def test_wire_tp_hand_computed():
    layers, b, s, h, t, v = 2, 4, 16, 32, 4, 100
    layer_ar = 4 * layers * 2 * ring(t) * b * s * h * 4
    embed_head_ar = 2 * 2 * ring(t) * b * s * h * 4
    loss_ar = 3 * 2 * ring(t) * b * s * 4
    kw = dict(psi=PSI, n=t, layers=layers, b=b, s=s, h=h)
    assert wire_bytes("tp", **kw) == {"all-reduce": pytest.approx(layer_ar)}
    got = wire_bytes("tp", vocab=v, **kw)
    assert got == {"all-reduce": pytest.approx(layer_ar + embed_head_ar + loss_ar)}
    assert wire_bytes("tp", **{**kw, "n": 99}, t=t) == wire_bytes("tp", **kw)  # t overrides n
    # Llama's q, k, v, gate and up are 5 kernels, each input gradient reduced on its own:
    # 2 forward + 5 backward all-reduces a layer.
    llama = wire_bytes("tp", in_projections=5, **kw)["all-reduce"]
    assert llama == pytest.approx(layer_ar * (2 + 5) / 4)


@pytest.mark.parametrize("vocab", [None, 50])
@pytest.mark.parametrize("projections", [2, 5])  # fused qkv and up (GPT); Llama's 5 kernels
def test_wire_tp_sp_hand_computed(vocab, projections):
    # Megatron-SP per layer, each collective (t−1)/t of b·s·h values: forward, the 2
    # column-parallel inputs (attention's, the MLP's) all-gathered and the 2 row-parallel
    # outputs reduce-scattered; backward, the 2 output gradients all-gathered (the
    # transposes of the forward reduce-scatters), the 2 inputs all-gathered again for
    # the weight gradients (only their sequence shard is kept), and each column-parallel
    # projection's input gradient reduce-scattered. With the vocabulary: the embedding's
    # output reduce-scattered forward and its gradient gathered backward, the head's input
    # gathered forward and its gradient reduce-scattered backward; the cross-entropy's 3
    # all-reduces of b·s as under TP.
    layers, b, s, h, t = 2, 4, 16, 32, 4
    one = ring(t) * b * s * h * 4
    gathers, scatters = (2 + 2 + 2) * layers, (2 + projections) * layers
    if vocab is not None:
        gathers, scatters = gathers + 2, scatters + 2
    want = {"all-gather": gathers * one, "reduce-scatter": scatters * one}
    if vocab is not None:
        want["all-reduce"] = 3 * 2 * ring(t) * b * s * 4
    got = wire_bytes(
        "tp_sp", psi=PSI, n=t, layers=layers, b=b, s=s, h=h, vocab=vocab, in_projections=projections
    )
    assert got == pytest.approx(want)
    # TP's all-reduces are the reductions alone, twice the bytes each: no re-gathers.
    tp = wire_bytes(
        "tp", psi=PSI, n=t, layers=layers, b=b, s=s, h=h, vocab=vocab, in_projections=projections
    )
    assert tp["all-reduce"] == pytest.approx(2 * want["reduce-scatter"] + want.get("all-reduce", 0))


def test_wire_cp():
    got = wire_bytes("cp", psi=PSI, n=4, h_kv=16, **ACT)
    kv = 2 * 3 * 8 * 16 * 16 * 4 * ring(4)
    assert got == pytest.approx(
        {"all-reduce": 2 * PSI * 4 * ring(4), "all-gather": kv, "reduce-scatter": kv}
    )


def test_wire_errors():
    with pytest.raises(ShardingError, match="known"):
        wire_bytes("pp", psi=PSI, n=2)
    with pytest.raises(ShardingError, match="layers="):
        wire_bytes("tp", psi=PSI, n=2)
    with pytest.raises(ShardingError, match="axes are"):
        wire_bytes_hybrid({"pipe": 2}, psi=PSI)


@pytest.mark.parametrize(
    "axes, kind, n",
    [
        ({"data": 1, "fsdp": 4}, "fsdp", 4),
        ({"data": 4, "fsdp": 1}, "dp", 4),
        ({"fsdp": 1, "tensor": 4}, "tp", 4),
        ({"fsdp": 4, "tensor": 1}, "fsdp", 4),
        ({"data": 1, "tensor": 4}, "tp_sp", 4),
        ({"fsdp": 1, "sequence": 4}, "cp", 4),
    ],
)
def test_hybrid_reduces_to_pure(axes, kind, n):
    tensor_kind = "tp_sp" if kind == "tp_sp" else "tp"
    hybrid = wire_bytes_hybrid(axes, psi=PSI, vocab=64, tensor_kind=tensor_kind, **ACT)
    assert hybrid == pytest.approx(wire_bytes(kind, psi=PSI, n=n, vocab=64, **ACT))


def test_hybrid_data_fsdp():
    d, f = 2, 4
    got = wire_bytes_hybrid({"data": d, "fsdp": f}, psi=PSI)
    assert got == pytest.approx(
        {
            "all-gather": 2 * PSI * 4 * ring(f),
            "reduce-scatter": PSI * 4 * ring(f),
            "all-reduce": 2 * (PSI / f) * 4 * ring(d),
        }
    )
    z = wire_bytes_hybrid({"data": d, "fsdp": f}, psi=PSI, data_kind="zero1")
    assert sum(z.values()) == pytest.approx(sum(got.values()))


def test_hybrid_fsdp_tp():
    f, t = 2, 4
    got = wire_bytes_hybrid({"fsdp": f, "tensor": t}, psi=PSI, **ACT)
    tp = wire_bytes("tp", psi=PSI, n=t, **{**ACT, "b": ACT["b"] / f})  # per-fsdp-group batch
    fsdp = wire_bytes("fsdp", psi=PSI / t, n=f)  # FSDP over Ψ/t
    assert got == pytest.approx({k: tp.get(k, 0) + fsdp.get(k, 0) for k in {*tp, *fsdp}})


def test_hybrid_bad_kinds():
    with pytest.raises(ShardingError, match="data_kind"):
        wire_bytes_hybrid({"data": 2}, psi=PSI, data_kind="zero9")


# ---------------------------------------------------------------- analytic_model

MESHES = {
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "fsdp": {"fsdp": 8},
    "tp": {"tensor": 8},
    "tp_sp": {"tensor": 4},
    "cp": {"sequence": 4},
    "dp_fsdp": {"data": 2, "fsdp": 4},
    "fsdp_tp": {"fsdp": 4, "tensor": 2},
    "dp_tp_sp": {"data": 2, "tensor": 4},
    "fsdp_cp": {"fsdp": 2, "sequence": 4},
    "cp_usp": {"sequence": 2, "ulysses": 2},
    "tsp": {"tsp": 8},  # tsp degree: tests/parallel/test_tsp_analytic.py
    "tsp_gspmd": {"tsp": 8},
    "dp_tsp": {"data": 2, "tsp": 4},
    "dp_tsp_gspmd": {"data": 2, "tsp": 4},
    "ep": {"expert": 8},
    "ep_gspmd": {"expert": 8},
    "fsdp_ep": {"expert": 8},
    "ep_tp": {"expert": 4, "tensor": 2},
}
DEGREES = {  # (data, fsdp, tensor, sequence)
    name: tuple(mesh.get(a, 1) for a in ("data", "fsdp", "tensor", "sequence"))
    for name, mesh in MESHES.items()
}
# cp and fsdp_cp split the state over 'sequence' too (context_state="sharded"): by their
# rules that axis splits parameters and the tokens, TSP's role (par.tsp), run by XLA.
DEGREES["cp"], DEGREES["fsdp_cp"] = (1, 1, 1, 1), (1, 2, 1, 1)
DEGREES["cp_usp"] = (1, 1, 1, 1)  # both context axes: par.tsp = 2 × 2
# The expert axis splits the batch: data parallel for the dense part (FSDP under fsdp_ep).
DEGREES.update({"ep": (8, 1, 1, 1), "ep_gspmd": (8, 1, 1, 1), "fsdp_ep": (1, 8, 1, 1)})
DEGREES["ep_tp"] = (4, 1, 2, 1)


#: What each built-in recipe runs, by hand from its docstring (data kind, tensor kind).
KINDS = {"zero1": ("zero1", "tp"), "tp_sp": ("dp", "tp_sp"), "dp_tp_sp": ("dp", "tp_sp")}


@pytest.mark.parametrize("name", list(MESHES))
def test_parallelism_is_read_from_the_recipe_rules(name):
    par = recipes.get(name).parallelism(MESHES[name])
    assert (par.data, par.fsdp, par.tensor, par.sequence) == DEGREES[name]
    if name in ("cp", "fsdp_cp", "cp_usp"):
        assert (par.tsp, par.tsp_kind) == (4, "gspmd")
    assert (par.data_kind, par.tensor_kind) == KINDS.get(name, ("dp", "tp"))


def test_every_builtin_recipe_is_covered():
    # Pipeline recipes (a 'stage' axis) have their own model: tests/parallel.
    plain = {n for n in recipes.names() if "stage" not in dict(recipes.get(n).mesh_axes)}
    assert set(MESHES) == plain


def test_a_custom_recipe_gets_the_analytic_model_of_what_it_does():
    # Registered under a made-up name, FSDP's rules on an axis called "shard": the
    # analytic model follows the rules, not the name.
    import dataclasses

    fsdp = recipes.get("fsdp")

    def renamed(rules):
        return sk_rules([(n, "shard" if a == "fsdp" else a) for n, a in rules])

    custom = dataclasses.replace(
        fsdp,
        name="my_layout",
        mesh_axes=(("shard", -1),),
        rules=renamed(fsdp.rules),
        activation_rules=renamed(fsdp.activation_rules),
    )
    cfg = CONFIGS["gpt-tiny"]
    mine = analytic_model(cfg.dims(), custom, {"shard": 8}, batch=8, seq=32)
    ref = analytic_model(cfg.dims(), "fsdp", {"fsdp": 8}, batch=8, seq=32)
    assert mine.memory == ref.memory and mine.wire_bytes_by_kind == ref.wire_bytes_by_kind
    # ... and a recipe registered under a built-in name cannot borrow that name's model.
    as_dp = dataclasses.replace(custom, name="dp")
    assert analytic_model(cfg.dims(), as_dp, {"shard": 8}, batch=8, seq=32).memory == ref.memory


def sk_rules(pairs):
    from shardkit.rules import Rules

    return Rules(pairs)


@pytest.mark.parametrize("config_name", ["gpt-tiny", "llama-tiny"])
# TSP, and cp/fsdp_cp (the state over the context axis: TSP's layout by rules), have their
# own tests (tests/parallel/test_tsp_analytic.py, tests/recipes/test_cp_scaling.py).
@pytest.mark.parametrize("name", [n for n in MESHES if "tsp" not in n and "cp" not in n])
def test_analytic_model_each_recipe(name, config_name):
    cfg = CONFIGS[config_name]
    psi, (d, f, t, c) = cfg.param_count(), DEGREES[name]
    m = analytic_model(cfg.dims(), name, MESHES[name], batch=16, seq=64)
    assert m.memory.params == pytest.approx(4 * psi / (t * f))
    assert m.memory.grads == pytest.approx(4 * psi / (t * f))
    opt_degree = t * f * (d if name == "zero1" else 1)
    assert m.memory.optimizer == pytest.approx(8 * psi / opt_degree)
    mode = {"tp": "tp", "fsdp_tp": "tp", "ep_tp": "tp", "tp_sp": "tp_sp", "dp_tp_sp": "tp_sp"}
    mode = mode.get(name, "none")
    b, s = 16 / (d * f), 64 / c
    layer = megatron_activations_per_layer(
        s, b, cfg.d_model, cfg.n_heads, t=t, mode=mode, bytes_per_value=4
    )
    logits = b * s * cfg.vocab * 4 / t
    assert m.memory.activations == pytest.approx(cfg.n_layers * layer + logits)
    assert m.wire_bytes_by_kind and all(v > 0 for v in m.wire_bytes_by_kind.values())
    assert any("Korthikanti" in n for n in m.notes) and any("ZeRO" in n for n in m.notes)


def test_analytic_model_matches_zero_and_wire_bytes():
    cfg = CONFIGS["gpt-tiny"]
    psi = cfg.param_count()
    for name, stage in [("dp", 0), ("zero1", 1), ("fsdp", 3)]:
        # ZeRO-3's formula gathers every weight: fsdp with its head gathering its weight
        recipe = recipes.get(name).with_logits("tokens")
        m = analytic_model(cfg.dims(), recipe, MESHES[name], batch=8, seq=32)
        z = zero_memory(psi, 8, stage, k=8, param_bytes=4, grad_bytes=4)
        state = m.memory.params + m.memory.grads + m.memory.optimizer  # the total is a phase peak
        assert state == pytest.approx(z.total)
        kind = "fsdp" if name == "fsdp" else name
        assert m.wire_bytes_by_kind == pytest.approx(wire_bytes(kind, psi=psi, n=8))


@pytest.mark.parametrize(
    "hybrid, mesh, pure",
    [
        ("dp_fsdp", {"data": 1, "fsdp": 4}, "fsdp"),
        ("dp_fsdp", {"data": 4, "fsdp": 1}, "dp"),
        ("fsdp_tp", {"fsdp": 1, "tensor": 4}, "tp"),
        ("dp_tp_sp", {"data": 1, "tensor": 4}, "tp_sp"),
        ("fsdp_cp", {"fsdp": 1, "sequence": 4}, "cp"),
    ],
)
def test_analytic_hybrid_reduces_to_pure(hybrid, mesh, pure):
    cfg = CONFIGS["llama-tiny"]
    pure_mesh = {a: v for a, v in mesh.items() if v > 1}
    # fsdp's (and fsdp_cp's) head splits the vocabulary over the axis that splits the
    # tokens, dp_fsdp's does not: compare like with like (that layout's own wire is
    # tested below).
    h = analytic_model(cfg.dims(), recipes.get(hybrid).with_logits("tokens"), mesh, batch=8, seq=32)
    pure = recipes.get(pure).with_logits("tokens")
    p = analytic_model(cfg.dims(), pure, pure_mesh, batch=8, seq=32)
    # Phases aside: the head's layout follows each recipe's activation rules (fsdp splits
    # the logits over the vocabulary, dp_fsdp does not); tests/report/test_phases.py.
    assert dataclasses.replace(h.memory, phases=None) == dataclasses.replace(p.memory, phases=None)
    assert h.wire_bytes_by_kind == pytest.approx(p.wire_bytes_by_kind)


def test_analytic_model_remat_and_stand_in_config():
    cfg = ModelConfig(
        "gpt",
        vocab=128,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        d_ff=256,
        max_seq=64,
        remat="full",
    )
    full = analytic_model(cfg.dims(), "dp", {"data": 2}, batch=4, seq=64, remat=cfg.remat)
    none = analytic_model(cfg.dims(), "dp", {"data": 2}, batch=4, seq=64, remat="none")
    assert full.memory.activations == pytest.approx(4 * 2 * 64 * 2 * 64 * 2 + 2 * 64 * 128 * 4)
    assert none.memory.activations > full.memory.activations
    assert none.wire_bytes_by_kind == full.wire_bytes_by_kind


def test_analytic_model_errors():
    cfg = CONFIGS["gpt-tiny"]
    with pytest.raises(ShardingError, match="Known recipes: dp, fsdp, zero1"):
        analytic_model(cfg.dims(), "pipeline", {"data": 8}, batch=8, seq=32)
    with pytest.raises(ShardingError, match="tensor"):
        analytic_model(cfg.dims(), "dp", {"data": 4, "tensor": 2}, batch=8, seq=32)
    assert analytic_model(cfg.dims(), "dp", {"data": 8, "tensor": 1}, batch=8, seq=32)


@pytest.mark.parametrize("projections", [2, 5])
def test_full_recompute_reruns_forward_tensor_collectives(projections):
    # The recomputed forward reduces the attention's output again (the MLP's output is
    # read by nothing in the backward: XLA drops its reduction), so 3 + P reductions a
    # layer instead of 2 + P. Under TP+SP the recomputed input gathers replace the 2
    # backward re-gathers: still 6 all-gathers a layer.
    kw = dict(psi=1e6, layers=2, b=4, s=8, h=16, in_projections=projections)
    plain = wire_bytes_hybrid({"tensor": 4}, **kw)["all-reduce"]
    again = wire_bytes_hybrid({"tensor": 4}, recompute=True, **kw)["all-reduce"]
    assert again == pytest.approx(plain * (3 + projections) / (2 + projections))
    sp = [
        wire_bytes_hybrid({"tensor": 4}, tensor_kind="tp_sp", recompute=r, **kw)
        for r in (False, True)
    ]
    assert sp[1]["reduce-scatter"] == pytest.approx(
        sp[0]["reduce-scatter"] * (3 + projections) / (2 + projections)
    )
    assert sp[1]["all-gather"] == pytest.approx(sp[0]["all-gather"])


def test_ring_attention_moves_the_same_bytes_by_permutes():
    kw = dict(psi=1e6, layers=2, b=4, s=64, h=16)
    gathered = wire_bytes_hybrid({"sequence": 4}, **kw)
    ring = wire_bytes_hybrid({"sequence": 4}, attention="ring", **kw)
    assert "all-gather" not in ring and "reduce-scatter" not in ring
    assert ring["collective-permute"] == pytest.approx(
        gathered["all-gather"] + gathered["reduce-scatter"]
    )


def test_an_axis_that_splits_the_batch_is_not_tensor_parallel():
    # A custom FSDP recipe that also shards 'mlp' over its batch axis is still FSDP: its
    # analytic wire bytes are FSDP's gathers and reduce-scatters, not TP's (none here).
    import dataclasses

    from shardkit.rules import Rules

    custom = dataclasses.replace(
        recipes.get("fsdp").with_logits("tokens"),
        name="fsdp_mlp",  # no vocab-split head
        rules=Rules([("vocab", "fsdp"), ("embed", "fsdp"), ("mlp", "fsdp")]),
    )
    par = custom.parallelism({"fsdp": 8})
    assert (par.fsdp, par.tensor) == (8, 1)
    m = analytic_model(CONFIGS["gpt-tiny"].dims(), custom, {"fsdp": 8}, batch=8, seq=32)
    assert set(m.wire_bytes_by_kind) == {"all-gather", "reduce-scatter"}


# ------------------------------------------------- a head in the vocabulary layout


def test_vocab_split_head_moves_hidden_states_instead_of_its_weight():
    # fsdp over 8 with the logits split over the vocabulary (on the fsdp axis, which also
    # splits the tokens): every device gathers the hidden states of all T tokens forward
    # and reduce-scatters their gradient backward, runs 3 f32 all-reduces of T
    # cross-entropy statistics, and its head weight (V × h) is neither gathered nor
    # reduced. Hand count of vocab − tokens, per kind, then the compiled program's.
    import shardkit as sk
    from shardkit import models

    cfg = dataclasses.replace(CONFIGS["llama-tiny"], vocab=4096)
    batch, seq, f = 64, 128, 8
    t, h, v = batch * seq, cfg.d_model, cfg.vocab
    hidden, weight, stats = t * h * 4 * ring(f), v * h * 4 * ring(f), 3 * 2 * t * 4 * ring(f)
    want = {"all-gather": hidden - weight, "reduce-scatter": hidden - weight, "all-reduce": stats}
    analytic, measured = {}, {}
    for layout in ("tokens", "vocab"):
        recipe = recipes.get("fsdp").with_logits(layout).with_mesh({"fsdp": f})
        analytic[layout] = analytic_model(
            cfg.dims(), recipe, {"fsdp": f}, batch=batch, seq=seq, remat="none"
        ).wire_bytes_by_kind
        r = build_report(
            sk.Plan(recipe),
            model=models.get("llama-tiny", vocab=v, remat="none"),
            batch=batch,
            seq=seq,
        )
        measured[layout] = r.wire_bytes_by_kind
    for kind, x in want.items():
        assert analytic["vocab"].get(kind, 0) - analytic["tokens"].get(kind, 0) == pytest.approx(x)
        # XLA's program moves the same difference (measured: within 0.05 MiB of 0.88 MiB)
        got = measured["vocab"].get(kind, 0) - measured["tokens"].get(kind, 0)
        assert got == pytest.approx(x, rel=0.1, abs=0.02 * 2**20)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tp_sp_head_in_the_tokens_layout_gathers_the_tables(name):
    # Under logits="tokens" (what "auto" picks past T_g > vocab) TP+SP's head computes
    # on the tokens: the vocabulary tables are gathered over tensor and their gradients
    # reduce-scattered, in place of the embedding's and the head's b·s·h all-gather and
    # reduce-scatter pairs and the cross-entropy's all-reduces. Compile only.
    import shardkit as sk
    from shardkit import models

    batch, seq, layers, t = 8, 64, 2, 4
    cfg = CONFIGS[name]
    one = ring(t) * (batch // 2) * seq * cfg.d_model * 4
    tables = cfg.dims().vocab_tables * ring(t) * cfg.vocab * cfg.d_model * 4
    want = {
        "all-gather": 6 * layers * one + tables,
        "reduce-scatter": (2 + cfg.in_projections) * layers * one + tables,
    }
    plan = sk.Plan(recipes.get("dp_tp_sp").with_logits("tokens"))
    model = models.get(name)
    r = build_report(plan, model=model, batch=batch, seq=seq)
    assert r.mesh == {"data": 2, "tensor": 4}
    assert "logits / loss collectives" not in r.analytic.wire_terms
    # The compiled program against the estimate, which counts the weights as XLA moves
    # them (Llama's token table all-reduced whole over tensor, then data, not first
    # reduce-scattered: the analytic formula's, one table's reduce-scatter more).
    estimate = sk.estimate(plan, model, batch=batch, seq=seq).wire_bytes_by_kind
    for kind, x in want.items():
        assert r.analytic.wire_bytes_by_kind[kind] == pytest.approx(x)
        assert r.wire_bytes_by_kind[kind] == pytest.approx(estimate[kind], rel=0.02)


def test_tp_sp_auto_head_switches_to_the_tokens_layout_past_the_vocabulary():
    # dp_tp_sp on data 2 × tensor 4, gpt-tiny (vocab 256): the head gathers the tokens
    # of one data replica, T_g = batch·seq/2. At batch 8, T_g = 256 ≤ 256: the vocab
    # layout (the b·s·h pairs, the cross-entropy's all-reduces); at 16, T_g = 512: the
    # tokens' layout (the table gathered instead).
    mesh, cfg = {"data": 2, "tensor": 4}, CONFIGS["gpt-tiny"]

    def wire(layout, batch):
        recipe = recipes.get("dp_tp_sp").with_logits(layout)
        return analytic_model(cfg.dims(), recipe, mesh, batch=batch, seq=64).wire_bytes_by_kind

    assert wire("auto", 8) == wire("vocab", 8) != wire("tokens", 8)
    assert wire("auto", 16) == wire("tokens", 16) != wire("vocab", 16)


# ------------------------------------------------- TP+SP against the compiled program


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("name, projections", [("gpt-tiny", 2), ("llama-tiny", 5)])
def test_tp_sp_wire_matches_the_compiled_program(name, projections, remat):
    # dp_tp_sp on data 2 × tensor 4, 2 layers: every all-gather and reduce-scatter moves
    # (t−1)/t of one tensor group's b·s·h. Per layer, all-gathers: 2 inputs forward, 2
    # output gradients backward, 2 inputs again backward (re-gathered for the weight
    # gradients; under remat the recomputed forward's gathers serve instead). Reduce-
    # scatters: 2 outputs forward, 1 recomputed under remat (the attention's: the MLP's
    # output is dead code there), 1 per column-parallel projection's input gradient (GPT
    # fuses qkv: 2; Llama's wq, wk, wv, gate, up: 5). The embedding and the head add one
    # of each. Vocabulary 4096: the lookup reduce-scatters its partial embeddings (at 256,
    # XLA gathers the 64 KiB table instead, as many bytes but weight traffic).
    import shardkit as sk
    from shardkit import models

    batch, seq, layers, t = 8, 64, 2, 4
    cfg = CONFIGS[name]
    one = ring(t) * (batch // 2) * seq * cfg.d_model * 4
    want = {
        "all-gather": (6 * layers + 2) * one,
        "reduce-scatter": ((2 + (remat == "full") + projections) * layers + 2) * one,
    }
    r = build_report(
        sk.Plan("dp_tp_sp"), model=models.get(name, vocab=4096, remat=remat), batch=batch, seq=seq
    )
    assert r.mesh == {"data": 2, "tensor": 4}
    analytic, measured = r.analytic.wire_bytes_by_kind, r.wire_bytes_by_kind
    for kind, x in want.items():
        assert analytic[kind] == pytest.approx(x)
        # compiled: the same, but for the token ids the lookup and the loss gather (int32,
        # 1.5 KiB here)
        assert measured[kind] == pytest.approx(x, rel=0.005)
    # The head's input is gathered by the loss code: a 'logits / loss collectives' term,
    # with the cross-entropy's 3 all-reduces of b·s (f32, 2·(t−1)/t each).
    head = one + 3 * 2 * ring(t) * (batch // 2) * seq * 4
    assert r.analytic.wire_terms["logits / loss collectives"] == pytest.approx(head)
    term = next(w for w in r.wire_terms if w.term == "logits / loss collectives")
    assert term.bytes == pytest.approx(head, rel=0.05)  # measured: 1.014×


@pytest.mark.parametrize(
    "name, projections, remat", [("gpt-tiny", 2, "full"), ("llama-tiny", 5, "none")]
)
def test_tp_wire_matches_the_compiled_program(name, projections, remat):
    # tp on tensor 8, 2 layers: all-reduces of b·s·h, 2·(t−1)/t of it each. Per layer 2
    # outputs forward, 1 recomputed under remat (the attention's; nothing reads the MLP's),
    # 1 per column-parallel projection's input gradient; the embedding's output and the
    # head's input gradient; the cross-entropy's 3 all-reduces of b·s (the compiled
    # program's small reductions differ from them by a few KiB, within the tolerance).
    import shardkit as sk
    from shardkit import models

    batch, seq, layers, t = 8, 64, 2, 8
    cfg = CONFIGS[name]
    one = 2 * ring(t) * batch * seq * cfg.d_model * 4
    want = ((2 + (remat == "full") + projections) * layers + 2) * one + 3 * one / cfg.d_model
    r = build_report(sk.Plan("tp"), model=models.get(name, remat=remat), batch=batch, seq=seq)
    assert r.mesh == {"tensor": t}
    assert r.analytic.wire_bytes_by_kind["all-reduce"] == pytest.approx(want)
    assert r.wire_bytes_by_kind["all-reduce"] == pytest.approx(want, rel=0.005)


def test_the_phase_model_is_only_for_shardkits_chunked_head():
    """A model of one's own that declares its dims but computes its own loss gets the
    plain analytic total, not the chunked head's phases (reference models do)."""
    dims = CONFIGS["gpt-tiny"].dims()
    plain = analytic_model(dims, "fsdp", {"fsdp": 8}, batch=8, seq=64)
    assert plain.memory.phases  # a reference model: its chunked head's phases
    own = dataclasses.replace(dims, chunked_head=False)
    bare = analytic_model(own, "fsdp", {"fsdp": 8}, batch=8, seq=64)
    assert not bare.memory.phases
    workload = Workload(batch=8, seq=64, layers=2, d_model=64, n_heads=8, vocab=256)
    assert with_phases(bare, own, "fsdp", {"fsdp": 8}, workload) is bare
