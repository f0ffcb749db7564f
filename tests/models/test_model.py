"""``Model`` over both reference families: parameter counts, axes, loss, remat, training, sharding.

Every check here runs on ``gpt-tiny`` (linen) and ``llama-tiny`` (NNX); what only one
family has lives in ``test_gpt.py`` / ``test_llama.py``.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import shardkit as sk
from shardkit import models
from shardkit.annotate import activation_rules

V = 256  # the tiny models' vocabulary

# The logical axes each family's parameters may use.
KNOWN_AXES = {
    "gpt-tiny": {"vocab", "embed", "heads", "kv", "mlp", "layers", None},
    "llama-tiny": {"vocab", "embed", "heads", "kv_heads", "kv", "mlp", "layers", None},
}
# The axes of the token (and position) tables and of Llama's untied head, by path.
EMBEDDING_AXES = {
    "gpt-tiny": {
        ("wpe", "embedding"): (None, "embed"),
        ("wte", "embedding"): ("vocab", "embed"),
    },
    "llama-tiny": {
        ("embed", "embedding"): ("vocab", "embed"),
        ("head", "kernel"): ("embed", "vocab"),
    },
}
# The logical axes split over "tensor" in the DP x TP check.
TENSOR_AXES = {
    "gpt-tiny": ("heads", "mlp", "vocab"),
    "llama-tiny": ("heads", "kv_heads", "mlp", "vocab"),
}


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny"])
def name(request):
    return request.param


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(sk.unbox(tree)))


def _is_axes(x):
    return isinstance(x, tuple)


@functools.cache
def _abstract(name, scan):
    """``init``'s annotated output, shapes only (shared by the count and axes checks)."""
    return jax.eval_shape(models.get(name, scan=scan).init, jax.random.key(0))


@pytest.mark.parametrize("scan", [True, False])
def test_param_count_is_exact_tiny(name, scan):
    assert _count(_abstract(name, scan)) == models.get(name, scan=scan).config.param_count()


@pytest.mark.parametrize(
    "big", [f"{family}-{size}" for family in ("gpt", "llama") for size in ("small", "1b", "7b")]
)
def test_param_count_is_exact_abstract(big):
    model = models.get(big)
    abstract = jax.eval_shape(model.init, jax.random.key(0))  # nothing materialized
    assert _count(abstract) == model.config.param_count()


@pytest.mark.parametrize("scan", [True, False])
def test_logical_axes_complete(name, scan):
    abstract = _abstract(name, scan)
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
        assert set(names) <= KNOWN_AXES[name], where
        assert (names[0] == "layers") == (scan and where.startswith("['layers']")), where
    for (module, leaf), expected in EMBEDDING_AXES[name].items():
        assert axes[module][leaf] == expected, (module, leaf)


def test_forward_logits(model, params, batch):
    logits = jax.jit(model.apply)(params, batch["inputs"])
    assert logits.shape == (*batch["inputs"].shape, V) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_apply_accepts_boxed_params(model, boxed, batch):
    logits = jax.eval_shape(model.apply, boxed, batch["inputs"])
    assert logits.shape == (*batch["inputs"].shape, V)


def test_loss_near_uniform_at_init(init_loss):
    assert init_loss.shape == () and init_loss.dtype == jnp.float32
    assert abs(float(init_loss) - math.log(V)) < 0.5


def test_remat_variants_same_loss_and_grads(name, params, batch):
    results = {}
    for remat in ("none", "full", "save_dots"):
        model = models.get(name, remat=remat)
        results[remat] = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    ref_loss, ref_grads = results["none"]
    for remat in ("full", "save_dots"):
        loss, grads = results[remat]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads
        )


def test_three_train_steps_reduce_loss(model, params, batch):
    opt = optax.adam(1e-2)

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


def test_sharded_loss_matches_under_mesh(name, model, boxed, params, init_loss, batch):
    """DP x TP on 8 emulated devices: init and loss trace under the mesh, loss unchanged."""
    rules = sk.Rules([("batch", "data"), *((axis, "tensor") for axis in TENSOR_AXES[name])])
    mesh = sk.make_mesh({"data": 2, "tensor": 4})
    shardings = jax.tree.map(
        lambda names, p: NamedSharding(mesh, rules.spec(names, shape=p.shape, mesh=mesh)),
        sk.logical_axes(boxed),
        params,
        is_leaf=_is_axes,
    )
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


def test_get_and_names():
    assert models.names() == list(models.CONFIGS)
    assert set(models.names()) == {
        f"{f}-{s}" for f in ("gpt", "llama") for s in ("tiny", "small", "1b", "7b")
    } | {"moe-tiny", "moe-small", "moe-47b", "deepseek-tiny", "deepseek-small"}
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


@pytest.fixture
def fresh_init_traces():
    """An empty cache of linen init traces, emptied again after the test."""
    from shardkit.models import model as model_module

    model_module._linen_init_program.cache_clear()
    yield
    model_module._linen_init_program.cache_clear()


def test_a_linen_init_is_traced_once_and_replayed_outside_plans(monkeypatch, fresh_init_traces):
    # Outside any plan, GPT's init (Flax runs the whole forward to make the parameters) is
    # traced once per model config and key type and replayed: the same values and boxes
    # as tracing it, Flax's Python run once for two models equal by config.
    import flax

    from shardkit.models import model as model_module

    calls = []
    traced = model_module.Model._linen_init
    monkeypatch.setattr(
        model_module.Model, "_linen_init", lambda self, rng: calls.append(1) or traced(self, rng)
    )
    key = jax.random.key(7)
    a, b = models.get("gpt-tiny", n_layers=1), models.get("gpt-tiny", n_layers=1)
    first = jax.eval_shape(a.init, key)
    replayed = jax.jit(b.init)(key)
    assert len(calls) == 1
    direct = jax.jit(functools.partial(traced, a))(key)  # Flax's own init, traced anew
    assert jax.tree.structure(replayed) == jax.tree.structure(direct)
    assert jax.tree.structure(first) == jax.tree.structure(direct)
    for x, y in zip(jax.tree.leaves(replayed), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert sk.logical_axes(replayed) == sk.logical_axes(direct)

    # Another key type and another JAX setting are other traces.
    jax.eval_shape(a.init, jax.random.PRNGKey(0))
    assert len(calls) == 2
    with jax.enable_x64(True):
        jax.eval_shape(a.init, key)
    assert len(calls) == 3
    separator = flax.config.flax_fix_rng_separator
    flax.config.update("flax_fix_rng_separator", not separator)  # other RNG streams
    try:
        jax.eval_shape(a.init, key)
    finally:
        flax.config.update("flax_fix_rng_separator", separator)
    assert len(calls) == 4

    # Under a plan's context or a mesh, the init is traced there, never replayed.
    with sk.context.using(precision="bf16"):
        jax.eval_shape(a.init, key)
    assert len(calls) == 5
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        jax.eval_shape(a.init, key)
    assert len(calls) == 6
    jax.eval_shape(a.init, key)
    assert len(calls) == 6  # and outside again, the program traced first
