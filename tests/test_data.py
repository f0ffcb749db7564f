"""Tests for shardkit.data: a synthetic Markov token source with a known entropy rate."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit as sk
from shardkit.data import MarkovSource


def test_sparse_structure_is_valid():
    src = MarkovSource(vocab=64, branching=5, seed=3)
    succ, probs = src.successors, src.probs
    assert succ.shape == probs.shape == (64, 5)
    assert np.allclose(probs.sum(axis=1), 1.0)
    assert (probs > 0).all()
    for i in range(64):
        assert len(set(succ[i].tolist())) == 5, "successors must be distinct"
        assert (i + 1) % 64 in succ[i]
    assert 0 in succ[0], "state 0 has a self-loop (aperiodic)"


def test_transition_matrix_matches_sparse_form():
    src = MarkovSource(vocab=16)
    P = src.transition_matrix()
    assert P.shape == (16, 16) and P.dtype == np.float64
    assert np.allclose(P.sum(axis=1), 1.0)
    assert ((P > 0).sum(axis=1) == 4).all()
    # irreducible and aperiodic: some power of P is strictly positive
    assert (np.linalg.matrix_power(P, 64) > 0).all()


def test_transition_matrix_refuses_large_vocab():
    with pytest.raises(sk.ShardingError, match="sparse"):
        MarkovSource(vocab=50304).transition_matrix()


@pytest.mark.parametrize("vocab,branching", [(2, 2), (3, 3), (16, 4), (16, 2), (300, 7)])
def test_stationary_sums_to_one_and_is_stationary(vocab, branching):
    src = MarkovSource(vocab=vocab, branching=branching, seed=1)
    pi = src.stationary()
    assert pi.shape == (vocab,)
    assert (pi >= 0).all()
    assert pi.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(pi @ src.transition_matrix(), pi, atol=1e-12)


def test_stationary_matches_eigenvector():
    src = MarkovSource(vocab=16, seed=5)
    w, v = np.linalg.eig(src.transition_matrix().T)
    ref = np.real(v[:, np.argmin(np.abs(w - 1))])
    np.testing.assert_allclose(src.stationary(), ref / ref.sum(), atol=1e-10)


def test_entropy_rate_closed_form():
    src = MarkovSource(vocab=16, seed=2)
    P, pi = src.transition_matrix(), src.stationary()
    with np.errstate(divide="ignore", invalid="ignore"):
        ref = -np.nansum(pi[:, None] * P * np.log(P))
    assert src.entropy_rate() == pytest.approx(ref, rel=1e-12)
    assert 0 < src.entropy_rate() <= np.log(4)
    assert MarkovSource(vocab=1).entropy_rate() == 0.0


def test_empirical_conditional_entropy_matches_entropy_rate():
    src = MarkovSource(vocab=16, branching=4, seed=0)
    x = src.sample(64, 4096, step=0)
    prev, nxt = x[:, :-1].ravel(), x[:, 1:].ravel()
    counts = np.zeros((16, 16))
    np.add.at(counts, (prev, nxt), 1)
    joint = counts / counts.sum()
    marg = joint.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(joint * np.log(joint / marg))
    assert abs(h - src.entropy_rate()) < 0.05
    # transitions only go to successors, and marginals follow the stationary distribution
    assert (counts[src.transition_matrix() == 0] == 0).all()
    np.testing.assert_allclose(
        np.bincount(x.ravel(), minlength=16) / x.size, src.stationary(), atol=0.01
    )


def test_first_token_follows_stationary():
    src = MarkovSource(vocab=8, branching=3, seed=4)
    first = src.sample(200_000, 1, step=0)[:, 0]
    np.testing.assert_allclose(
        np.bincount(first, minlength=8) / first.size, src.stationary(), atol=0.005
    )


def test_sample_is_deterministic_in_seed_and_step():
    a = MarkovSource(vocab=100, seed=7)
    b = MarkovSource(vocab=100, seed=7)
    assert np.array_equal(a.sample(4, 64, step=3), b.sample(4, 64, step=3))
    assert not np.array_equal(a.sample(4, 64, step=3), a.sample(4, 64, step=4))
    c = MarkovSource(vocab=100, seed=8)
    assert not np.array_equal(a.successors, c.successors)
    assert not np.array_equal(a.sample(4, 64, step=3), c.sample(4, 64, step=3))


def test_batch_shapes_dtypes_and_shift():
    src = MarkovSource(vocab=50)
    b = src.batch(8, 16, step=2)
    assert set(b) == {"inputs", "targets"}
    for v in b.values():
        assert v.shape == (8, 16) and v.dtype == np.int32
    tokens = src.sample(8, 17, step=2)
    assert np.array_equal(b["inputs"], tokens[:, :-1])
    assert np.array_equal(b["targets"], tokens[:, 1:])


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_process_slices_union_is_the_global_batch(process_count):
    src = MarkovSource(vocab=1000, seed=11)
    full = src.batch(8, 32, step=5)
    parts = [
        src.batch(8, 32, step=5, process_index=i, process_count=process_count)
        for i in range(process_count)
    ]
    for p in parts:
        assert p["inputs"].shape == (8 // process_count, 32)
    for key in ("inputs", "targets"):
        assert np.array_equal(np.concatenate([p[key] for p in parts]), full[key])


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.integers(1, 300),
    branching=st.integers(2, 8),
    seed=st.integers(0, 2**31),
    step=st.integers(0, 10**6),
    pc=st.sampled_from([1, 2, 3, 4]),
)
def test_process_slices_union_property(vocab, branching, seed, step, pc):
    src = MarkovSource(vocab=vocab, branching=branching, seed=seed)
    full = src.batch(12, 9, step=step)
    got = np.concatenate(
        [
            src.batch(12, 9, step=step, process_index=i, process_count=pc)["inputs"]
            for i in range(pc)
        ]
    )
    assert np.array_equal(got, full["inputs"])
    assert ((0 <= got) & (got < vocab)).all()


def test_bad_arguments_raise_sharding_errors():
    src = MarkovSource(vocab=10)
    with pytest.raises(sk.ShardingError, match="divisible"):
        src.batch(6, 4, step=0, process_count=4)
    with pytest.raises(sk.ShardingError, match="process_index"):
        src.batch(8, 4, step=0, process_index=2, process_count=2)
    with pytest.raises(sk.ShardingError):
        src.sample(2, 3, step=-1)
    with pytest.raises(sk.ShardingError):
        MarkovSource(vocab=0)
    with pytest.raises(sk.ShardingError):
        MarkovSource(vocab=10, branching=1)


def test_gpt2_vocab_stays_sparse_and_is_built_once():
    # Memory, not time (timings flake on shared machines): a vocabulary of 50,304 must never
    # touch a dense V x V matrix (20 GB in float64), and a second batch must reuse the chain.
    v, k = 50304, 4
    sparse = v * k * 8  # bytes of one [vocab, k] table (successors or probabilities)
    tracemalloc.start()
    try:
        src = MarkovSource(vocab=v, branching=k)
        b = src.batch(8, 512, step=0)
        h = src.entropy_rate()
        _, first = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()
        src.batch(8, 512, step=1)
        _, second = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert b["inputs"].shape == (8, 512)
    assert b["inputs"].max() < v
    assert src.stationary().sum() == pytest.approx(1.0)
    assert 0 < h < np.log(k)
    assert first < 8 * sparse, f"building the chain peaked at {first / 2**20:.1f} MiB"
    # The chain itself (two tables plus its stationary law) is not rebuilt for step 1.
    assert second - held < 2 * sparse, f"a second batch allocated {(second - held) / 2**20:.1f} MiB"
