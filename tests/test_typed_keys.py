"""Typed PRNG key arrays (``jax.random.key``, what ``nnx.Rngs`` holds) in a state and a
batch: planned, created, jitted, reported (bytes of their key data), checkpointed bit
for bit and placed by ``shard_batch``, scalar and batched, threefry and rbg."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import checkpoint
from shardkit.report import build_report

#: ``embed`` splits under fsdp and not under dp: a key array split over devices, restored
AXES = sk.PathAxes([("w$", ("embed", None)), ("keys$", ("embed",))])
#: key data per key: threefry 2 × uint32, rbg 4 × uint32 (``jax.random.key_data``)
KEY_BYTES = {"threefry2x32": 8, "rbg": 16}


def init(rng):
    return {
        "w": jnp.zeros((8, 16)),
        "key": rng,  # a scalar key
        "keys": jax.random.split(rng, 8),  # a batched key array
        "rbg": jax.random.key(3, impl="rbg"),
    }


def step(state, batch):
    noise = jax.vmap(lambda k: jax.random.normal(k, (16,)))(batch["keys"])
    key, sub = jax.random.split(state["key"])
    w = state["w"] + jax.random.normal(sub, (8, 16)) + noise
    return {**state, "w": w, "key": key}, w.sum()


def host_batch():
    return {"keys": jax.random.split(jax.random.key(7), 8)}


def key_data(x):
    return np.asarray(jax.random.key_data(x))


@pytest.fixture(scope="module")
def trained():
    plan = sk.Plan("dp", annotations=AXES)
    abstract = plan.abstract_init(init, jax.random.key(0))
    state = plan.init(abstract)
    batch = plan.shard_batch(host_batch())
    state, loss = plan.jit(step, state=abstract)(state, batch)
    return plan, abstract, state, batch, float(loss)


def test_keys_plan_train_and_are_placed_like_the_batch(trained):
    plan, abstract, state, batch, loss = trained
    assert [leaf.path for leaf in abstract.leaves if leaf.kind != "scalar"] == ["keys", "w"]
    assert abstract.leaf("keys").axes == ("embed",)
    assert batch["keys"].dtype == jax.random.key(0).dtype
    assert batch["keys"].sharding.spec == jax.P("data")  # split like any batch array
    np.testing.assert_array_equal(key_data(batch["keys"]), key_data(host_batch()["keys"]))
    # the same step on one device, without shardkit
    ref_state, ref_loss = jax.jit(step)(init(jax.random.key(0)), host_batch())
    np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-6)
    np.testing.assert_array_equal(key_data(state["key"]), key_data(ref_state["key"]))


def test_the_report_counts_keys_by_their_key_data(trained):
    plan, abstract, _, batch, _ = trained
    report = build_report(plan, step, abstract, host_batch())
    rows = {r.path: r for r in report.params}
    assert rows["key"].bytes_per_device == KEY_BYTES["threefry2x32"]
    assert rows["rbg"].bytes_per_device == KEY_BYTES["rbg"]
    assert rows["keys"].bytes_per_device == 8 * KEY_BYTES["threefry2x32"]  # replicated
    assert rows["keys"].dtype == "key<fry>"
    state_bytes = sum(r.bytes_per_device for r in report.params)
    batch_bytes = KEY_BYTES["threefry2x32"]  # one of 8 keys per device
    assert report.memory.arguments == state_bytes + batch_bytes
    assert abstract.bytes_per_device() == state_bytes


def test_keys_checkpoint_bit_for_bit_into_another_layout(trained):
    plan, _, state, _, _ = trained
    path = tempfile.mkdtemp()
    checkpoint.save(plan, path, state, step=1, block=True)
    other = sk.Plan("fsdp", devices=jax.devices()[:4], annotations=AXES)
    restored = checkpoint.restore(other, path, like=other.abstract_init(init, jax.random.key(0)))
    restored = restored.state
    assert restored["keys"].sharding.spec == jax.P("fsdp")
    for name in ("key", "keys", "rbg"):
        assert restored[name].dtype == state[name].dtype
        np.testing.assert_array_equal(key_data(restored[name]), key_data(state[name]))
    assert checkpoint.manifest(path, 1)["leaves"][0]["dtype"] == "key<fry>"


def test_reshard_plan_counts_keys_by_their_key_data(trained):
    from shardkit.reshard import reshard_plan

    plan, abstract, _, _, _ = trained
    other = sk.Plan("fsdp", devices=jax.devices()[:4], annotations=AXES)
    leaves = {
        r.path: r
        for r in reshard_plan(abstract, other.abstract_init(init, jax.random.key(0))).leaves
    }
    assert leaves["keys"].dtype == "key<fry>"
    assert leaves["keys"].held_per_device == 2 * KEY_BYTES["threefry2x32"]  # 8 keys over 4
    assert leaves["rbg"].held_per_device == KEY_BYTES["rbg"]
