"""The per-phase analytic peaks: their terms, and against compiled programs."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit.models import CONFIGS, get
from shardkit.report import build_report
from shardkit.report.analytic import analytic_model
from shardkit.report.phases import (
    _optimizer_step_peak_bytes,
    head_grad_peak_bytes,
    head_loss_peak_bytes,
    peak_phase,
    phase_peaks,
)

MIB = 2**20


def test_head_term_counts_three_logits_buffers():
    # XLA's buffer assignment for GPT-2-small under fsdp, unchunked: three f32[4096, 6288]
    # buffers of 98.25 MiB live at once. Halving the chunk removes half of them.
    kw = dict(tokens=8 * 512, vocab=50304, d_model=768, vocab_split=8)
    one, two = head_loss_peak_bytes(chunks=1, **kw), head_loss_peak_bytes(chunks=2, **kw)
    assert (one - two) / MIB == pytest.approx(3 * 98.25 / 2)


def test_in_place_head_term_by_hand():
    # GPT-2-small's last pipeline stage, one micro-batch of 256 tokens: chunks of
    # d / 8 slices = 96 tokens at most, so 4 of 64. One chunk's f32 logits
    # 64 · 50304 · 4 = 12,877,824 B and three slice-sized buffers (3/8 of that); the
    # weight's slice (6,288 × 768) in f32 and its f32 gradient; the hidden states and
    # their f32 gradient (256 × 768 × 8).
    want = 12_877_824 * (1 + 3 / 8) + 6_288 * 768 * 8 + 256 * 768 * 8
    assert head_grad_peak_bytes(tokens=256, vocab=50304, d_model=768) == pytest.approx(want)
    # bf16 products: the weight's slice and the hidden states at 2 bytes, gradients f32
    bf16 = 12_877_824 * (1 + 3 / 8) + 6_288 * 768 * 6 + 256 * 768 * 6
    assert head_grad_peak_bytes(
        tokens=256, vocab=50304, d_model=768, bytes_per_value=2
    ) == pytest.approx(bf16)


@pytest.mark.parametrize(("vocab", "d", "tokens"), [(4096, 256, 128), (8192, 128, 512)])
def test_in_place_head_term_tracks_the_compiled_function(vocab, d, tokens):
    # Compiled alone (the hidden states computed, the running sum donated), XLA holds
    # 0.84-0.92 of the count: it fuses part of a slice's buffers into its products.
    h = jax.ShapeDtypeStruct((1, tokens, d), jnp.float32)
    t = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    w = jax.ShapeDtypeStruct((vocab, d), jnp.float32)

    def head(h, t, w, acc):
        return sk.loss.head_loss_and_grad(jnp.tanh(h), t, w, acc)

    compiled = jax.jit(head, donate_argnums=3).lower(h, t, w, w).compile()
    got = compiled.memory_analysis().temp_size_in_bytes
    count = head_grad_peak_bytes(tokens=tokens, vocab=vocab, d_model=d)
    assert 0.8 <= got / count <= 1.0


def test_optimizer_term_is_a_gradient_copy_only_for_select():
    assert _optimizer_step_peak_bytes(grads_bytes=475.0, clip="select") == 475.0
    assert _optimizer_step_peak_bytes(grads_bytes=475.0, clip="scale") == 0.0
    with pytest.raises(sk.ShardingError, match="clip"):
        _optimizer_step_peak_bytes(grads_bytes=1.0, clip="none")


def test_phase_that_sets_the_peak():
    # The phases the buffer assignments found on GPT-2-small (8 devices, 8 × 512):
    # the unchunked head under fsdp, optax's clip under dp.
    small = CONFIGS["gpt-small"]
    kw = dict(batch=8, seq=512, remat="full")
    unchunked = dataclasses.replace(small, loss_chunks=1)

    def peaks(config, recipe, mesh, **more):
        base = analytic_model(config.dims(), recipe, mesh, **kw).memory
        return phase_peaks(config.dims(), recipe, mesh, base=base, **kw, **more)

    assert peak_phase(peaks(unchunked, "fsdp", {"fsdp": 8})) == "head_loss"
    assert peak_phase(peaks(small, "dp", {"data": 8}, clip="select")) == "optimizer_step"
    assert peak_phase(peaks(small, "fsdp", {"fsdp": 8})) == "layers"


def test_analytic_total_is_the_largest_phase():
    m = analytic_model(
        CONFIGS["gpt-small"].dims(), "fsdp", {"fsdp": 8}, batch=8, seq=512, remat="full"
    )
    assert m.memory.total == max(m.memory.phases.values())
    assert m.memory.to_dict()["peak_phase"] == peak_phase(m.memory.phases)
    assert any("phase peak" in n for n in m.notes)


@pytest.mark.parametrize("chunks", [1, 8])
def test_phases_track_the_compiled_program(chunks):
    # Compile only. A head-heavy tiny GPT (vocabulary 8192) under fsdp: the measured total
    # (XLA's buffer assignment) within 10% of the largest phase, chunked or not; chunked,
    # it is less than half the unchunked step.
    model = get("gpt-tiny", vocab=8192, remat="full", loss_chunks=chunks)
    report = build_report(sk.Plan("fsdp"), model=model, batch=8, seq=64)
    ratio = report.memory.total / report.analytic.memory.total
    assert 0.9 <= ratio <= 1.1, (report.memory.to_dict(), report.analytic.memory.to_dict())
    assert peak_phase(report.analytic.memory.phases) == "head_loss"
    if chunks > 1:
        unchunked = get("gpt-tiny", vocab=8192, remat="full", loss_chunks=1)
        whole = build_report(sk.Plan("fsdp"), model=unchunked, batch=8, seq=64)
        assert report.memory.total < 0.5 * whole.memory.total
