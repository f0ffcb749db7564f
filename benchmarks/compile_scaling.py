"""Compile time against depth, layers under scan vs unrolled, and shardkit's own share.

GPT of width 256 (4 heads, vocab 4096, seq 128) under FSDP on 8 emulated devices,
compile only. For each depth: the train step's compile time with scanned layers (the
fastest of three compiles) and with unrolled layers (one), and the time shardkit spends resolving rules into shardings
(``plan.shardings`` of the annotated state) as a share of the scanned compile.

Run: python benchmarks/compile_scaling.py [--tiny]
"""

from __future__ import annotations

import sys
import time

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_util import emit, parser  # noqa: E402

from shardkit import train  # noqa: E402
from shardkit.models import get  # noqa: E402

WIDTH = {"d_model": 256, "n_heads": 4, "n_kv_heads": 4, "d_ff": 1024, "vocab": 4096, "max_seq": 128}


def compile_seconds(layers: int, scan: bool) -> tuple[float, float]:
    """(compile seconds, rule-resolution seconds) for one depth."""
    model, tx = get("gpt-small", n_layers=layers, scan=scan, remat="full", **WIDTH), train.adamw()
    plan = sk.Plan("fsdp")
    init = train.init_fn(model, tx)
    annotated = jax.eval_shape(init, jax.random.key(0))
    start = time.perf_counter()
    plan.shardings(annotated)
    resolve = time.perf_counter() - start
    state = plan.abstract_init(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    start = time.perf_counter()
    plan.compile(train.train_step(model, tx), state, {"inputs": tokens, "targets": tokens})
    return time.perf_counter() - start, resolve


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    depths = (2, 4) if args.tiny else (6, 12, 24, 48)
    rows, scanned = [], {}
    repeats = 1 if args.tiny else 3
    for depth in depths:
        # The minimum of a few compiles: the machine is shared and compile times are noisy.
        scan_s, resolve_s = min(compile_seconds(depth, scan=True) for _ in range(repeats))
        unrolled_s, _ = compile_seconds(depth, scan=False)
        scanned[depth] = scan_s
        rows.append(
            [depth, scan_s, unrolled_s, unrolled_s / scan_s, resolve_s * 1e3, resolve_s / scan_s]
        )
    growth = scanned[depths[-1]] / scanned[depths[0]]
    emit(
        "compile_scaling",
        f"Compile time vs depth (FSDP, 8 devices): scanned {depths[-1]} layers = "
        f"{growth:.2f}× scanned {depths[0]} layers",
        [
            "layers",
            "scanned s",
            "unrolled s",
            "unrolled/scanned",
            "rule resolution ms",
            "resolution share of scanned compile",
        ],
        rows,
        args.out,
        extra={"scanned_growth": growth},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
