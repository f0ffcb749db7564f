"""Context parallelism: a sequence 8x longer than one device's attention scores allow."""

import jax
import jax.numpy as jnp
import numpy as np

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get

LONG = 4096  # 8 x 512


def compiled_temp(recipe, devices, seq):
    model, tx = get("gpt-tiny", max_seq=seq, remat="full"), train.adamw()
    plan = sk.Plan(recipe, devices=devices)
    state = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    compiled = plan.compile(
        train.train_step(model, tx), state, {"inputs": tokens, "targets": tokens}
    )
    return compiled.memory_analysis().temp_size_in_bytes


def test_long_sequence_fits_where_dense_scores_do_not():
    scores = 8 * LONG * LONG * 4  # heads x seq x seq f32 scores of one layer, one device
    dense = compiled_temp("dp", jax.devices()[:1], LONG)
    ring = compiled_temp("cp", jax.devices(), LONG)
    assert dense > scores  # one device must hold the full score matrix
    assert ring < scores / 8  # no device holds more than its block's share
    assert ring < dense / 8


def test_long_sequence_trains_under_cp():
    model, tx = get("gpt-tiny", max_seq=LONG), train.adamw()
    plan = sk.Plan("cp")
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx))
    batch = plan.shard_batch(MarkovSource(vocab=model.config.vocab).batch(1, LONG, 0))
    assert batch["inputs"].sharding.spec == jax.sharding.PartitionSpec(None, "sequence")
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
