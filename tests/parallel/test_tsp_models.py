"""TSP on a model tensor parallelism cannot split: gpt-small's 12 heads on 8 devices."""

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit import models, train
from shardkit.data import MarkovSource
from shardkit.errors import ShardingError
from shardkit.report import build_report


def test_gpt_small_12_heads_trains_under_tsp_on_8_devices():
    # gpt-small's widths, heads and vocabulary; 2 of its 12 layers to keep the test short.
    model = models.get("gpt-small", n_layers=2, max_seq=64)
    assert model.config.n_heads == 12 and jax.device_count() == 8
    with pytest.raises(ShardingError):  # Megatron TP needs heads divisible by 8
        build_report(sk.Plan("tp"), model=model, batch=1, seq=32)
    plan = sk.Plan("tsp")
    tx = train.adamw(1e-3)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx))
    source = MarkovSource(vocab=model.config.vocab, seed=0)
    losses = []
    for _ in range(2):
        state, metrics = step(state, plan.shard_batch(source.batch(2, 32, 0)))  # one batch twice
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0]
    kernel = state.params["layers"]["mlp"]["up"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (2, 768 // 8, 3072)
