"""Compile time against depth, layers under scan vs unrolled, and shardkit's own share.

GPT of width 256 (4 heads, vocab 4096, seq 128) under FSDP on 8 emulated devices,
compile only. For each depth: the train step's compile time with scanned layers (the
fastest of three compiles) and with unrolled layers (one), and the time shardkit spends resolving rules into shardings
(``plan.shardings`` of the annotated state) as a share of the scanned compile.

A second table (``compile_scaling_pipeline.json``): the pipelined train step of gpt-small
(``pp``, 4 stages, 1f1b, seq 256, compile only) with 12 and 24 layers and with 16 and 32
micro-batches, the stage's layers unrolled (``rolled=False``) and rolled (the default),
compiled alternately in one process; the ratios are what the issue asks (24 ÷ 12 layers,
m = 32 ÷ m = 16).

Run: python benchmarks/compile_scaling.py [--tiny] [--pipeline-only]
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


def pipeline_compile_seconds(model_name: str, layers: int, m: int, seq: int, rolled: bool) -> float:
    """Seconds to trace and compile gpt-small's pipelined train step (pp, 4 stages, 1f1b)."""
    model, tx = get(model_name, n_layers=layers), train.adamw()
    plan = sk.Plan("pp", devices=jax.devices()[:4])
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((m, seq), jnp.int32)
    start = time.perf_counter()
    step = train.train_step(
        model,
        tx,
        plan=plan,
        abstract=abstract,
        pipeline={"microbatches": m, "schedule": "1f1b", "rolled": rolled},
    )
    plan.jit(step, state=abstract).lower(abstract, {"inputs": tokens, "targets": tokens}).compile()
    return time.perf_counter() - start


def pipeline_table(args) -> None:
    name, seq, (l0, m0) = ("gpt-tiny", 16, (4, 4)) if args.tiny else ("gpt-small", 256, (12, 16))
    configs = [(l0, m0), (2 * l0, m0), (l0, 2 * m0)]
    engines = (True,) if args.tiny else (False, True)  # --tiny: a smoke run, the default
    seconds = {}
    for layers, m in configs:  # unrolled and rolled alternately: the machine's load drifts
        for rolled in engines:
            seconds[layers, m, rolled] = pipeline_compile_seconds(name, layers, m, seq, rolled)
    rows, extra = [], {}
    for rolled in engines:
        base = seconds[l0, m0, rolled]
        depth = seconds[2 * l0, m0, rolled] / base
        micro = seconds[l0, 2 * m0, rolled] / base
        label = "rolled" if rolled else "unrolled"
        rows.append([label, base, seconds[2 * l0, m0, rolled], seconds[l0, 2 * m0, rolled]])
        rows[-1] += [depth, micro]
        extra[label] = {"depth_ratio": depth, "microbatch_ratio": micro, "base_s": base}
    emit(
        "compile_scaling_pipeline",
        f"Compile time of {name}'s pipelined step (pp, 4 stages, 1f1b, seq {seq}): "
        f"{2 * l0} ÷ {l0} layers = "
        + ", ".join(f"{v['depth_ratio']:.2f}× {k}" for k, v in reversed(extra.items())),
        [
            "stage layers",
            f"{l0} layers, m={m0} s",
            f"{2 * l0} layers, m={m0} s",
            f"{l0} layers, m={2 * m0} s",
            f"{2 * l0} ÷ {l0} layers",
            f"m={2 * m0} ÷ m={m0}",
        ],
        rows,
        args.out,
        extra=extra,
    )


def main(argv=None) -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--pipeline-only", action="store_true", help="only the pipeline table")
    args = ap.parse_args(argv)
    pipeline_table(args)
    if args.pipeline_only:
        return
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
