"""Plan with an NNX model and nnx.Optimizer, the way NNX users write training code."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardkit as sk


@sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",)})
class Net(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def init(key):
    model = Net(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def step(state, batch):
    model, optimizer = state

    def loss_fn(m):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return (model, optimizer), loss


def data():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 8)).astype(np.float32),
    }


def test_nnx_model_and_optimizer_born_sharded_and_trained():
    plan = sk.Plan("fsdp")
    model, optimizer = plan.init(init, jax.random.key(0))
    assert model.up.kernel[...].sharding.spec == P("fsdp", None)
    mu = optimizer.opt_state[0].mu["up"]["kernel"]
    assert mu[...].sharding.spec == P("fsdp", None)
    assert {s.data.shape for s in mu[...].addressable_shards} == {(2, 32)}

    ref_plan = sk.Plan("dp", devices=jax.devices()[:1])
    losses = {}
    for name, p in {"fsdp": plan, "one": ref_plan}.items():
        state = p.init(init, jax.random.key(0))
        train = p.jit(step)
        losses[name] = []
        for _ in range(3):
            state, loss = train(state, p.shard_batch(data()))
            losses[name].append(float(loss))
    np.testing.assert_allclose(losses["fsdp"], losses["one"], rtol=1e-5)
    assert losses["fsdp"][-1] < losses["fsdp"][0]
