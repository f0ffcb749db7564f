"""Latent attention (shardkit.nn.mla), deepseek-tiny under every expert layout, and MLA's
two tensor-parallel layouts against one device and against the compiled latent."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get
from shardkit.models.deepseek import latent_cache
from shardkit.nn import mla
from shardkit.nn.rope import rope_tables
from shardkit.report import analytic_mla

STEPS, BATCH, SEQ, LR, EPS = 2, 8, 16, 1e-2, 1e-5
# Capacity factor 4 = E/k (16 experts, 4 a token): every expert has a slot for every token
# of a sequence, so no token drops on any layout and every layout computes the same sums.
NO_DROP = {"capacity_factor": 4.0, "n_layers": 1}
# ep_tp's heads layout (4 experts x 2 tensor) and its latent-split twin: MLA's two layouts.
RECIPES = ["dp", "fsdp", "ep", "fsdp_ep", "ep_tp", "ep_gspmd", "ep_tp_latent"]


def recipe_of(name):
    if name.endswith("_latent"):
        return sk.recipes.get(name.removesuffix("_latent")).with_latent("split")
    return sk.recipes.get(name)


def run_steps(plan, host_state=None):
    """Losses of STEPS steps and the first step's gradients; the state is placed from
    ``host_state`` (one init, shared) when given, else made by ``plan.init``."""
    model = get("deepseek-tiny", **NO_DROP)
    tx = train.adamw(LR, eps=EPS)
    source = MarkovSource(vocab=model.config.vocab, seed=0)
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    if host_state is None:
        state = plan.init(abstract)
    else:  # no init program to compile per layout: the same values, placed
        state = jax.device_put(host_state, jax.tree.map(lambda x: x.sharding, abstract.tree))
    step = plan.jit(train.train_step(model, tx, return_grads=True), state=abstract)
    losses, first_grads = [], None
    for i in range(STEPS):
        state, metrics = step(state, plan.shard_batch(source.batch(BATCH, SEQ, i)))
        losses.append(float(metrics["loss"]))
        first_grads = metrics["grads"] if first_grads is None else first_grads
    return losses, first_grads


@pytest.fixture(scope="module")
def one_device():
    """(the host copy of the initial state, the 1-device losses and first gradients)."""
    plan = sk.Plan("dp", devices=jax.devices()[:1])
    model = get("deepseek-tiny", **NO_DROP)
    tx = train.adamw(LR, eps=EPS)
    state = jax.tree.map(np.asarray, plan.init(train.init_fn(model, tx), jax.random.key(0)))
    batch = MarkovSource(vocab=256, seed=0).batch(BATCH, SEQ, 0)
    stats = jax.jit(model.router_stats)(state.params, batch)
    assert float(stats["dropped"].sum()) == 0.0 and float(stats["load"].sum()) == BATCH * SEQ * 4
    return (state, *run_steps(plan, state))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_one_device(recipe, one_device):
    host_state, ref_losses, ref_grads = one_device
    losses, grads = run_steps(sk.Plan(recipe_of(recipe)), host_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)


def reference_mla(x, w, spec):
    """MLA written out head by head in float64 numpy, from the DeepSeek-V2 equations."""
    x = np.asarray(x, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    b, s, _ = x.shape
    half = spec.rope_dim // 2
    inv = 1.0 / 10000.0 ** (np.arange(0, spec.rope_dim, 2) / spec.rope_dim)
    ang = np.arange(s)[:, None] * inv[None]

    def rope(v):  # v [s, rope]: half-split rotation
        a, c = v[:, :half], v[:, half:]
        return np.concatenate(
            [a * np.cos(ang) - c * np.sin(ang), c * np.cos(ang) + a * np.sin(ang)], -1
        )

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + mla.NORM_EPS) * g

    out = np.zeros_like(x)
    for i in range(b):
        cq = rms(x[i] @ w["wq_a"], w["q_norm"])
        ckv = rms(x[i] @ w["wkv_a"], w["kv_norm"])
        k_rope = rope(x[i] @ w["wk_rope"])
        for h in range(spec.n_heads):
            q = cq @ w["wq_b"][:, h]
            q = np.concatenate([q[:, : spec.nope_dim], rope(q[:, spec.nope_dim :])], -1)
            k = np.concatenate([ckv @ w["wk_b"][:, h], k_rope], -1)
            v = ckv @ w["wv_b"][:, h]
            scores = q @ k.T / np.sqrt(spec.qk_dim) + np.triu(np.full((s, s), -np.inf), 1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[i] += (p / p.sum(-1, keepdims=True)) @ v @ w["wo"][h]
    return out


def test_mla_is_the_equations_and_modules_agree():
    spec = mla.MlaSpec(n_heads=3, kv_latent=10, nope_dim=4, rope_dim=4, v_dim=6, q_latent=12)
    w = mla.init_weights(jax.random.key(0), spec, d_model=16)
    w = {k: v * (4.0 if not k.endswith("norm") else 1.0) for k, v in w.items()}  # sharper
    w["kv_norm"] = w["kv_norm"] + jnp.arange(10) / 10
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))
    cos, sin = rope_tables(7, 4)
    out, latent = jax.jit(lambda x, w: mla.mla_attention(x, w, spec, cos, sin))(x, w)
    np.testing.assert_allclose(np.asarray(out), reference_mla(x, w, spec), rtol=1e-4, atol=1e-6)
    assert latent.shape == (2, 7, 10)
    linen = mla.LinenMla(spec)
    y, _ = jax.jit(lambda w, x: linen.apply({"params": w}, x, cos, sin))(w, x)
    np.testing.assert_allclose(y, out, rtol=1e-6)
    with nnx.use_eager_sharding(False):
        module = mla.NnxMla(spec, 16, rngs=nnx.Rngs(0))
    for name, value in w.items():
        getattr(module, name)[...] = value
    graphdef, state = nnx.split(module)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, cos, sin)[0])(state, x)
    np.testing.assert_allclose(y, out, rtol=1e-6)


def test_dims_count_every_parameter():
    for name in ("deepseek-tiny", "deepseek-small"):
        model = get(name)
        abstract = jax.eval_shape(lambda k, m=model: sk.unbox(m.init(k)), jax.random.key(0))
        assert model.dims.param_count == sum(x.size for x in jax.tree.leaves(abstract))
        attention = abstract["layers"]["attn"]
        assert sum(model.dims.attention_params) * model.config.n_layers == sum(
            x.size for x in jax.tree.leaves(attention)
        )


def latent_bytes(recipe):
    """Per-device bytes of deepseek-tiny's K/V latent (every layer's), compiled."""
    plan = sk.Plan(recipe)
    model = get("deepseek-tiny")
    params = plan.abstract_init(model.init, jax.random.key(0)).tree
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding((8, 16)))
    with jax.set_mesh(plan.mesh), plan.context():
        compiled = jax.jit(lambda p, t: latent_cache(model, p, t)).lower(params, tokens).compile()
    return compiled.memory_analysis().output_size_in_bytes, dict(plan.mesh.shape)


def test_latent_split_keeps_one_tth_of_the_latent():
    tp_latent = sk.recipes.get("tp").with_latent("split")
    heads, mesh = latent_bytes("tp")
    split, _ = latent_bytes(tp_latent)
    model = get("deepseek-tiny")
    # by hand: every layer's [batch, seq, d_c] latent in f32, whole on every device
    assert heads == model.config.n_layers * BATCH * SEQ * model.config.kv_latent * 4
    assert mesh == {"tensor": 8} and split * 8 == heads
    for recipe, measured in (("tp", heads), (tp_latent, split)):
        count = analytic_mla.latent_bytes(model.dims, recipe, mesh, batch=BATCH, seq=SEQ)
        assert count == measured


def test_with_latent_rules():
    tp_latent = sk.recipes.get("tp").with_latent("split")
    assert tp_latent.name == "tp_latent"
    assert tp_latent.activation_rules.spec(mla.KV_LATENT) == jax.sharding.PartitionSpec(
        None, None, "tensor"
    )
    # the up-projection keeps the latent's split; its heads then stay whole
    assert tuple(tp_latent.rules.spec(mla.MLA_AXES["wk_b"])) == ("tensor", None, None)
    assert tuple(sk.recipes.get("tp").rules.spec(mla.MLA_AXES["wk_b"])) == (None, "tensor", None)
    with pytest.raises(sk.ShardingError, match="put 'heads' on none"):
        sk.recipes.get("fsdp").with_latent("split")
    with pytest.raises(sk.ShardingError, match="'heads' or 'split'"):
        sk.recipes.get("tp").with_latent("latent")


def test_bad_input_is_a_sharding_error():
    tp_latent = sk.recipes.get("tp").with_latent("split")
    with pytest.raises(sk.ShardingError, match=r"'kv_latent'\) has size 12, which tensor=8"):
        sk.report.build_report(
            sk.Plan(tp_latent), model=get("deepseek-tiny", kv_latent=12), batch=8, seq=16
        )
    with pytest.raises(sk.ShardingError, match=r"'heads'\) has size 4, which tensor=8"):
        model = get("deepseek-tiny", n_heads=4, n_kv_heads=4)
        sk.report.build_report(sk.Plan("tp"), model=model, batch=8, seq=16)
    # the block's own check, for a model of your own calling it under a mesh and rules
    mesh = jax.sharding.AbstractMesh((4,), ("tensor",))
    spec = mla.MlaSpec(n_heads=8, kv_latent=6, nope_dim=8, rope_dim=4, v_dim=8)
    with pytest.raises(
        sk.ShardingError, match=r"(?s)K/V latent rank 6 does not divide .*multiple of 4 \(8\)"
    ):
        mla.check_layout(spec, mesh, tp_latent.rules)
    heads = dataclasses.replace(spec, n_heads=6, kv_latent=8)
    with pytest.raises(sk.ShardingError, match="6 heads do not divide over .* heads layout"):
        mla.check_layout(heads, mesh, sk.recipes.get("tp").rules)
    mla.check_layout(dataclasses.replace(spec, kv_latent=8), mesh, tp_latent.rules)  # fine
    with pytest.raises(sk.ShardingError, match="rope_dim is even"):
        get("deepseek-tiny", rope_dim=3)
    with pytest.raises(sk.ShardingError, match="n_kv_heads equals n_heads"):
        get("deepseek-tiny", n_kv_heads=4)
    dims = get("deepseek-tiny").dims
    with pytest.raises(sk.ShardingError, match="latent attention"):  # no terms for MLA
        sk.estimate("ep", dims, batch=8, seq=16, devices=8)
    for field, value, message in [
        ("rope_dim", 5, "rope_dim is even"),
        ("v_dim", 0, "per-head v_dim as a positive int"),
        ("kv_latent", 0, "without a K/V latent"),
        ("q_latent", -1, "q_latent must be an int ≥ 0"),
    ]:
        with pytest.raises(sk.ShardingError, match=message):
            dataclasses.replace(dims, **{field: value})
