"""GPU throughput: step time, tokens/s and MFU of gpt-small in bf16 on one GPU.

MFU = model FLOPs per token (``ModelConfig.flops_per_token``: 6N + 12·L·d·s, training)
× tokens/s ÷ the GPU's peak dense bf16 FLOP/s. On a machine without an NVIDIA GPU it
says so and exits 0.

Run: python benchmarks/gpu.py [--steps 20] [--batch 16] [--seq 1024]
"""

from __future__ import annotations

import statistics
import sys
import time

from bench_util import emit, parser

#: Peak dense bf16 FLOP/s (no sparsity) by device kind substring, from NVIDIA's datasheets.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device_kind: str) -> float | None:
    for name, peak in PEAK_BF16.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print(
            f"benchmarks/gpu.py: no GPU here (backend {jax.default_backend()}); "
            "run it on a machine with an NVIDIA GPU and jax[cuda]."
        )
        return 0
    import shardkit as sk
    from shardkit import train
    from shardkit.data import MarkovSource
    from shardkit.models import get

    name, seq = ("gpt-tiny", 128) if args.tiny else ("gpt-small", args.seq)
    model = get(name, dtype=jnp.bfloat16, remat="none")
    tx = train.adamw(1e-4)
    plan = sk.Plan("dp", devices=gpus[:1])
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx))
    source = MarkovSource(vocab=model.config.vocab)
    batch = plan.shard_batch(source.batch(args.batch, seq, 0))
    for _ in range(3):  # compile and warm up
        state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = args.batch * seq / step_s
    flops = model.config.flops_per_token(seq) * tokens_per_s
    peak = peak_flops(gpus[0].device_kind)
    mfu = flops / peak if peak else float("nan")
    emit(
        "gpu",
        f"{name} bf16 on one {gpus[0].device_kind}",
        ["model", "batch", "seq", "step ms (median)", "tokens/s", "TFLOP/s", "peak TFLOP/s", "MFU"],
        [
            [
                name,
                args.batch,
                seq,
                step_s * 1e3,
                tokens_per_s,
                flops / 1e12,
                (peak or float("nan")) / 1e12,
                mfu,
            ]
        ],
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
