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
from shardkit.models import get
from shardkit.nn.loss import ChunkError, auto_chunks
from shardkit.report import build_report

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
        report = build_report(sk.Plan(recipe), model=model, batch=B, seq=S)
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
        build_report(sk.Plan("cp"), model=model, batch=B, seq=S)


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


# --- head_loss_and_grad: the pipeline's last stage adds the head's gradient in place ---


def _head_reference(h, t, w, vocab_axis, scale, dtype):
    """optax's cross-entropy of the whole logits, differentiated by JAX (an independent path)."""
    eq = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"

    def loss(w, h):
        logits = jnp.einsum(eq, h.astype(dtype), w.astype(dtype)).astype(jnp.float32)
        return scale * optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    return jax.value_and_grad(loss, argnums=(0, 1))(w, h)


@pytest.mark.parametrize(
    "vocab_axis, chunks, token_chunks", [(0, 8, None), (1, 3, 2), (0, 1, 1), (1, 64, 10)]
)
def test_head_loss_and_grad_matches_jax(vocab_axis, chunks, token_chunks):
    # 37 words: uneven slices for 3 and 8, one per word and more slices than words for 64;
    # 10 tokens in 5 chunks (the default: d 16 / 8 slices, 2 tokens a chunk), 2, 1 or 10.
    vocab, d = 37, 16
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    h = jax.random.normal(k1, (2, 5, d))
    w = jax.random.normal(k2, (vocab, d) if vocab_axis == 0 else (d, vocab))
    t = jax.random.randint(k3, (2, 5), 0, vocab)
    acc = jax.random.normal(k4, w.shape)
    want, (dw, dh) = _head_reference(h, t, w, vocab_axis, 0.25, jnp.float32)
    loss, d_h, new_acc = sk.loss.head_loss_and_grad(
        h, t, w, acc, vocab_axis=vocab_axis, scale=0.25, chunks=chunks, token_chunks=token_chunks
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(d_h, dh, rtol=0, atol=1e-6)
    np.testing.assert_allclose(new_acc, acc + dw, rtol=0, atol=1e-6)


def test_head_loss_and_grad_in_bf16_keeps_an_f32_sum():
    vocab, d = 64, 32
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(k1, (4, 8, d)).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (vocab, d)) / 4  # f32, as stored
    t = jax.random.randint(k3, (4, 8), 0, vocab)
    want, (dw, dh) = _head_reference(h, t, w, 0, 1.0, jnp.bfloat16)
    loss, d_h, acc = sk.loss.head_loss_and_grad(h, t, w, jnp.zeros_like(w), dtype=jnp.bfloat16)
    assert d_h.dtype == jnp.bfloat16 and acc.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-2)
    np.testing.assert_allclose(
        np.asarray(d_h, np.float32),
        np.asarray(dh, np.float32),
        rtol=0,
        atol=2e-2 * float(jnp.abs(dh).max()),
    )
    np.testing.assert_allclose(acc, dw, rtol=0, atol=2e-2 * float(jnp.abs(dw).max()))


def test_head_loss_and_grad_never_holds_the_weight_gradient_or_the_logits_whole():
    # Compiled temporaries, the running sum donated: value_and_grad + add holds a new
    # vocab × d gradient next to the sum (XLA's CPU backend writes a product into a fresh
    # buffer) and the whole logits; in place, one token chunk's f32 logits and one
    # vocabulary slice of 8 at a time are all there is.
    vocab, d, tokens = 4096, 256, 128
    grad_bytes, logits_bytes = vocab * d * 4, tokens * vocab * 4  # 4 MiB, 2 MiB
    h = jax.ShapeDtypeStruct((1, tokens, d), jnp.float32)
    t = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    w = jax.ShapeDtypeStruct((vocab, d), jnp.float32)

    def jax_path(h, t, w, acc):
        (loss, (dw, dh)) = _head_reference(h, t, w, 0, 1.0, jnp.float32)
        return loss, dh, acc + dw

    def in_place(h, t, w, acc):
        return sk.loss.head_loss_and_grad(h, t, w, acc, chunks=8)

    def temp(fn):
        compiled = jax.jit(fn, donate_argnums=3).lower(h, t, w, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(jax_path) >= grad_bytes + logits_bytes  # measured 8 MiB: + d logits twice
    # 128 tokens, d 256, 8 slices: chunks of 32 tokens (d / 8), 4 of them. One chunk's
    # f32 logits; the weight's slice and its gradient; the slice's probabilities, logits
    # gradient and that transposed (measured 1.66 MiB; 3.13 with the logits whole; the
    # bound leaves XLA 0.25 MiB).
    assert sk.loss.head_token_chunks(tokens, d, 8) == 4
    chunk_logits = logits_bytes / 4
    one_slice = 2 * grad_bytes / 8 + 3 * chunk_logits / 8
    assert temp(in_place) <= chunk_logits + one_slice + 2**18


@pytest.mark.parametrize("token_chunks", [0, 3, 2.0])
def test_head_loss_and_grad_token_chunks_must_divide_the_tokens(token_chunks):
    h, t = jnp.ones((2, 5, 4)), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ChunkError, match=r"(?s)for 10 tokens.*Fix: a divisor of 10 \(e.g. 1, 2, 5"):
        sk.loss.head_loss_and_grad(
            h, t, jnp.ones((10, 4)), jnp.ones((10, 4)), token_chunks=token_chunks
        )


def test_head_loss_and_grad_bad_shapes_raise():
    h, t = jnp.ones((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(
        sk.ShardingError, match=r"(?s)weight \(4, 10, 1\).*Fix: weight \[vocab, d\]"
    ):
        sk.loss.head_loss_and_grad(h, t, jnp.ones((4, 10, 1)), jnp.ones((4, 10, 1)))
    with pytest.raises(sk.ShardingError, match=r"(?s)acc \(10, 4\).*acc the weight's shape"):
        sk.loss.head_loss_and_grad(h, t, jnp.ones((4, 10)), jnp.ones((10, 4)), vocab_axis=1)
    with pytest.raises(ChunkError, match=r"chunks=0.*\n.*positive int"):
        sk.loss.head_loss_and_grad(
            h, t, jnp.ones((4, 10)), jnp.ones((4, 10)), vocab_axis=1, chunks=0
        )
