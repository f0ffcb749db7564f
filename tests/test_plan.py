import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk


@sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",)})
class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = sk.constrain(h, ("batch", "mlp"))
        return nn.Dense(8, use_bias=False, name="out")(h)


TX = optax.adam(1e-2)


def init(rng):
    params = Mlp().init(rng, jnp.ones((1, 16)))["params"]
    return params, TX.init(sk.unbox(params))


def step(state, batch):
    params, opt_state = state

    def loss_fn(p):
        return jnp.mean((Mlp().apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 8)).astype(np.float32),
    }


def test_state_is_born_sharded():
    plan = sk.Plan("fsdp")
    params, opt_state = plan.init(init, jax.random.key(0))
    kernel = params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", None)
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 32)}
    mu = opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding.spec == P("fsdp", None)
    assert {s.data.shape for s in mu.addressable_shards} == {(2, 32)}
    # every leaf has its planned sharding
    planned = plan.shardings(jax.eval_shape(init, jax.random.key(0)))
    for arr, sh in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves(planned), strict=True):
        assert arr.sharding.is_equivalent_to(sh, arr.ndim)


def test_init_compiles_without_a_full_copy():
    plan = sk.Plan("fsdp")
    abstract = jax.eval_shape(init, jax.random.key(0))
    with jax.set_mesh(plan.mesh):
        lowered = jax.jit(
            lambda r: sk.unbox(init(r)), out_shardings=plan.shardings(abstract)
        ).lower(jax.random.key(0))
    mem = lowered.compile().memory_analysis()
    full = sum(x.size * 4 for x in jax.tree.leaves(sk.unbox(abstract)))
    assert mem.output_size_in_bytes <= full / 8 + 1024


def test_init_runs_the_init_functions_python_once():
    # abstract_init's trace is the program plan.init compiles: a model's init (Flax's
    # Python; seconds for a large model) runs once, not again under jit, and the state
    # holds init_fn's own values, as one device computes them.
    calls = []

    def counted(rng):
        calls.append(rng)
        return init(rng)

    plan = sk.Plan("fsdp")
    state = plan.init(counted, jax.random.key(0))
    assert len(calls) == 1
    want = jax.jit(lambda r: sk.unbox(init(r)))(jax.random.key(0))
    for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # Without that trace (put together by hand) plan.init traces init_fn itself.
    abstract = plan.abstract_init(init, jax.random.key(0))
    untraced = dataclasses.replace(abstract, traced=None)
    for got, ref in zip(jax.tree.leaves(plan.init(untraced)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # A copy with another init function runs that function, not the kept trace.
    other = lambda rng: init(jax.random.fold_in(rng, 1))  # noqa: E731
    replaced = plan.init(dataclasses.replace(abstract, init_fn=other))
    want_other = jax.jit(lambda r: sk.unbox(other(r)))(jax.random.key(0))
    kernel = lambda s: np.asarray(s[0]["Dense_0"]["kernel"])  # noqa: E731
    np.testing.assert_array_equal(kernel(replaced), kernel(want_other))
    assert not np.array_equal(kernel(replaced), kernel(want))


def test_an_init_holding_large_constants_is_traced_again_not_kept(monkeypatch):
    # Arrays an init loads become constants of its trace; past KEPT_INIT_CONSTANT_BYTES
    # the AbstractState does not keep them alive, and plan.init traces init_fn again.
    import shardkit.plan

    table = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)

    def loading(rng):
        params, opt_state = init(rng)
        params["Dense_0"]["kernel"] = params["Dense_0"]["kernel"].replace_boxed(table)
        return params, opt_state

    plan = sk.Plan("fsdp")
    assert plan.abstract_init(loading, jax.random.key(0)).traced is not None
    monkeypatch.setattr(shardkit.plan, "KEPT_INIT_CONSTANT_BYTES", table.nbytes - 1)
    abstract = plan.abstract_init(loading, jax.random.key(0))
    assert abstract.traced is None
    params, _ = plan.init(abstract)
    np.testing.assert_array_equal(np.asarray(params["Dense_0"]["kernel"]), table)


@pytest.mark.parametrize("recipe", ["dp", "fsdp", "zero1"])
def test_step_matches_one_device(recipe):
    ref = sk.Plan("dp", devices=jax.devices()[:1])
    plan = sk.Plan(recipe)
    results = []
    for p in (ref, plan):
        state = p.init(init, jax.random.key(0))
        train = p.jit(step)
        losses = []
        for _ in range(3):
            state, loss = train(state, p.shard_batch(batch()))
            losses.append(float(loss))
        results.append((losses, state))
    (l1, s1), (l8, s8) = results
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    # Sharded reductions sum in a different order; after 3 Adam steps of size 1e-2 the
    # parameters agree to well under one step's worth of change.
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s8), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_state_keeps_its_sharding_across_steps_and_batch_is_sharded():
    plan = sk.Plan("fsdp")
    state = plan.init(init, jax.random.key(0))
    b = plan.shard_batch(batch())
    assert b["x"].sharding.spec == P("fsdp", None)
    new_state, _ = plan.jit(step)(state, b)
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
        assert new.sharding == old.sharding or old.is_deleted()


