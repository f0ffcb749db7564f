"""Llama (flax.nnx) reference model: shapes, exact parameter count, axes, remat, scan."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import shardkit as sk
from shardkit import models
from shardkit.annotate import activation_rules

B, S, V = 2, 16, 256
KNOWN_AXES = {"vocab", "embed", "heads", "kv_heads", "kv", "mlp", "layers", None}


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(sk.unbox(tree)))


def _batch(seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "inputs": jax.random.randint(k1, (B, S), 0, V, jnp.int32),
        "targets": jax.random.randint(k2, (B, S), 0, V, jnp.int32),
    }


def _is_axes(x):
    return isinstance(x, tuple)


@pytest.fixture(scope="module")
def model():
    return models.get("llama-tiny")


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


def test_init_is_param_state_with_expected_shapes(model, boxed, params):
    cfg = model.config
    assert isinstance(boxed, nnx.State) and isinstance(params, nnx.State)
    wq = boxed["layers"]["attn"]["wq"]["kernel"]
    assert isinstance(wq, nnx.Param)
    assert wq.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "kv")
    shapes = jax.tree.map(lambda x: x.shape, params)
    L, d, h, k, hd, f = (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
    )
    assert k < h  # the tiny config exercises grouped-query attention
    assert shapes["embed"]["embedding"] == (V, d)
    assert shapes["head"]["kernel"] == (d, V)
    attn = shapes["layers"]["attn"]
    assert attn["wq"]["kernel"] == (L, d, h, hd)
    assert attn["wk"]["kernel"] == attn["wv"]["kernel"] == (L, d, k, hd)
    assert attn["wo"]["kernel"] == (L, h, hd, d)
    mlp = shapes["layers"]["mlp"]
    assert mlp["gate"]["kernel"] == mlp["up"]["kernel"] == (L, d, f)
    assert mlp["down"]["kernel"] == (L, f, d)
    assert shapes["layers"]["attn_norm"]["scale"] == (L, d)
    assert shapes["norm"]["scale"] == (d,)


@pytest.mark.parametrize("scan", [True, False])
def test_param_count_is_exact_tiny(scan):
    model = models.get("llama-tiny", scan=scan)
    assert _count(jax.eval_shape(model.init, jax.random.key(0))) == model.config.param_count()


@pytest.mark.parametrize("name", ["llama-small", "llama-1b", "llama-7b"])
def test_param_count_is_exact_abstract(name):
    model = models.get(name)
    abstract = jax.eval_shape(model.init, jax.random.key(0))  # nothing materialized
    assert _count(abstract) == model.config.param_count()


def test_llama_7b_size():
    assert abs(models.get("llama-7b").config.param_count() / 6.74e9 - 1) < 0.01


@pytest.mark.parametrize("scan", [True, False])
def test_logical_axes_complete(scan):
    model = models.get("llama-tiny", scan=scan)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    axes = sk.logical_axes(abstract)
    flat_axes = jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_axes)
    flat_shapes = jax.tree.leaves(
        jax.tree.map(lambda x: x.shape, sk.unbox(abstract)), is_leaf=_is_axes
    )
    assert len(flat_axes) == len(flat_shapes) > 0
    for (path, names), shape in zip(flat_axes, flat_shapes, strict=True):
        where = jax.tree_util.keystr(path)
        assert len(names) == len(shape), where
        assert len(shape) == 0 or any(n is not None for n in names), where
        assert set(names) <= KNOWN_AXES, where
        assert (names[0] == "layers") == (scan and where.startswith("['layers']")), where
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    assert axes["head"]["kernel"] == ("embed", "vocab")


def test_forward_logits(model, params):
    logits = jax.jit(model.apply)(params, _batch()["inputs"])
    assert logits.shape == (B, S, V) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_apply_accepts_boxed_state_and_full_mha(model, boxed):
    assert jax.eval_shape(model.apply, boxed, _batch()["inputs"]).shape == (B, S, V)
    mha = models.get("llama-tiny", n_kv_heads=8)  # no kv repetition
    logits = jax.eval_shape(
        lambda k: mha.apply(sk.unbox(mha.init(k)), _batch()["inputs"]), jax.random.key(0)
    )
    assert logits.shape == (B, S, V)


def test_loss_near_uniform_at_init(init_loss):
    assert init_loss.shape == () and init_loss.dtype == jnp.float32
    assert abs(float(init_loss) - math.log(V)) < 0.5


def test_remat_variants_same_loss_and_grads(params):
    batch = _batch()
    results = {}
    for remat in ("none", "full", "save_dots"):
        model = models.get("llama-tiny", remat=remat)
        results[remat] = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    ref_loss, ref_grads = results["none"]
    for remat in ("full", "save_dots"):
        loss, grads = results[remat]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads
        )


def test_scan_and_unrolled_agree(params, init_loss):
    """Unstacking the scanned state gives the unrolled model, with the same loss."""
    cfg = models.get("llama-tiny").config
    pure = nnx.to_pure_dict(params)
    stacked = pure.pop("layers")
    pure["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(cfg.n_layers)}
    unrolled = nnx.State(pure)
    plain = models.get("llama-tiny", scan=False, remat="full")
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
        [
            ("batch", "data"),
            ("heads", "tensor"),
            ("kv_heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
        ]
    )
    mesh = sk.make_mesh({"data": 2, "tensor": 4})
    shardings = jax.tree.map(
        lambda names, p: NamedSharding(mesh, rules.spec(names, shape=p.shape, mesh=mesh)),
        sk.logical_axes(boxed),
        params,
        is_leaf=_is_axes,
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
    cfg = models.get("llama-7b").config
    nonembed = cfg.param_count() - cfg.vocab * cfg.d_model  # the head counts, the lookup not
    assert cfg.flops_per_token(4096) == 6 * nonembed + 12 * 32 * 4096 * 4096


def test_invalid_configs_are_sharding_errors():
    with pytest.raises(sk.ShardingError, match="n_kv_heads"):
        models.get("llama-tiny", n_kv_heads=3)
    with pytest.raises(sk.ShardingError, match="n_heads"):
        models.get("llama-tiny", n_heads=7)
