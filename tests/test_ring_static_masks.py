"""The ring's compiled FLOPs fall with its masked blocks where the layout is static.

Rows placed in the zigzag order, one causal document each (``Plan.shard_batch``'s
placement, marked ``batch["zigzag"]``), have masks known at compile time: of its own
block a device computes the 3 unmasked (query chunk, key chunk) pairs and of every other
rank's block the 2 unmasked ones, 3 + 2·(n − 1) pairs against the 4·n of a ring that
computes every block. Rows without the mark (packed, or in any order) skip fully masked
pairs at run time only (``lax.cond``), so their compiled FLOPs count every pair.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import context, models, train
from shardkit.annotate import activation_rules
from shardkit.balance import zigzag_marker, zigzag_order, zigzag_ranks
from shardkit.nn.attention import Segments, causal_attention, use_attention
from shardkit.report.flops import compiled_flops

N, ROWS, HEADS, HEAD_DIM = 8, 1, 2, 128
SEQ = 16 * N  # 128 tokens


def _pair(n: int, heads: int) -> int:
    """Dot FLOPs of one (query chunk, key chunk) pair of a ring over ``n`` ranks (chunks
    of SEQ/(2n) tokens) for ``heads`` heads per device: scores and probabilities × V."""
    c = SEQ // (2 * n)
    return 2 * (2 * c * c * HEAD_DIM) * heads * ROWS


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(x, (ROWS, SEQ, HEADS, HEAD_DIM)) for x in keys]


#: (mesh, the length's axes, attention's axis, the ring's ranks n) per strategy: USP's
#: ring is 4 ranks of 'sequence', Ulysses over 'ulysses' = 2 of the 2 heads.
MESHES = {
    "ring": ({"sequence": 8}, "sequence", "sequence", 8),
    "usp": ({"sequence": 4, "ulysses": 2}, ("sequence", "ulysses"), ("ulysses", "sequence"), 4),
}


@functools.cache
def _ring(order: tuple[int, ...], ranks: int, strategy: str = "ring"):
    """The forward's compiled FLOPs (loop-weighted), output and HLO text, the rows in
    ``order``, under ``zigzag_ranks=ranks``."""
    sizes, length, axis, _ = MESHES[strategy]
    mesh = sk.make_mesh(sizes, devices=jax.devices()[:N])
    sharded = NamedSharding(mesh, P(None, length))
    order = np.asarray(order)
    q, k, v = (jax.device_put(x[:, order], sharded) for x in _qkv())
    pos = np.broadcast_to(order.astype(np.int32), (ROWS, SEQ))
    seg = Segments(*(jax.device_put(x, sharded) for x in (np.ones_like(pos), pos)))
    rules = sk.Rules([("length", length)])
    with jax.set_mesh(mesh), activation_rules(rules), use_attention(strategy, axis=axis):
        with context.using(zigzag_ranks=ranks):
            attend = jax.jit(lambda q, k, v, s: causal_attention(q, k, v, segments=s))
            compiled = attend.lower(q, k, v, seg).compile()
    out = np.asarray(compiled(q, k, v, seg))[:, np.argsort(order)]  # back in token order
    return compiled_flops(compiled).flops, out, compiled.as_text()


@pytest.mark.parametrize("strategy", list(MESHES))
def test_zigzag_rows_compile_only_the_unmasked_half_blocks(strategy):
    n = MESHES[strategy][3]
    zigzag = tuple(zigzag_order(SEQ, n).tolist())
    static, out, hlo = _ring(zigzag, n, strategy)
    runtime, out_runtime, _ = _ring(zigzag, 0, strategy)
    want = causal_attention(*_qkv())  # one device, no mesh: dense
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_runtime, want, rtol=1e-5, atol=1e-6)
    # Hand count: 3 + 2(n − 1) chunk pairs against 4n (ring: 17/32 = 0.531; USP's ring
    # of 4: 9/16 = 0.5625, Ulysses's all-to-alls compute nothing); the softmax's
    # elementwise work scales with the pairs too, so the ratio holds within 5 %.
    hand = (3 + 2 * (n - 1)) / (4 * n)
    assert static / runtime == pytest.approx(hand, rel=0.05), (static, runtime)
    # The dot FLOPs of the pairs computed bound each count from below; the rest is the
    # softmax's elementwise work (measured 7 % and 8 % for the ring over 8).
    pair = _pair(n, HEADS // (N // n))  # USP: the heads split over Ulysses's N/n
    assert (3 + 2 * (n - 1)) * pair <= static <= 1.15 * (3 + 2 * (n - 1)) * pair
    assert 4 * n * pair <= runtime <= 1.15 * 4 * n * pair
    # the batch's order is the ring's: no reorder, and no segment ids or positions travel
    assert hlo.count("collective-permute(") == 1
    assert ("all-gather(" in hlo) is False


def test_contiguous_rows_can_only_skip_at_run_time():
    """The same one-document rows in token order: a rank's mask depends on its place
    in the row, known only at run time, so the compiled FLOPs are the full ring's."""
    contiguous, out, _ = _ring(tuple(range(SEQ)), 0)
    runtime, _, _ = _ring(tuple(zigzag_order(SEQ, N).tolist()), 0)
    np.testing.assert_allclose(out, causal_attention(*_qkv()), rtol=1e-5, atol=1e-6)
    assert contiguous == runtime