def test_abstract_init_and_compile_only():
    plan = sk.Plan("fsdp")
    abstract = plan.abstract_init(init, jax.random.key(0))
    kernel = abstract.tree[0]["Dense_0"]["kernel"]
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.sharding.spec == P("fsdp", None)
    b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch())
    compiled = plan.compile(step, abstract, b)
    assert "reduce-scatter" in compiled.as_text() or "all-reduce" in compiled.as_text()


def test_plan_from_rules_and_explicit_mesh():
    mesh = sk.make_mesh({"data": 2, "model": 4})
    plan = sk.Plan(sk.Rules([("batch", "data"), ("mlp", "model")]), mesh)
    params, _ = plan.init(init, jax.random.key(0))
    assert params["Dense_0"]["kernel"].sharding == NamedSharding(mesh, P(None, "model"))


def test_plan_rejects_rules_naming_missing_axes():
    with pytest.raises(sk.ShardingError, match="'tensor'"):
        sk.Plan(sk.Rules([("mlp", "tensor")]), sk.make_mesh({"data": 8}))


def test_unknown_recipe():
    with pytest.raises(sk.ShardingError, match="Known recipes: dp, fsdp"):
        sk.Plan("ddp")


def test_zero1_shards_only_optimizer_state():
    plan = sk.Plan("zero1")
    params, opt_state = plan.init(init, jax.random.key(0))
    assert params["Dense_0"]["kernel"].sharding.spec == P(None, None)
    assert opt_state[0].mu["Dense_0"]["kernel"].sharding.spec == P("data", None)
    assert opt_state[0].count.sharding.spec == P()


def test_plan_takes_the_path_axes_policy():
    tree = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    strict = sk.PathAxes([("w$", ("embed", "mlp"))], on_unmatched="error")
    with pytest.raises(sk.ShardingError, match=r"b \(8,\)"):
        sk.Plan("fsdp", annotations=strict).shardings(tree)
    lenient = sk.Plan("fsdp", annotations=strict, on_unmatched="replicate")
    assert lenient.shardings(tree)["b"].spec == P(None)


def test_state_from_the_host_keeps_its_planned_layout():
    plan = sk.Plan("fsdp")
    abstract = plan.abstract_init(init, jax.random.key(0))
    state = plan.init(abstract)
    host = jax.device_get(state)  # e.g. restored from a checkpoint: plain numpy arrays
    new_state, _ = plan.jit(step, state=abstract)(host, plan.shard_batch(batch()))
    kernel = new_state[0]["Dense_0"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(plan.mesh, P("fsdp", None)), 2)


