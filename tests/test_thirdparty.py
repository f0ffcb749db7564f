"""A user's own models, annotated by ``PathAxes`` alone, under every kind of recipe.

For a GPT-2 (linen) and a Llama (NNX) written like a model library writes them (see
``thirdparty_models.py``): losses and first-step gradients equal one device's, every
leaf (parameters and Adam moments) holds on each device the bytes the recipe's rules
say, by a hand count of those rules, and the report's state memory is what the devices
really hold.
"""

import functools
import math

import jax
import numpy as np
import optax
import pytest
from thirdparty_models import MODELS

import shardkit as sk
from shardkit.report import build_report

TX = optax.adam(1e-2, eps=1e-5)
B, S = 8, 16

#: Hand count of each recipe's parameter rules on 8 devices: for each dimension's
#: logical name, the mesh axis that splits it, the first match taking the axis (a
#: later dimension wanting the same axis keeps it whole).
PARAM_RULES = {
    "dp": {},
    "zero1": {},
    "fsdp": {"vocab": "fsdp", "embed": "fsdp"},
    "tp": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
}
#: How many ways each recipe splits the batch on 8 devices (tp keeps it whole).
BATCH_SPLIT = {"dp": 8, "zero1": 8, "fsdp": 8, "tp": 1}
#: Optimizer state: as the parameters, except ZeRO-1 shards it like FSDP over data.
OPT_RULES = {**PARAM_RULES, "zero1": {"vocab": "data", "embed": "data"}}


def expected_shard_shape(shape, axes, rules):
    used, out = set(), []
    for size, name in zip(shape, axes, strict=True):
        axis = rules.get(name)
        if axis is not None and axis not in used:
            used.add(axis)
            size //= 8
        out.append(size)
    return tuple(out)


def init_fn(model):
    init, _, _ = MODELS[model]

    def state_init(rng):
        params = init(rng)
        return params, TX.init(sk.unbox(params))

    return state_init


def step_fn(model):
    _, loss, _ = MODELS[model]

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value, grads

    return step


def batches(n=2):
    rng = np.random.default_rng(0)
    return [
        {k: rng.integers(0, 256, (B, S), dtype=np.int32) for k in ("inputs", "targets")}
        for _ in range(n)
    ]


@functools.cache
def one_device(model):
    plan = sk.Plan("dp", devices=jax.devices()[:1])
    return train(plan, model)[:2]


def train(plan, model):
    abstract = plan.abstract_init(init_fn(model), jax.random.key(0))
    state = plan.init(abstract)
    data = [plan.shard_batch(b) for b in batches()]
    compiled = plan.jit(step_fn(model), state=abstract).lower(state, data[0]).compile()
    losses, first_grads = [], None
    held = [leaf_bytes_on_device0(x) for x in jax.tree.leaves(state)]
    with jax.set_mesh(plan.mesh):
        for batch in data:
            state, loss, grads = compiled(state, batch)
            losses.append(float(loss))
            first_grads = first_grads if first_grads is not None else jax.device_get(grads)
    return losses, first_grads, abstract, compiled, held


def leaf_bytes_on_device0(x):
    device = jax.devices()[0]
    return sum(s.data.nbytes for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("recipe", ["dp", "fsdp", "zero1", "tp"])
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_path_axes_alone_shard_a_users_model(model, recipe):
    plan = sk.Plan(recipe, annotations=sk.PathAxes(MODELS[model][2], on_unmatched="error"))
    losses, grads, abstract, compiled, held = train(plan, model)

    ref_losses, ref_grads = one_device(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)

    sharded = 0
    for leaf, on_device in zip(abstract.leaves, held, strict=True):
        rules = (OPT_RULES if leaf.kind == "optimizer" else PARAM_RULES)[recipe]
        want = expected_shard_shape(leaf.shape, leaf.axes, rules)
        assert on_device == math.prod(want) * 4, (leaf.path, leaf.axes, want)
        sharded += want != leaf.shape
    assert sharded > 0 or recipe == "dp"

    report = build_report(plan, compiled, abstract)
    assert sum(r.bytes_per_device for r in report.params) == sum(held)
    batch_bytes = 2 * (B // BATCH_SPLIT[recipe]) * S * 4  # inputs and targets, int32
    assert report.memory.arguments == sum(held) + batch_bytes
    if recipe in ("fsdp", "tp"):  # dp and zero1 replicate parameters by design
        assert report.replicated_fraction < 0.05
