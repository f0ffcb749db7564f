"""Packed rows under ring attention: blocks skipped, work balance, and time.

One row of S tokens over 8 context ranks (``sequence=8``), ring attention with segment
ids (``causal_attention(..., segments=)``), forward and backward of a sum. Rows of the
table: one causal document, documents of S/2, S/4 and S/8 tokens (aligned to the ranks'
blocks), and log-normal(4, 1) lengths with the contiguous and the balanced split
(``shardkit.packing.balance_permutation``). Columns: the (query block, K/V block) pairs
the ring computes (of 64; the others have no unmasked pair and are skipped), the most
on one rank, the unmasked pairs' max ÷ mean over the ranks, and the median time of the
step. XLA's static FLOP count of the compiled step is the same for every row (the skip
is decided at run time, per block); the time falls with the blocks skipped.

Run: python benchmarks/packed.py [--tiny]
"""

from __future__ import annotations

import statistics
import sys
import time

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import emit, parser  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit.annotate import activation_rules  # noqa: E402
from shardkit.data import MarkovSource  # noqa: E402
from shardkit.nn.attention import Segments, causal_attention, use_attention  # noqa: E402
from shardkit.packing import (  # noqa: E402
    LogNormal,
    attention_work,
    balance_permutation,
    imbalance,
    packed_batch,
    permute_rows,
    ring_blocks,
)
from shardkit.report.flops import compiled_flops  # noqa: E402

N = 8


def layouts(seq: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, segment ids [1, seq], positions [1, seq]) of each row of the table."""
    out = []
    for parts in (1, 2, 4, 8):
        n = seq // parts
        name = "one causal document" if parts == 1 else f"{parts} documents of {n}"
        out.append(
            (name, np.repeat(np.arange(1, parts + 1), n)[None], np.tile(np.arange(n), parts)[None])
        )
    rows = packed_batch(MarkovSource(vocab=16), 1, seq, 0, lengths=LogNormal(4.0, 1.0))
    ids, pos = rows["segment_ids"], rows["positions"]
    out.append(("log-normal(4, 1), contiguous", ids, pos))
    moved = permute_rows(rows, balance_permutation(ids, pos, N))
    out.append(("log-normal(4, 1), balanced", moved["segment_ids"], moved["positions"]))
    return out


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    seq, heads, dim, reps = (256, 2, 16, 2) if args.tiny else (4096, 4, 64, 5)
    mesh = sk.make_mesh({"sequence": N})
    sharded = NamedSharding(mesh, P(None, "sequence"))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(x, (1, seq, heads, dim)), sharded) for x in keys)

    def loss(q, k, v, ids, pos):
        return causal_attention(q, k, v, segments=Segments(ids, pos)).sum()

    ints = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharded)
    rules = sk.Rules([("length", "sequence")])
    with jax.set_mesh(mesh), activation_rules(rules), use_attention("ring"):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        compiled = step.lower(q, k, v, ints, ints).compile()
    flops = compiled_flops(compiled).flops  # loops weighted by their trip counts
    rows = []
    for name, ids, pos in layouts(seq):
        blocks = ring_blocks(ids, pos, N)
        a, b = (jax.device_put(jnp.asarray(x, jnp.int32), sharded) for x in (ids, pos))
        jax.block_until_ready(compiled(q, k, v, a, b))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, a, b))
            times.append(time.perf_counter() - start)
        work = imbalance(attention_work(ids, pos, N))
        ms = statistics.median(times) * 1e3
        rows.append([name, int(blocks.sum()), int(blocks.max()), work, ms])
    emit(
        "packed",
        f"Ring attention on packed rows: one row of {seq:,} tokens, {heads} heads × {dim}, "
        f"sequence={N}, forward + backward (compiled FLOPs {flops:.3g} per device for every row)",
        ["layout", "blocks computed (of 64)", "most on one rank", "work max/mean", "ms (median)"],
        rows,
        args.out,
        extra={"compiled_flops_per_device": flops, "seq": seq},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