def test_shardings_depend_on_the_tree_alone_not_on_history():
    # Regression: the plan used to remember the shardings of trees it had created, keyed
    # by tree structure, so the same host tree got another layout after plan.init ran.
    plan = sk.Plan("fsdp")
    host = jax.device_get(sk.Plan("fsdp").init(init, jax.random.key(0)))
    before = plan.shardings(host)
    plan.init(init, jax.random.key(0))
    assert plan.shardings(host) == before
    assert before[0]["Dense_0"]["kernel"].spec == P(None, None)  # plain arrays: no axes


def test_abstract_state_describes_every_leaf():
    plan = sk.Plan("fsdp")
    abstract = plan.abstract_init(init, jax.random.key(0))
    kinds = {leaf.path: leaf.kind for leaf in abstract.leaves}
    assert kinds["0/Dense_0/kernel"] == "param" and kinds["1/0/count"] == "scalar"
    assert kinds["1/0/mu/Dense_0/kernel"] == "optimizer"
    assert abstract.axes[1][0].nu["out"]["kernel"] == ("embed", "mlp")
    assert abstract.shardings[0]["out"]["kernel"].spec == P("fsdp", None)
    # f32 kernels 16x32 and 32x8 split 8 ways along 'embed'; the bias ('mlp',) has no
    # fsdp rule and stays whole: (16*32/8 + 32 + 32*8/8) * 4 bytes per device.
    assert abstract.bytes_per_device("param") == (16 * 32 // 8 + 32 + 32 * 8 // 8) * 4
    with pytest.raises(sk.ShardingError, match="No state leaf at 'nope'"):
        abstract.leaf("nope")
    params, _ = plan.init(abstract)
    assert params["Dense_0"]["kernel"].sharding.spec == P("fsdp", None)
    with pytest.raises(sk.ShardingError, match="knows its arguments"):
        plan.init(abstract, jax.random.key(1))


def test_jit_takes_only_an_abstract_state_and_checks_its_structure():
    plan = sk.Plan("fsdp")
    with pytest.raises(sk.ShardingError, match="takes an AbstractState"):
        plan.jit(step, state=jax.eval_shape(init, jax.random.key(0)))
    abstract = plan.abstract_init(init, jax.random.key(0))
    params, opt_state = plan.init(abstract)
    with pytest.raises(sk.ShardingError, match="another structure"):
        plan.jit(lambda s, b: (s, 0.0), state=abstract)(params, plan.shard_batch(batch()))


def test_jit_passes_jax_jit_options_through():
    plan = sk.Plan("fsdp")
    state = plan.init(init, jax.random.key(0))

    def scaled(state, batch, scale, power):
        new_state, loss = step(state, batch)
        return new_state, loss * scale**power

    b = plan.shard_batch(batch())
    jitted = plan.jit(
        scaled,
        static_argnums=(3,),
        donate_argnums=(),
        in_shardings=(NamedSharding(plan.mesh, P()),),
    )
    _, ref = plan.jit(step, donate_state=False)(state, b)
    new_state, loss = jitted(state, b, jnp.float32(2.0), 3)
    np.testing.assert_allclose(float(loss), 8 * float(ref), rtol=1e-6)
    assert not jax.tree.leaves(state)[0].is_deleted()  # donate_argnums=() kept it
    with pytest.raises(sk.ShardingError, match="1 extra non-static"):
        plan.jit(scaled, static_argnums=(3,), in_shardings=(None, None))(state, b, 2.0, 3)


def test_zero1_shards_the_moments_of_path_axes_annotations():
    # Regression: a PathAxes pattern written for the parameters also matched the Adam
    # moments ('1/0/mu/dense/kernel'), which then got the parameter rules: nothing sharded.
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="dense")(x)

    def plain_init(rng):
        params = Net().init(rng, jnp.ones((1, 16)))["params"]
        return params, TX.init(params)

    pa = sk.PathAxes([("dense/kernel$", ("embed", "mlp")), ("dense/bias$", ("mlp",))])
    abstract = sk.Plan("zero1", annotations=pa).abstract_init(plain_init, jax.random.key(0))
    assert abstract.leaf("0/dense/kernel").spec == P(None, None)
    for moment in ("mu", "nu"):
        leaf = abstract.leaf(f"1/0/{moment}/dense/kernel")
        assert leaf.kind == "optimizer" and leaf.spec == P("data", None)
        assert leaf.bytes_per_device(abstract.mesh) == 16 * 16 * 4 // 8
    assert abstract.bytes_per_device("param") == (16 * 16 + 16) * 4  # params replicated


