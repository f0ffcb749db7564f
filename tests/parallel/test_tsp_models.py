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
    # gpt-small's widths and heads; 2 of its 12 layers and a 1,024-token vocabulary (the
    # tables' 50,257 rows have nothing to do with the heads) to keep the test short.
    model = models.get("gpt-small", n_layers=2, max_seq=64, vocab=1024)
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


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_save_dots_keeps_each_projection_once(name):
    """Under remat="save_dots" the scan keeps each layer's matmul results once, as without
    TSP: the ring computes a projection as D partial matmuls, and saving all D of them
    (what dots_with_no_batch_dims_saveable alone does) holds D times as much."""
    model = models.get(name, remat="save_dots")
    cfg = model.config
    batch, seq = 16, 64
    plan = sk.Plan("tsp", devices=jax.devices()[:4])
    r = build_report(plan, model=model, batch=batch, seq=seq, itemise=True)
    saved = {t.term: t.bytes for t in r.memory_terms}["saved activations"]
    # Hand count per layer and local token (seq / 4 of each row): the matmul results
    # q, k and v, the MLP's input matmuls (up, and the gate under SwiGLU), and two
    # width-h values (the attention's and the MLP's output projections), f32.
    h, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    q, k = cfg.n_heads * hd, cfg.n_kv_heads * hd
    f_in = cfg.d_ff * (2 if name == "llama-tiny" else 1)
    want = cfg.n_layers * batch * (seq // 4) * (2 * h + q + 2 * k + f_in) * 4
    assert want <= saved <= want + 1024, (saved, want)  # + XLA's scalars and RoPE tables


def test_save_dots_trains_as_one_device():
    """The policy that saves the rings' results (llama-tiny: GQA, SwiGLU) changes what is
    stored, not what is computed: the first step's loss and gradients are one device's."""
    model = models.get("llama-tiny", remat="save_dots")
    tx = train.adamw(1e-3)
    batch = MarkovSource(vocab=model.config.vocab, seed=0).batch(8, 32, 0)
    got = []
    for p in (sk.Plan("tsp", devices=jax.devices()[:4]), sk.Plan("dp", devices=jax.devices()[:1])):
        state = p.init(train.init_fn(model, tx), jax.random.key(0))
        _, metrics = p.jit(train.train_step(model, tx, return_grads=True))(
            state, p.shard_batch(batch)
        )
        got.append((float(metrics["loss"]), jax.device_get(metrics["grads"])))
    (loss, grads), (ref_loss, ref_grads) = got
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6 * scale), grads, ref_grads)
