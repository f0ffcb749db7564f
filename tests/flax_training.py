"""Training steps for the Flax-annotated models of ``thirdparty_models.py`` under a plan,
and what Flax's own resolvers predict for their layout (``test_thirdparty_flax.py``,
``test_thirdparty_nnx.py``)."""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from thirdparty_models import FLAX_MODELS

import shardkit as sk
from shardkit.report import build_report

TX = optax.adam(1e-3)
B, S = 8, 16


def init_fn(model):
    init, _ = FLAX_MODELS[model]
    if model == "linen":
        return lambda rng: (params := init(rng), TX.init(sk.unbox(params)))

    def state_init(rng):
        params, rngs = init(rng)
        return params, rngs, TX.init(sk.unbox(params))

    return state_init


def step_fn(model):
    _, loss = FLAX_MODELS[model]

    def step(state, batch):
        if model == "linen":
            (params, opt), rngs = state, None
            value, grads = jax.value_and_grad(loss)(params, batch)
        else:
            params, rngs, opt = state
            (value, rngs), grads = jax.value_and_grad(loss, has_aux=True)(params, rngs, batch)
        updates, opt = TX.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        return ((params, opt) if rngs is None else (params, rngs, opt)), value

    return step


def batches(n=2):
    rng = np.random.default_rng(0)
    return [
        {k: rng.integers(0, 256, (B, S), dtype=np.int32) for k in ("inputs", "targets")}
        for _ in range(n)
    ]


def train(plan, model):
    abstract = plan.abstract_init(init_fn(model), jax.random.key(0))
    state = plan.init(abstract)
    data = [plan.shard_batch(b) for b in batches()]
    compiled = plan.jit(step_fn(model), state=abstract).lower(state, data[0]).compile()
    specs = [x.sharding.spec for x in jax.tree.leaves(state)]
    losses = []
    with jax.set_mesh(plan.mesh):
        for batch in data:
            state, loss = compiled(state, batch)
            losses.append(float(loss))
    return losses, abstract, compiled, specs, state


@functools.cache
def one_device(model):
    return train(sk.Plan("dp", devices=jax.devices()[:1]), model)[0]


#: The models' logical names. A name with no rule is replicated by shardkit and by linen's
#: resolver, but NNX's passes it through as a mesh axis: the rule list NNX is given ends
#: with ``(name, None)`` for each, as a Flax user's list would.
NAMES = ("batch", "length", "embed", "kv", "mlp", "vocab")


def flax_predicted_specs(model, rules):
    """Each parameter's PartitionSpec by Flax's resolvers, from the names Flax stored.

    Returns linen's (``nn.logical_to_mesh_axes``, which skips a rule whose mesh axis
    another dimension took) and, for NNX, ``nnx.get_partition_spec``'s under the rules
    (which does not skip: ``fsdp`` maps an embedding's ``vocab`` and ``embed`` both to
    ``fsdp``, a spec JAX rejects; ``None`` there).
    """
    with nnx.use_eager_sharding(False):
        boxed = jax.eval_shape(FLAX_MODELS[model][0], jax.random.key(0))
    tree = boxed if model == "linen" else boxed[0]
    getter = nn.get_partition_spec if model == "linen" else nnx.get_partition_spec
    names = jax.tree.leaves(getter(tree))  # the logical names, as PartitionSpecs
    linen = [nn.logical_to_mesh_axes(tuple(p), rules) for p in names]
    if model == "linen":
        return linen, linen
    with nn.logical_axis_rules([*rules, *((n, None) for n in NAMES if n not in dict(rules))]):
        specs = jax.tree.leaves(nnx.get_partition_spec(tree))
    axes = [[a for e in p for a in ((e,) if isinstance(e, str) else e or ())] for p in specs]
    return linen, [p if len(set(a)) == len(a) else None for p, a in zip(specs, axes, strict=True)]


def padded(spec, ndim):
    return (*spec, *(None,) * (ndim - len(spec)))


def check_trains_as_flax_lays_it_out(model, recipe):
    """On 8 devices: the 1-device losses, Flax's predicted layout, a report that reads."""
    plan = sk.Plan(recipe)
    losses, abstract, compiled, specs, state = train(plan, model)
    np.testing.assert_allclose(losses, one_device(model), rtol=1e-5)

    params = [leaf for leaf in abstract.leaves if leaf.kind == "param"]
    linen, own = flax_predicted_specs(model, list(plan.rules.pairs()))
    for leaf, want, flax_own in zip(params, linen, own, strict=True):
        assert padded(leaf.spec, len(leaf.shape)) == padded(want, len(leaf.shape)), leaf.path
        if flax_own is not None:
            assert padded(leaf.spec, len(leaf.shape)) == padded(flax_own, len(leaf.shape))
    live = dict(zip([leaf.path for leaf in abstract.leaves], specs, strict=True))
    for leaf in params:  # the arrays plan.init made hold that layout
        assert padded(live[leaf.path], len(leaf.shape)) == padded(leaf.spec, len(leaf.shape))
    kernels = [leaf for leaf in params if leaf.path.endswith("query/kernel")]
    assert kernels and all(k.prefix and k.axes == ("embed", "kv", None) for k in kernels)
    if recipe in ("fsdp", "fsdp_tp"):
        assert all(k.spec[0] == "fsdp" for k in kernels)
    # Adam's moments of those kernels mirror their padded names and their layout.
    moments = [
        x for x in abstract.leaves if x.kind == "optimizer" and x.path.endswith("query/kernel")
    ]
    assert len(moments) == 2 * len(kernels)
    assert all(
        m.prefix and m.axes == kernels[0].axes and m.spec == kernels[0].spec for m in moments
    )

    report = build_report(plan, compiled, abstract)
    rows = {r.path: r for r in report.params}
    assert rows[kernels[0].path].prefix and rows[kernels[0].path].to_json()["logical_prefix"]
    assert "fewer logical names than dimensions" in str(report)
    if model == "nnx":  # typed keys: counted by their key data (2 x uint32 for threefry)
        keys = [r for r in report.params if r.dtype.startswith("key<")]
        assert keys and all(r.bytes_per_device == 8 for r in keys)
        assert sum(r.bytes_per_device for r in report.params) == sum(
            s.data.nbytes
            for x in jax.tree.leaves(jax.tree.map(_data, state))
            for s in x.addressable_shards
            if s.device == jax.devices()[0]
        )


def _data(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