def test_a_zigzag_mark_for_other_ranks_is_an_error():
    with pytest.raises(sk.ShardingError, match="over 4 ranks.*'sequence' of size 8"):
        _ring(tuple(zigzag_order(SEQ, N).tolist()), 4)
    with pytest.raises(sk.ShardingError, match=r"(?s)shape \(0, 8\).*zigzag_marker"):
        zigzag_ranks({"zigzag": np.zeros((0, 8), np.int32)})
    with pytest.raises(sk.ShardingError, match="zigzag_ranks=-1"):
        context.ShardingContext(zigzag_ranks=-1)
    assert zigzag_ranks({"zigzag": zigzag_marker(8)}) == 8


def test_gpt_tiny_cp_loss_drops_the_masked_blocks_flops():
    """gpt-tiny under cp (ring over 8 ranks, batch 8 × 64 placed in the zigzag order):
    the marked batch's loss compiles fewer FLOPs than the same batch unmarked (masks read
    at run time) by at least the dropped pairs' dot FLOPs."""
    model = models.get("gpt-tiny", n_layers=1)
    plan = sk.Plan("cp")
    abstract = plan.abstract_init(train.init_fn(model, train.adamw()), jax.random.key(0))
    batch = train.token_batch(8, 64, plan)
    assert batch["zigzag"].shape == (0, 0, 8)  # the abstract batch is marked as placed
    shardings = plan.batch_shardings(batch)
    batch = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[k]) for k, x in batch.items()
    }

    def flops(b: dict) -> float:
        with jax.set_mesh(plan.mesh), plan.context():
            compiled = jax.jit(model.loss).lower(abstract.tree.params, b).compile()
        return compiled_flops(compiled).flops

    static = flops(batch)
    runtime = flops({k: x for k, x in batch.items() if k != "zigzag"})
    # Hand count per device: 8 rows, chunks of c = 64/16 = 4 tokens, 8 heads × 8 dims; a
    # pair's dot FLOPs p = 2·(2·c²·64)·8. The ring's 7 steps run 14 pairs, not 28, and the
    # own block 3, not 4: 15 pairs fewer. The softmax's elementwise work per score (head
    # dim 8) and the run-time masks add to the drop (measured 1.40 × 15p).
    p = 2 * (2 * 4 * 4 * 64) * 8
    assert 15 * p <= runtime - static <= 1.6 * 15 * p, (runtime - static, 15 * p)
