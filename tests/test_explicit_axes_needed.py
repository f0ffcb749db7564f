"""A model that asks for shardings by mesh axis (``out_sharding=`` on its einsums, the
NNX way) needs Explicit axes: under an Auto plan ``plan.jit`` says so, naming the op;
under ``sk.Plan(..., explicit=True)`` it trains to the 1-device losses."""

import jax
import numpy as np
import optax
import pytest
from thirdparty_models import WIDTH, typed_mlp_init, typed_mlp_loss

import shardkit as sk

TX = optax.sgd(0.1)


def init(rng):
    params = typed_mlp_init(rng)
    return params, TX.init(params)


def step(state, batch):
    params, opt = state
    loss, grads = jax.value_and_grad(typed_mlp_loss)(params, batch)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def batch():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=(8, WIDTH)).astype(np.float32) for k in ("x", "y")}


def train(plan, steps=2):
    state = plan.init(init, jax.random.key(0))
    jitted, data = plan.jit(step), plan.shard_batch(batch())
    losses = []
    for _ in range(steps):
        state, loss = jitted(state, data)
        losses.append(float(loss))
    return losses


def test_under_auto_axes_plan_jit_names_the_op_and_the_fix():
    plan = sk.Plan("dp")
    with pytest.raises(sk.ShardingError) as e:
        train(plan, steps=1)
    message = str(e.value)
    assert "out_sharding=P('data', None) to einsum" in message
    assert "thirdparty_models.py" in message  # where the model calls it
    assert "Fix: sk.Plan('dp', explicit=True)" in message
    with pytest.raises(sk.ShardingError, match="to einsum"):  # compile-only too
        plan.jit(step).lower(plan.abstract_init(init, jax.random.key(0)), batch())


def test_under_explicit_axes_it_trains_to_the_one_device_losses():
    one = train(sk.Plan("dp", devices=jax.devices()[:1], explicit=True))
    np.testing.assert_allclose(train(sk.Plan("dp", explicit=True)), one, rtol=1e-5)


def test_a_step_returning_its_state_in_another_structure_is_named():
    """Found training the NNX model: a step that hands back ``nnx.Variable`` s for a state
    of plain arrays hit a raw ``ValueError`` from ``with_sharding_constraint``."""
    plan = sk.Plan("dp", explicit=True)
    state = plan.init(init, jax.random.key(0))
    wrapped = lambda state, batch: (({"params": state[0]}, state[1]), 0.0)  # noqa: E731
    with pytest.raises(sk.ShardingError, match=r"(?s)another structure.*Fix: return"):
        plan.jit(wrapped)(state, plan.shard_batch(batch()))
