"""GPT-2 (flax.linen) reference model: shapes, exact parameter count, axes, remat, scan."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardkit as sk
from shardkit import models
from shardkit.annotate import activation_rules

B, S, V = 2, 16, 256
KNOWN_AXES = {"vocab", "embed", "heads", "kv", "mlp", "layers", None}


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(sk.unbox(tree)))


def _batch(seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "inputs": jax.random.randint(k1, (B, S), 0, V, jnp.int32),
        "targets": jax.random.randint(k2, (B, S), 0, V, jnp.int32),
    }


@pytest.fixture(scope="module")
def model():
    return models.get("gpt-tiny")


@pytest.fixture(scope="module")
def boxed(model):
    return jax.jit(model.init)(jax.random.key(0))


@pytest.fixture(scope="module")
def params(boxed):
    return sk.unbox(boxed)


@pytest.fixture(scope="module")
def init_loss(model, params):
    """The loss of the fresh params on ``_batch()`` (compiled once for the module)."""
    return jax.jit(model.loss)(params, _batch())


def test_init_is_boxed_with_expected_shapes(model, boxed):
    cfg = model.config
    assert isinstance(boxed["wte"]["embedding"], nn.LogicallyPartitioned)
    shapes = jax.tree.map(lambda x: x.shape, sk.unbox(boxed))
    L, d, h, hd = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim
    assert shapes["wte"]["embedding"] == (V, d)
    assert shapes["wpe"]["embedding"] == (cfg.max_seq, d)
    attn = shapes["layers"]["attn"]
    assert attn["qkv"]["kernel"] == (L, d, 3, h, hd)
    assert attn["qkv"]["bias"] == (L, 3, h, hd)
    assert attn["out"]["kernel"] == (L, h, hd, d)
    assert shapes["layers"]["mlp"]["up"]["kernel"] == (L, d, cfg.d_ff)
    assert shapes["layers"]["mlp"]["down"]["kernel"] == (L, cfg.d_ff, d)
    assert shapes["ln_f"]["scale"] == (d,)


@pytest.mark.parametrize("scan", [True, False])
def test_param_count_is_exact_tiny(scan):
    model = models.get("gpt-tiny", scan=scan)
    assert _count(jax.eval_shape(model.init, jax.random.key(0))) == model.config.param_count()


@pytest.mark.parametrize("name", ["gpt-small", "gpt-1b", "gpt-7b"])
def test_param_count_is_exact_abstract(name):
    model = models.get(name)
    abstract = jax.eval_shape(model.init, jax.random.key(0))  # nothing materialized
    assert _count(abstract) == model.config.param_count()


def test_gpt_small_and_7b_sizes():
    assert models.get("gpt-small").config.param_count() == 124_475_904
    assert abs(models.get("gpt-7b").config.param_count() / 6.66e9 - 1) < 0.01


@pytest.mark.parametrize("scan", [True, False])
def test_logical_axes_complete(scan):
    model = models.get("gpt-tiny", scan=scan)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    axes = sk.logical_axes(abstract)
    shapes = jax.tree.map(lambda x: x.shape, sk.unbox(abstract))
    flat_axes = jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(flat_axes) == len(flat_shapes) > 0
    for (path, names), shape in zip(flat_axes, flat_shapes, strict=True):
        where = jax.tree_util.keystr(path)
        assert len(names) == len(shape), where
        assert len(shape) == 0 or any(n is not None for n in names), where
        assert set(names) <= KNOWN_AXES, where
        assert (names[0] == "layers") == (scan and where.startswith("['layers']")), where
    assert axes["wpe"]["embedding"] == (None, "embed")
    assert axes["wte"]["embedding"] == ("vocab", "embed")


def test_forward_logits(model, params):
    logits = jax.jit(model.apply)(params, _batch()["inputs"])
    assert logits.shape == (B, S, V) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_apply_accepts_boxed_params(model, boxed):
    logits = jax.eval_shape(model.apply, boxed, _batch()["inputs"])
    assert logits.shape == (B, S, V)


def test_loss_near_uniform_at_init(init_loss):
    assert init_loss.shape == () and init_loss.dtype == jnp.float32
    assert abs(float(init_loss) - math.log(V)) < 0.5


def test_remat_variants_same_loss_and_grads(params):
    batch = _batch()
    results = {}
    for remat in ("none", "full", "save_dots"):
        model = models.get("gpt-tiny", remat=remat)
        results[remat] = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    ref_loss, ref_grads = results["none"]
    for remat in ("full", "save_dots"):
        loss, grads = results[remat]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads
        )


def test_scan_and_unrolled_agree(params, init_loss):
    """Unstacking the scanned params gives the unrolled model, with the same loss."""
    cfg = models.get("gpt-tiny").config
    unrolled = {k: v for k, v in params.items() if k != "layers"}
    for i in range(cfg.n_layers):
        unrolled[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    plain = models.get("gpt-tiny", scan=False, remat="full")
    expected = jax.tree.structure(
        jax.eval_shape(lambda k: sk.unbox(plain.init(k)), jax.random.key(0))
    )
    assert jax.tree.structure(unrolled) == expected
    np.testing.assert_allclose(jax.jit(plain.loss)(unrolled, _batch()), init_loss, rtol=1e-5)


def test_three_train_steps_reduce_loss(model, params):
    opt = optax.adam(1e-2)
    batch = _batch()

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(model.loss)(p, batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    p, s, losses = params, opt.init(params), []
    for _ in range(3):
        p, s, loss = step(p, s)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_sharded_loss_matches_under_mesh(model, boxed, params, init_loss):
    """DP x TP on 8 emulated devices: init and loss trace under the mesh, loss unchanged."""
    rules = sk.Rules(
        [("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]
    )
    mesh = sk.make_mesh({"data": 2, "tensor": 4})
    shardings = jax.tree.map(
        lambda names, p: NamedSharding(mesh, rules.spec(names, shape=p.shape, mesh=mesh)),
        sk.logical_axes(boxed),
        params,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    batch = _batch()
    with jax.set_mesh(mesh), activation_rules(rules):
        # born sharded: init traced under the mesh and the activation rules
        sharded = jax.jit(lambda k: sk.unbox(model.init(k)), out_shardings=shardings)(
            jax.random.key(0)
        )
        data = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
        lowered = jax.jit(model.loss).lower(sharded, data)
        loss = lowered.compile()(sharded, data)
    assert "sharding_constraint" in lowered.as_text()
    np.testing.assert_allclose(loss, init_loss, rtol=1e-5)


def test_flops_per_token_formula():
    cfg = models.get("gpt-small").config
    nonembed = cfg.param_count() - cfg.max_seq * cfg.d_model
    assert cfg.flops_per_token(512) == 6 * nonembed + 12 * 12 * 768 * 512


def test_get_and_names():
    assert models.names() == list(models.CONFIGS)
    assert set(models.names()) == {
        f"{f}-{s}" for f in ("gpt", "llama") for s in ("tiny", "small", "1b", "7b")
    }
    model = models.get("gpt-tiny", remat="full", n_layers=4)
    assert (model.config.remat, model.config.n_layers, model.name) == ("full", 4, "gpt-tiny")
    with pytest.raises(sk.ShardingError, match="gpt-tiny"):
        models.get("gpt-huge")
    with pytest.raises(sk.ShardingError, match="n_layer"):
        models.get("gpt-tiny", n_layer=3)
    with pytest.raises(sk.ShardingError, match="remat"):
        models.get("gpt-tiny", remat="some")
    with pytest.raises(sk.ShardingError, match="n_kv_heads"):
        models.get("gpt-tiny", n_kv_heads=4)


def test_too_long_sequence_is_a_sharding_error(model, params):
    with pytest.raises(sk.ShardingError, match="max_seq"):
        model.apply(params, jnp.zeros((1, model.config.max_seq + 1), jnp.int32))
