"""Packing documents into rows, the per-rank attention work, and its balance (pure numpy)."""

import itertools

import numpy as np
import pytest

import shardkit as sk
from shardkit.data import MarkovSource
from shardkit.packing import (
    LogNormal,
    attention_work,
    balance_permutation,
    imbalance,
    pack_documents,
    packed_batch,
    permute_rows,
    ring_blocks,
)


def _pairs_by_brute_force(ids, pos, ranks):
    """Unmasked (query, key) pairs per rank, counted pair by pair from the mask's definition."""
    b, s = ids.shape
    out = np.zeros(ranks)
    for r, i, j in itertools.product(range(b), range(s), range(s)):
        if ids[r, i] != 0 and ids[r, i] == ids[r, j] and pos[r, j] <= pos[r, i]:
            out[i // (s // ranks)] += 1
    return out


def test_packing_keeps_documents_whole_and_in_order():
    docs = [np.arange(5), np.arange(100, 104), np.arange(200, 210)]
    b = pack_documents(docs, rows=3, seq=8)
    # 4 + 3 pairs fit row 0; the 9-pair document is longer than a row: split into 8 + 1.
    assert b["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1] * 8, [1] + [0] * 7]
    assert b["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert b["inputs"][0, :7].tolist() == [0, 1, 2, 3, 100, 101, 102]
    assert b["targets"][0, :7].tolist() == [1, 2, 3, 4, 101, 102, 103]
    assert b["inputs"][1].tolist() == list(range(200, 208))
    assert (b["inputs"][2, 0], b["targets"][2, 0], b["positions"][2, 0]) == (208, 209, 0)
    with pytest.raises(sk.ShardingError, match=r"document 2 has 10 tokens \(9 pairs\).*seq=8"):
        pack_documents(docs, rows=3, seq=8, overflow="error")


def test_packing_errors_name_the_numbers():
    with pytest.raises(sk.ShardingError, match=r"3 documents \(16 pairs\) do not fit 1 rows of 8"):
        pack_documents([np.arange(5), np.arange(4), np.arange(10)], rows=1, seq=8)
    with pytest.raises(sk.ShardingError, match=r"document 0 has shape \(1,\)"):
        pack_documents([np.arange(1)], rows=1, seq=8)


def test_packed_batch_is_deterministic_and_split_by_process():
    src = MarkovSource(vocab=64, seed=1)
    kw = dict(lengths=LogNormal(2.0, 0.5))
    full = packed_batch(src, 4, 32, 3, **kw)
    again = packed_batch(src, 4, 32, 3, **kw)
    half = packed_batch(src, 4, 32, 3, process_index=1, process_count=2, **kw)
    for k in full:
        assert (full[k] == again[k]).all() and (half[k] == full[k][2:]).all()
    real = full["segment_ids"] != 0
    assert real.mean() > 0.7  # mostly documents, little padding
    # Each target follows its input in the chain: a successor of the input state.
    succ = src.successors[full["inputs"][real]]
    assert (succ == full["targets"][real][:, None]).any(axis=1).all()


def test_attention_work_counts_the_mask():
    src = MarkovSource(vocab=16)
    b = packed_batch(src, 2, 32, 0, lengths=LogNormal(1.8, 0.7))
    ids, pos = b["segment_ids"], b["positions"]
    np.testing.assert_array_equal(attention_work(ids, pos, 4), _pairs_by_brute_force(ids, pos, 4))
    # One causal row of 8 over 2 ranks: 1 + 2 + 3 + 4 and 5 + 6 + 7 + 8.
    assert attention_work(np.ones((1, 8)), np.arange(8)[None], 2).tolist() == [10, 26]
    assert imbalance(np.array([10.0, 26.0])) == pytest.approx(26 / 18)


def test_balance_on_lognormal_documents_over_8_ranks():
    # The target: log-normal lengths, 8 context ranks; balanced <= 1.1 while the
    # contiguous split is >= 1.5.
    src = MarkovSource(vocab=256)
    b = packed_batch(src, 8, 1024, 0, lengths=LogNormal(4.0, 1.0))
    ids, pos = b["segment_ids"], b["positions"]
    perm = balance_permutation(ids, pos, 8)
    assert (np.sort(perm, axis=1) == np.arange(1024)).all()  # a permutation of each row
    moved = permute_rows(b, perm)
    before = attention_work(ids, pos, 8)
    after = attention_work(moved["segment_ids"], moved["positions"], 8)
    assert after.sum() == before.sum()
    assert imbalance(before) >= 1.5
    assert imbalance(after) <= 1.1
    # The tokens travel with their targets, segment ids and positions.
    r = 3
    pairs = set(zip(*(b[k][r].tolist() for k in ("inputs", "targets", "positions")), strict=True))
    moved_pairs = zip(
        *(moved[k][r].tolist() for k in ("inputs", "targets", "positions")), strict=True
    )
    assert set(moved_pairs) == pairs


def test_ring_blocks_counts_blocks_with_an_unmasked_pair():
    # Four documents of 4 tokens on 4 ranks: each rank holds one whole document.
    ids = np.repeat(np.arange(1, 5), 4)[None]
    pos = np.tile(np.arange(4), 4)[None]
    assert ring_blocks(ids, pos, 4).tolist() == [1, 1, 1, 1]
    # A document across ranks 1 and 2: rank 2's queries read rank 1's keys too.
    ids = np.array([[1, 1, 2, 2, 2, 2, 3, 3]])
    pos = np.array([[0, 1, 0, 1, 2, 3, 0, 1]])
    assert ring_blocks(ids, pos, 4).tolist() == [1, 1, 2, 1]


def test_bad_shapes_are_sharding_errors():
    with pytest.raises(sk.ShardingError, match=r"seq divisible by 3 ranks"):
        attention_work(np.ones((1, 8)), np.zeros((1, 8)), 3)
    with pytest.raises(sk.ShardingError, match=r"sigma"):
        LogNormal(3.0, -1.0)


def test_bad_segments_are_sharding_errors_with_the_shapes():
    import jax
    import jax.numpy as jnp

    from shardkit.models import get
    from shardkit.nn.attention import Segments, causal_attention

    q = jnp.ones((2, 8, 4, 8))
    ints = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(sk.ShardingError, match=r"segment ids \(2, 8\) float32 .* = \(2, 8\)"):
        causal_attention(q, q, q, segments=Segments(jnp.zeros((2, 8)), ints))
    with pytest.raises(sk.ShardingError, match=r"segment ids \(2, 4\) int32 .* = \(2, 8\)"):
        causal_attention(q, q, q, segments=Segments(ints[:, :4], ints))

    model = get("llama-tiny", n_layers=1)
    params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    bad = {"inputs": tokens, "targets": tokens, "segment_ids": ints[:, :7]}
    with pytest.raises(sk.ShardingError, match=r"batch\['segment_ids'\]: segment ids \(2, 7\)"):
        jax.eval_shape(model.loss, params, bad)
    with pytest.raises(sk.ShardingError, match="'positions' but no 'segment_ids'"):
        jax.eval_shape(model.loss, params, {"inputs": tokens, "targets": tokens, "positions": ints})
    long = jnp.zeros((1, 256), jnp.int32)  # llama-tiny's max_seq is 128
    row = {"inputs": long, "targets": long, "segment_ids": long + 1, "positions": long}
    with pytest.raises(sk.ShardingError, match=r"packed row of 256 tokens .* max_seq 128"):
        jax.eval_shape(model.loss, params, row)


def test_a_packed_batch_under_a_pipeline_is_refused():
    import jax

    from shardkit import train
    from shardkit.errors import NotPipelinableError
    from shardkit.models import get

    model, tx = get("gpt-tiny"), train.adamw()
    plan = sk.Plan("pp", devices=jax.devices()[:2])
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    step = train.train_step(model, tx, plan=plan, abstract=abstract)
    ids = np.ones((8, 16), np.int32)
    batch = {"inputs": ids, "targets": ids, "segment_ids": ids, "positions": ids}
    with pytest.raises(NotPipelinableError, match=r"packed batch \(segment_ids \(8, 16\)\)"):
        step(None, batch)


def test_balance_takes_the_coarsest_chunks_that_reach_the_tolerance():
    # One causal document of 64 tokens, then 64 of padding, over 2 ranks. By hand: 4
    # chunks of 32 weigh [528, 1552, 0, 0]: dealt 1552 -> rank 0, 528 -> rank 1: 1.49.
    # 8 chunks of 16 weigh [136, 392, 648, 904, 0, 0, 0, 0]: the snake deals 904, 648,
    # 392, 136 to ranks 0, 1, 1, 0 (then the padding 0, 1, 1, 0): 1040 pairs each.
    ids = np.array([[1] * 64 + [0] * 64])
    pos = np.array([list(range(64)) + [0] * 64])
    perm = balance_permutation(ids, pos, 2)
    chunks = [0, 3, 4, 7, 1, 2, 5, 6]  # rank 0's, then rank 1's, each in row order
    assert perm[0].tolist() == [c * 16 + i for c in chunks for i in range(16)]
    moved = [np.take_along_axis(x, perm, 1) for x in (ids, pos)]
    assert attention_work(*moved, 2).tolist() == [1040, 1040]
