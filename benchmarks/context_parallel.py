"""Context parallelism that scales: the state over the context axis, and every strategy.

Compile only (nothing runs), 8 emulated CPU devices, f32 AdamW, full remat per block.
Per recipe and device: memory (``compiled.memory_analysis()``: arguments = the state and
the batch; total = arguments + output + temp − alias), the wire bytes of the compiled
step (``parse_collectives``) against the report's analytic model, and its
context-parallel term (the ``attention`` scopes: K/V ring, all-gather or all-to-all)
against that term's analytic value.

Two tables:

1. llama-small and gpt-small at sequence 512, batch 8: ``fsdp``; ``cp`` (state ZeRO-3
   over ``sequence``, the tokens placed in the zigzag order) with ring, all-gather and
   Ulysses attention (Ulysses on a ``sequence`` axis of 4 beside ``fsdp`` 2: the 12
   heads do not divide by 8); the old replicated ``cp``
   (``with_context_state("replicated")``); ``fsdp_cp``; ``cp_usp`` (USP: ring over
   ``sequence`` 4 × Ulysses over ``ulysses`` 2, the state ZeRO-3 over both; its CP
   traffic is the all-to-alls and the ring's K/V). All-gather and Ulysses place the
   tokens as they come (no zigzag: their work is even without it). Targets: ``cp`` total ≤ 1.1 ×
   ``fsdp``'s, arguments ≤ 1.05 × 16Ψ/8, wire within 1.15 × the analytic model.
2. llama-1b at sequence 8,192 (and 32,768 unless ``--short``), batch 8: ``fsdp``, the
   replicated ``cp`` and the sharded ``cp`` (ring and Ulysses). The stored Ulysses row,
   ``cp (ulysses, zigzag-placed)``, was measured before ``with_attention`` dropped the
   zigzag for Ulysses (its layers gathered the int32 positions and segment ids, < 0.1 % of
   its wire); a rerun writes ``cp (ulysses)``.

Run: python benchmarks/context_parallel.py [--tiny] [--short] [--no-long]
(--tiny: llama-tiny at sequence 64, one ring row, one long row (table 1's): a smoke test
of every path)
"""

from __future__ import annotations

import functools
import sys
import time

import shardkit as sk

sk.emulate_devices(8)

from bench_util import MIB, emit, parser  # noqa: E402

from shardkit import models  # noqa: E402

KV = "context-parallel K/V"


def variants(batch_axes: int = 8) -> list[tuple[str, object]]:
    """(label, recipe) of table 1."""
    cp = sk.recipes.get("cp")
    return [
        ("fsdp", sk.recipes.get("fsdp")),
        ("cp (ring)", cp),
        ("cp (allgather)", cp.with_attention("allgather")),
        (
            "fsdp_cp 2×4 (ulysses)",
            sk.recipes.get("fsdp_cp")
            .with_mesh({"fsdp": 2, "sequence": 4})
            .with_attention("ulysses"),
        ),
        ("fsdp_cp 4×2 (ring)", sk.recipes.get("fsdp_cp")),
        ("cp_usp 4×2 (usp)", sk.recipes.get("cp_usp")),
        ("cp replicated (before)", cp.with_context_state("replicated")),
    ]


@functools.cache  # a layout measured twice in one run (--tiny's long row is table 1's)
def measure(model_name: str, recipe, seq: int, batch: int) -> dict:
    model = models.get(model_name, remat="full", max_seq=max(seq, 128))
    t0 = time.perf_counter()
    report = sk.report.build_report(sk.Plan(recipe), model=model, batch=batch, seq=seq)
    mem = report.memory
    kv = next((t for t in report.wire_terms if t.term == KV), None)
    analytic = report.analytic
    return {
        "model": model_name,
        "recipe": recipe.name,
        "attention": recipe.attention,
        "context_state": recipe.context_state,
        "seq": seq,
        "batch": batch,
        "psi": model.config.param_count(),
        "arguments": mem.arguments,
        "total": mem.arguments + mem.output + mem.temp - mem.alias,
        "wire": report.wire_bytes,
        "analytic_wire": sum(analytic.wire_bytes_by_kind.values()) if analytic else None,
        "kv": kv.bytes if kv else 0.0,
        "analytic_kv": kv.analytic_bytes if kv else None,
        "compile_s": time.perf_counter() - t0,
    }


def _ratio(a, b):
    return a / b if a is not None and b else float("nan")


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="llama-1b at 8,192 only")
    p.add_argument("--no-long", action="store_true", help="table 1 only (keep table 2's JSON)")
    args = p.parse_args(argv)
    if args.tiny:  # a smoke run of every path: one model (GQA), one long row
        small, seq, big, big_seqs = ("llama-tiny",), 64, "llama-tiny", (64,)
    else:
        small, seq = ("llama-small", "gpt-small"), 512
        big, big_seqs = "llama-1b", (8192,) if args.short else (8192, 32768)

    layouts = variants()
    if args.tiny:  # one ring row: fsdp_cp 4×2's ring is cp's
        layouts = [(label, r) for label, r in layouts if label != "fsdp_cp 4×2 (ring)"]
    table1, records = [], []
    for name in small:
        rows = {label: measure(name, r, seq, 8) for label, r in layouts}
        fsdp = rows["fsdp"]
        for label, r in rows.items():
            records.append({"label": label, **r})
            table1.append(
                [
                    name,
                    label,
                    r["arguments"] * MIB,
                    _ratio(r["arguments"], 16 * r["psi"] / 8),
                    r["total"] * MIB,
                    _ratio(r["total"], fsdp["total"]),
                    r["wire"] * MIB,
                    _ratio(r["wire"], r["analytic_wire"]),
                    r["kv"] * MIB,
                    _ratio(r["kv"], r["analytic_kv"]),
                ]
            )
        print(f"{name}: done", file=sys.stderr, flush=True)
    table2 = []
    cp = sk.recipes.get("cp")
    long = [
        ("fsdp", sk.recipes.get("fsdp")),
        ("cp replicated (before)", cp.with_context_state("replicated")),
        ("cp (ring)", cp),
        ("cp (ulysses)", cp.with_attention("ulysses")),
    ]
    for s in () if args.no_long else big_seqs:
        for label, recipe in long[2:3] if args.tiny else long:
            r = measure(big, recipe, s, 8)
            records.append({"label": label, **r})
            table2.append(
                [
                    big,
                    s,
                    label,
                    r["arguments"] * MIB,
                    r["total"] * MIB,
                    r["wire"] * MIB,
                    _ratio(r["wire"], r["analytic_wire"]),
                    r["compile_s"],
                ]
            )
            print(f"{big} {s} {label}: done", file=sys.stderr, flush=True)
    title = "Context parallelism: the state over the context axis, ring / all-gather / Ulysses"
    emit(
        "context_parallel",
        title + f" (seq {seq}, batch 8)",
        [
            "model",
            "layout",
            "arguments MiB",
            "÷ 16Ψ/8",
            "total MiB",
            "÷ fsdp total",
            "wire MiB",
            "÷ analytic",
            "CP traffic MiB",
            "÷ its term",
        ],
        table1,
        args.out,
        extra={"records": records},
    )
    if args.no_long:
        return 0
    emit(
        "context_parallel_long",
        f"Context parallelism on long sequences: {big}, batch 8",
        [
            "model",
            "seq",
            "layout",
            "arguments MiB",
            "total MiB",
            "wire MiB",
            "÷ analytic",
            "compile s",
        ],
        table2,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
