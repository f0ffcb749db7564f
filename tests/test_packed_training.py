"""Packed rows train like the same documents one per row, under every attention strategy."""

import dataclasses

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get
from shardkit.packing import (
    LogNormal,
    attention_work,
    balance_permutation,
    pack_documents,
    packed_batch,
    permute_rows,
)

STEPS, BATCH, SEQ, LR, EPS = 2, 8, 64, 1e-2, 1e-5
MODELS = ["gpt-tiny", "llama-tiny"]
LENGTHS = LogNormal(mu=2.5, sigma=0.8)  # median 12 tokens: several documents a row


def _batches(balance_over: int | None = None):
    source = MarkovSource(vocab=256, seed=0)
    for i in range(STEPS):
        b = packed_batch(source, BATCH, SEQ, i, lengths=LENGTHS)
        if balance_over:
            b = permute_rows(b, balance_permutation(b["segment_ids"], b["positions"], balance_over))
        yield b


def run_steps(model_name, plan, batches):
    model = get(model_name)
    tx = train.adamw(LR, eps=EPS)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx, return_grads=True))
    losses, first = [], None
    for b in batches:
        state, metrics = step(state, plan.shard_batch(b))
        losses.append(float(metrics["loss"]))
        first = metrics["grads"] if first is None else first
    return losses, first


@pytest.fixture(scope="module")
def one_device():
    cache = {}

    def reference(model_name):
        if model_name not in cache:
            plan = sk.Plan("dp", devices=jax.devices()[:1])
            cache[model_name] = run_steps(model_name, plan, _batches())
        return cache[model_name]

    return reference


def _assert_same(got, want):
    (losses, grads), (ref_losses, ref_grads) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)


def _cp(attention):
    return dataclasses.replace(sk.recipes.get("cp"), attention=attention)


# (plan, context ranks to balance over or None): dense under fsdp, the ring on the
# contiguous and on the balanced split, all-gather, Ulysses (all-to-all over the heads),
# and TSP's ring over its own axis.
STRATEGIES = {
    "dense": (lambda: sk.Plan("fsdp"), None),
    "ring": (lambda: sk.Plan("cp"), None),
    "ring_balanced": (lambda: sk.Plan("cp"), 8),
    "allgather_balanced": (lambda: sk.Plan(_cp("allgather")), 8),
    "ulysses": (lambda: sk.Plan(_cp("ulysses")), None),
    # USP: all-to-alls over 'ulysses' (2) around the ring over 'sequence' (4), whose 4
    # ranks the balance is for (Ulysses attends its group's whole block)
    "usp": (lambda: sk.Plan("cp_usp"), None),
    "usp_balanced": (lambda: sk.Plan("cp_usp"), 4),
    "tsp": (lambda: sk.Plan("tsp"), None),
}


# The contiguous ring and USP once (gpt-tiny); every other strategy on both models.
ONCE = {("llama-tiny", "ring"), ("llama-tiny", "usp")}
CASES = [(m, s) for m in MODELS for s in STRATEGIES if (m, s) not in ONCE]


@pytest.mark.parametrize(("model_name", "strategy"), CASES)
def test_packed_training_matches_one_device(model_name, strategy, one_device):
    make_plan, ranks = STRATEGIES[strategy]
    _assert_same(run_steps(model_name, make_plan(), _batches(ranks)), one_device(model_name))


@pytest.mark.parametrize("model_name", MODELS)
def test_three_documents_in_a_row_equal_one_per_row(model_name):
    # Hand-built: three documents packed in one row against each alone in its row, on one
    # device. The expected loss is the unpacked run's: every real token's cross-entropy
    # (padding is masked in both), averaged over the 9 + 13 + 5 = 27 targets.
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n) for n in (10, 14, 6)]
    packed = pack_documents(docs, rows=1, seq=32)
    assert packed["segment_ids"][0].tolist() == [1] * 9 + [2] * 13 + [3] * 5 + [0] * 5
    alone = [pack_documents([d], rows=1, seq=32) for d in docs]
    unpacked = {k: np.concatenate([a[k] for a in alone]) for k in packed}
    model = get(model_name)
    params = jax.jit(lambda k: sk.unbox(model.init(k)))(jax.random.key(0))
    grad = jax.jit(jax.value_and_grad(model.loss))
    (loss, grads), (want, want_grads) = grad(params, packed), grad(params, unpacked)
    # The unpacked loss, by hand from the logits of each document alone (no mask needed).
    per_doc, apply = [], jax.jit(model.apply)
    for d in docs:
        logits = apply(params, d[None, :-1])
        logp = jax.nn.log_softmax(logits, -1)[0]
        per_doc.append(-np.take_along_axis(np.asarray(logp), d[1:, None], 1)[:, 0])
    by_hand = np.concatenate(per_doc).mean()
    np.testing.assert_allclose(float(want), by_hand, rtol=1e-5)
    np.testing.assert_allclose(float(loss), by_hand, rtol=1e-5)
    _assert_same(([float(loss)], grads), ([float(want)], want_grads))
    # Without segment ids the same row is one document: another loss.
    plain = {"inputs": packed["inputs"], "targets": packed["targets"]}
    assert abs(float(jax.jit(model.loss)(params, plain)) - by_hand) > 1e-3


def test_balanced_split_of_the_batch_used_here_is_balanced():
    b = next(_batches())
    contiguous = attention_work(b["segment_ids"], b["positions"], 8)
    balanced = next(_batches(8))
    work = attention_work(balanced["segment_ids"], balanced["positions"], 8)
    assert work.sum() == contiguous.sum()
    assert work.max() / work.mean() <= 1.1 < contiguous.max() / contiguous.mean()