def test_init_warns_when_a_sharding_recipe_replicates_most_bytes():
    class Bare(nn.Module):  # no annotations at all
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64)(nn.Dense(64)(x))

    def bare_init(rng):  # 2 x (64*64 + 64) f32 parameters = 33,280 bytes
        return Bare().init(rng, jnp.ones((1, 64)))["params"]

    with pytest.warns(
        sk.ShardingWarning,
        match=r"(?s)'fsdp' shards parameters, but 100% .*"
        r"33,280 of 33,280.*carry no logical axes.*Fix: annotate",
    ):
        sk.Plan("fsdp").init(bare_init, jax.random.key(0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sk.Plan("dp").init(bare_init, jax.random.key(0))  # dp means to replicate
        sk.Plan("fsdp").init(init, jax.random.key(0))  # annotated: mostly sharded


def test_bare_rules_need_a_mesh():
    with pytest.raises(sk.ShardingError, match="needs a mesh"):
        sk.Plan(sk.Rules([("mlp", "data")]))


def test_constrain_takes_a_rule_list():
    mesh = sk.make_mesh({"data": 8})
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: sk.constrain(x, ("batch",), rules=[("batch", "data")]))(jnp.ones(8))
    assert y.sharding.spec == P("data")


def test_plan_accepts_annotation_pairs():
    plan = sk.Plan("fsdp", annotations=[("w$", ("embed", "mlp"))])
    assert plan.shardings({"w": jnp.zeros((16, 8))})["w"].spec == P("fsdp", None)


def test_static_argnums_alone_and_counted_from_the_end():
    # Regression: without in_shardings, the default counted static arguments too.
    plan = sk.Plan("fsdp")
    state = plan.init(init, jax.random.key(0))
    b = plan.shard_batch(batch())

    def scaled(state, batch, scale, power):
        new_state, loss = step(state, batch)
        return new_state, loss * scale**power

    _, ref = plan.jit(step, donate_state=False)(state, b)
    for static in ((3,), -1):
        step_fn = plan.jit(scaled, static_argnums=static, donate_state=False)
        _, loss = step_fn(state, b, jnp.float32(2.0), 2)
        np.testing.assert_allclose(float(loss), 4 * float(ref), rtol=1e-6)
    with pytest.raises(sk.ShardingError, match="counts from 2"):
        plan.jit(scaled, static_argnums=(1,))(state, b, 2.0, 3)


def test_an_abstract_state_belongs_to_its_plan():
    fsdp, dp = sk.Plan("fsdp"), sk.Plan("dp")
    abstract = fsdp.abstract_init(init, jax.random.key(0))
    for use in (
        lambda: dp.init(abstract),
        lambda: dp.shardings(abstract),
        lambda: dp.jit(step, state=abstract)(fsdp.init(abstract), dp.shard_batch(batch())),
    ):
        with pytest.raises(sk.ShardingError, match=r"planned on mesh \{'fsdp': 8\}"):
            use()
    with pytest.raises(sk.ShardingError, match="only describes them"):
        fsdp.jit(step)(abstract, fsdp.shard_batch(batch()))


def test_the_replication_warning_points_at_the_callers_line():
    class Bare(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64)(x)

    def bare_init(rng):
        return Bare().init(rng, jnp.ones((1, 64)))["params"]

    plan = sk.Plan("fsdp")
    for call in (
        lambda: plan.init(bare_init, jax.random.key(0)),
        lambda: plan.abstract_init(bare_init, jax.random.key(0)),
    ):
        with pytest.warns(sk.ShardingWarning) as record:
            call()
        assert record[0].filename == __file__
