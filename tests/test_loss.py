"""sk.chunked_cross_entropy: the same loss and gradients as all the logits at once.

The reference is independent of the chunked path: the models' full logits
(``model.apply``) scored by optax, on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit import models, train
from shardkit.loss import ChunkError, auto_chunks
from shardkit.models import get

B, S = 8, 32


def _batch(vocab, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "inputs": jax.random.randint(k1, (B, S), 0, vocab, jnp.int32),
        "targets": jax.random.randint(k2, (B, S), 0, vocab, jnp.int32),
    }


def _reference(model, params, batch):
    """Loss and gradients from the whole logits, scored by optax (one device, no plan)."""

    def loss(p):
        logits = model.apply(p, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_close(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_chunked_loss_matches_whole_logits(name):
    model = get(name, n_layers=1, loss_chunks=4)
    params = sk.unbox(jax.jit(model.init)(jax.random.key(0)))
    batch = _batch(model.config.vocab)
    got = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    _assert_close(got, _reference(model, params, batch))


# Head layouts (tests/test_train.py runs every recipe, with one chunk at these sizes): a
# gathered table with replicas over two axes, shared with the lookup (dp_fsdp); the
# sequence split, chunks strided over it (cp); the vocabulary over tensor, with replicas
# over fsdp and the saved log-partition (fsdp_tp).
@pytest.mark.parametrize(
    "name, recipe", [("gpt-tiny", "dp_fsdp"), ("gpt-tiny", "cp"), ("llama-tiny", "fsdp_tp")]
)
def test_chunked_loss_under_recipes_matches_one_device(name, recipe):
    model = get(name, n_layers=1, loss_chunks=4)
    plan = sk.Plan(recipe)
    params = plan.init(model.init, jax.random.key(0))
    batch = _batch(model.config.vocab)
    step = plan.jit(lambda p, b: (p, *jax.value_and_grad(model.loss)(p, b)), donate_state=False)
    _, loss, grads = step(params, plan.shard_batch(batch))
    reference = _reference(model, sk.unbox(jax.jit(model.init)(jax.random.key(0))), batch)
    _assert_close((loss, grads), reference)


@pytest.mark.parametrize("name, recipe", [("gpt-tiny", "dp_fsdp")])
def test_head_gradient_reduced_once_not_per_chunk(name, recipe):
    # Compile only: the wire bytes of a step do not grow with the chunk count (a head
    # weight's gradient reduced inside the loop would add one reduction per chunk).
    def wire(chunks):
        model = get(name, loss_chunks=chunks)
        report = models.report(sk.Plan(recipe), model, train.adamw(), batch=B, seq=S)
        return report.wire_bytes

    assert wire(8) == pytest.approx(wire(1), rel=1e-6)


def test_bad_chunk_counts_raise():
    h, t = jnp.ones((2, 6, 4)), jnp.zeros((2, 6), jnp.int32)
    w = jnp.zeros((4, 10))
    with pytest.raises(
        ChunkError, match=r"(?s)chunks=4 does not divide .* \(6\).*Fix: pass chunks"
    ):
        sk.chunked_cross_entropy(h, t, lambda w, x: x @ w, weight=w, chunks=4)
    with pytest.raises(sk.ShardingError, match="loss_chunks must be a positive int"):
        get("gpt-tiny", loss_chunks=0)
    # The sequence split over 8 devices (cp): chunks of 32 / 8 = 4 positions are not.
    model = get("llama-tiny", n_layers=1, loss_chunks=8)
    with pytest.raises(
        ChunkError, match=r"(?s)4 positions per chunk.*8 devices.*chunks in \[1, 2, 4\]"
    ):
        models.report(sk.Plan("cp"), model, train.adamw(), batch=B, seq=S)


def test_auto_chunks_bounds_chunk_logits():
    # The rule, from its definition: the fewest divisors of the length whose chunk's
    # logits are at most 8x the hidden states (and whose chunks the sequence's devices
    # divide).
    for length, vocab, d, quantum in [(512, 50304, 768, 1), (512, 32000, 768, 8), (64, 256, 64, 1)]:
        c = auto_chunks(length, vocab, d, quantum=quantum)
        assert length % c == 0 and (length // c) % quantum == 0
        assert vocab / c <= 8 * d
        smaller = [k for k in range(1, c) if length % k == 0 and (length // k) % quantum == 0]
        assert all(vocab / k > 8 * d for k in smaller)
