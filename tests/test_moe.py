"""The MoE layer, its reference models and expert parallelism against one device."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get
from shardkit.nn import moe
from shardkit.report import analytic_moe
from shardkit.report.hlo import collectives_of

STEPS, BATCH, SEQ, LR, EPS = 2, 8, 16, 1e-2, 1e-5
# Capacity factor 4 = E/k: every expert has a slot for every token of a sequence, so no
# token can drop on any layout and every layout must compute the same sums.
NO_DROP = {"capacity_factor": 4.0, "n_layers": 1}
RECIPES = ["dp", "fsdp", "ep", "fsdp_ep", "ep_tp", "ep_gspmd"]


def run_steps(plan, **overrides):
    model = get("moe-tiny", **overrides)
    tx = train.adamw(LR, eps=EPS)
    source = MarkovSource(vocab=model.config.vocab, seed=0)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx, return_grads=True))
    losses, first_grads = [], None
    for i in range(STEPS):
        state, metrics = step(state, plan.shard_batch(source.batch(BATCH, SEQ, i)))
        losses.append(float(metrics["loss"]))
        first_grads = metrics["grads"] if first_grads is None else first_grads
    return losses, first_grads


@pytest.fixture(scope="module")
def one_device():
    plan = sk.Plan("dp", devices=jax.devices()[:1])
    model = get("moe-tiny", **NO_DROP)
    params = sk.unbox(model.init(jax.random.key(0)))
    batch = MarkovSource(vocab=256, seed=0).batch(BATCH, SEQ, 0)
    stats = jax.jit(model.router_stats)(params, batch)
    assert float(stats["dropped"].sum()) == 0.0 and float(stats["load"].sum()) > 0
    return run_steps(plan, **NO_DROP)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_one_device(recipe, one_device):
    ref_losses, ref_grads = one_device
    losses, grads = run_steps(sk.Plan(recipe), **NO_DROP)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)


def test_choice_major_capacity_by_hand():
    # 3 tokens, 2 experts, both chosen by every token, 2 slots each (cf = 2/3). First
    # choices: e0 <- t0, t2; e1 <- t1. Second choices: e1 <- t0 (slot 1); t1 -> e0 and
    # t2 -> e1 find their expert full and drop.
    spec = moe.MoeSpec(n_experts=2, top_k=2, d_ff=4, capacity_factor=2 / 3)
    logits = jnp.array([[[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]]])
    r = moe.route(logits, spec, moe.capacity(spec, 3))
    assert moe.capacity(spec, 3) == 2
    assert r.load.tolist() == [3.0, 3.0] and r.dropped.tolist() == [1.0, 1.0]
    p0 = float(jax.nn.softmax(logits[0, 0])[0])
    expected = np.zeros((1, 3, 2, 2))
    expected[0, 0, 0, 0], expected[0, 0, 1, 1] = p0, 1 - p0  # t0: e0 slot 0, e1 slot 1
    expected[0, 2, 0, 1] = float(jax.nn.softmax(logits[0, 2])[0])  # t2: e0 slot 1 only
    expected[0, 1, 1, 0] = p0  # t1: e1 slot 0 (its first choice, weight p(e1) = p0)
    np.testing.assert_allclose(np.asarray(r.combine), expected, rtol=1e-6)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_auxiliary_losses_by_formula(router):
    spec = moe.MoeSpec(n_experts=4, top_k=2, d_ff=4, router=router, aux_weight=0.5, z_weight=0.25)
    logits = np.asarray(jax.random.normal(jax.random.key(3), (2, 6, 4)), np.float64)
    r = moe.route(jnp.asarray(logits, jnp.float32), spec, moe.capacity(spec, 6))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    if router == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    top2 = np.argsort(-probs, -1)[..., :2]
    counts = np.stack([(top2 == e).sum((0, 1, 2)) for e in range(4)])
    share = (probs / probs.sum(-1, keepdims=True)).mean((0, 1))
    balance = 4 * np.sum(counts / (12 * 2) * share)
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(r.balance), balance, rtol=1e-5)
    np.testing.assert_allclose(float(r.z), z, rtol=1e-5)
    np.testing.assert_allclose(float(r.aux), 0.5 * balance + 0.25 * z, rtol=1e-5)


def test_one_expert_is_a_swiglu_mlp_and_modules_agree():
    # E = k = 1, dropless: the layer is the expert's SwiGLU plus the shared one.
    spec = moe.MoeSpec(n_experts=1, top_k=1, d_ff=8, n_shared=1, capacity_factor=None)
    w = moe.init_weights(jax.random.key(0), spec, d_model=6)
    x = jax.random.normal(jax.random.key(1), (2, 5, 6))

    def swiglu(x, g, u, d):
        return (jax.nn.silu(x @ g) * (x @ u)) @ d

    expected = swiglu(x, w["gate"][0], w["up"][0], w["down"][0])
    expected += swiglu(x, w["shared_gate"], w["shared_up"], w["shared_down"])
    y, stats = moe.moe_mlp(x, w, spec)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert float(stats["dropped"].sum()) == 0.0
    linen = moe.LinenMoe(spec)
    np.testing.assert_allclose(linen.apply({"params": w}, x)[0], y, rtol=1e-6)
    with nnx.use_eager_sharding(False):
        module = moe.NnxMoe(spec, 6, rngs=nnx.Rngs(0))
    for name, value in w.items():
        getattr(module, name)[...] = value
    np.testing.assert_allclose(module(x)[0], y, rtol=1e-6)
    assert sk.logical_axes(linen.init(jax.random.key(0), x)["params"])["down"] == (
        "expert",
        "mlp",
        "embed",
    )
    assert isinstance(linen, nn.Module)


def test_dropless_keeps_a_skewed_batch_and_a_capacity_drops_it():
    spec = moe.MoeSpec(n_experts=4, top_k=1, d_ff=4, capacity_factor=None)
    logits = jnp.tile(jnp.array([5.0, 0.0, 0.0, 0.0]), (1, 8, 1))  # every token to e0
    assert moe.route(logits, spec, moe.capacity(spec, 8)).dropped.tolist() == [0, 0, 0, 0]
    capped = dataclasses.replace(spec, capacity_factor=1.0)  # 2 slots
    assert moe.route(logits, capped, moe.capacity(capped, 8)).dropped.tolist() == [6, 0, 0, 0]


def test_dims_count_every_parameter():
    for name in ("moe-tiny", "moe-small", "moe-47b"):
        model = get(name)
        abstract = jax.eval_shape(lambda k, m=model: sk.unbox(m.init(k)), jax.random.key(0))
        assert model.dims.param_count == sum(x.size for x in jax.tree.leaves(abstract))
    assert get("moe-47b").dims.param_count == 46_702_792_704  # Mixtral-8x7B


@pytest.mark.parametrize("remat", ["none", "save_dots"])
def test_ep_all_to_all_bytes_are_the_formula(remat):
    model = get("moe-tiny", remat=remat)
    tx = train.adamw()
    plan = sk.Plan("ep")
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    batch = plan.shard_batch(MarkovSource(vocab=256, seed=0).batch(BATCH, SEQ, 0))
    compiled = plan.jit(train.train_step(model, tx), state=abstract).lower(abstract, batch)
    moved = sum(c.wire_bytes for c in collectives_of(compiled.compile()) if c.kind == "all-to-all")
    # by hand: 2 layers · 4 all-to-alls · 7/8 · [8 experts, 1 sequence, 5 slots, 64] f32;
    # save_dots keeps no dispatch einsum (they have batch dimensions): 6, as full remat
    passes = 4 if remat == "none" else 6
    assert moved == 2 * passes * 7 / 8 * 8 * 1 * 5 * 64 * 4
    kw = dict(batch=8, seq=16, remat=remat)
    assert analytic_moe.dispatch_bytes(model.dims, "ep", {"expert": 8}, **kw) == moved


def test_bad_input_is_a_sharding_error():
    with pytest.raises(sk.ShardingError, match="top_k 9 > n_experts 8"):
        get("moe-tiny", top_k=9)
    with pytest.raises(sk.ShardingError, match="capacity factor must be > 0"):
        get("moe-tiny", capacity_factor=0.0)
    dims = get("moe-tiny").dims
    for field, value, message in [
        ("top_k", 9, "each token reads 1 to n_experts"),
        ("top_k", 0, "each token reads 1 to n_experts"),
        ("expert_d_ff", None, "experts' hidden width"),
        ("capacity_factor", -1.0, "capacity factor is > 0"),
        ("n_experts", -8, "n_experts must be an int"),
        ("n_shared_experts", True, "n_shared_experts must be an int"),
    ]:
        with pytest.raises(sk.ShardingError, match=message):
            dataclasses.replace(dims, **{field: value})
    model = get("moe-tiny", n_experts=6, n_layers=1)
    tokens = jnp.zeros((8, 16), jnp.int32)
    with pytest.raises(
        sk.ShardingError, match=r"'expert'\) has size 6, which expert=8 does not divide"
    ):
        sk.report.build_report(sk.Plan("ep"), model=model, batch=8, seq=16)
    # The tokens not split over the expert axis: the all-to-all cannot use that batch.
    ep = sk.recipes.get("ep")
    unsplit = dataclasses.replace(ep, name="ep_unsplit", activation_rules=sk.Rules([]))
    plan = sk.Plan(unsplit)
    params = jax.eval_shape(lambda k: sk.unbox(get("moe-tiny").init(k)), jax.random.key(0))
    with (
        pytest.raises(sk.ShardingError, match="batch must be split over 'expert'"),
        jax.set_mesh(plan.mesh),
        plan.context(),
    ):
        jax.eval_shape(get("moe-tiny").loss, params, {"inputs": tokens, "targets": tokens})


def test_run_reports_dropped_tokens_and_warns_with_the_load():
    from shardkit.run import DroppedTokensWarning, run

    # 1 slot per expert and sequence of 16 (cf 0.25): 16·2 choices, at most 8 kept a row.
    model = get("moe-tiny", n_layers=1, capacity_factor=0.25)
    with pytest.warns(DroppedTokensWarning, match="tokens sent to each expert"):
        result = run(model, "ep", steps=1, batch=8, seq=16)
    load, dropped = np.asarray(result.router["load"]), np.asarray(result.router["dropped"])
    assert load.shape == dropped.shape == (1, 8) and load.sum() == 8 * 16 * 2
    assert dropped.sum() >= 8 * (16 * 2 - 8)  # each row keeps at most 8 of its 32 choices
    assert result.dropped_fraction == pytest.approx(dropped.sum() / load.sum())


def test_padding_of_packed_rows_takes_no_slot_and_counts_nowhere():
    # Tokens 1 and 4 of 6 are padding (segment id 0): routing the row with them marked
    # must be routing the 4 real tokens alone (same slots per expert), padding all zero.
    spec = moe.MoeSpec(n_experts=4, top_k=2, d_ff=4, capacity_factor=1.0)
    logits = jax.random.normal(jax.random.key(5), (1, 6, 4))
    valid = jnp.array([[1, 0, 1, 1, 0, 1]], bool)
    real = [0, 2, 3, 5]
    slots = moe.capacity(spec, 6)
    got = moe.route(logits, spec, slots, valid)
    alone = moe.route(logits[:, real], spec, slots)
    for field in ("load", "dropped", "balance", "z"):
        np.testing.assert_allclose(getattr(got, field), getattr(alone, field), rtol=1e-6)
    np.testing.assert_allclose(got.combine[:, real], alone.combine, rtol=1e-6)
    assert not np.asarray(got.combine[:, [1, 4]]).any()
    assert float(got.load.sum()) == 2 * 4  # k choices of each real token


@pytest.mark.parametrize("name", ["moe-tiny", "deepseek-tiny"])
def test_router_stats_of_a_packed_batch_count_its_documents_tokens_only(name):
    model = get(name, n_layers=1)
    k = model.config.top_k
    params = sk.unbox(model.init(jax.random.key(0)))
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % 256
    ids = jnp.array([[1] * 10 + [0] * 6, [1] * 5 + [2] * 7 + [0] * 4], jnp.int32)
    positions = jnp.where(ids > 0, jnp.arange(16) - jnp.where(ids == 2, 5, 0), 0)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": ids, "positions": positions}
    stats = model.router_stats(params, batch)
    # 22 real tokens × top-k; the 10 padding tokens route nowhere
    assert float(stats["load"].sum()) == k * 22
    plain = model.router_stats(params, {"inputs": tokens, "targets": tokens})
    assert float(plain["load"].sum()) == k * 32


def test_experts_replicated_over_a_data_axis_have_their_gradients_all_reduced_over_it():
    from shardkit.autoplanner.candidates import with_data_axis

    recipe = with_data_axis(sk.recipes.get("ep")).with_mesh({"data": 2, "expert": 4})
    r = sk.report.build_report(sk.Plan(recipe), model=get("moe-tiny"), batch=8, seq=32)
    (term,) = [t for t in r.wire_terms if t.term == "gradient reductions"]
    # measured 828,633 B; without the experts' all-reduce over `data` (2 · 1/2 · 2 layers ·
    # 98,304 expert parameters / 4 · 4 B = 196,608 B) the analytic term was 0.70 of it
    assert term.analytic_bytes == pytest.approx(term.bytes, rel=0.10)
