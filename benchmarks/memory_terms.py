"""The temp memory at its peak and the wire bytes by term, against the analytic model,
for every recipe.

Compile only (nothing runs), f32 AdamW, full remat, seq 512, global batch 8, on
gpt-small and llama-small: ``sk.report.build_report(..., itemise=True)`` splits the temp bytes
live where XLA's heap peaks into the report's terms (``shardkit.report.memory_terms``).
Each recipe runs on 8 devices, or on 4 where 8 does not divide the model (12 heads or
4 kv heads under 8-way tensor parallelism, 12 layers over 8 pipeline stages). Per
recipe: the peak's phase, the temp memory, what the live values cover, the heap's
fragmentation, the wire bytes by term (``shardkit.report.wire_terms``: weight
all-gathers, gradient reductions, activation collectives, ...) with those off by more
than 10 % from their analytic value, and whether any memory or wire term off by more
than 10 % is left without an explanation line (the JSON holds every line).

Run: python benchmarks/memory_terms.py [--tiny]  (--tiny: gpt-tiny, seq 32)
"""

from __future__ import annotations

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
from bench_util import MIB, emit, parser  # noqa: E402

from shardkit import models, recipes  # noqa: E402
from shardkit.errors import ShardingError  # noqa: E402
from shardkit.report import build_report  # noqa: E402


def measure(name: str, recipe: str, seq: int, batch: int = 8):
    """(devices, report) on 8 devices, or 4 where 8 does not divide the model."""
    model = models.get(name, remat="full")
    for devices in (8, 4):
        try:
            plan = sk.Plan(recipe, devices=jax.devices()[:devices])
            return devices, build_report(plan, model=model, batch=batch, seq=seq, itemise=True)
        except ShardingError as e:
            error = e
    raise error


#: --tiny: a smoke run over one recipe of each family (ZeRO, context, TSP, pipeline)
TINY_RECIPES = ("fsdp", "cp", "tsp_gspmd", "dp_pp")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    names, seq = (("gpt-tiny",), 32) if args.tiny else (("gpt-small", "llama-small"), 512)
    rows, details = [], {}
    for name in names:
        for recipe in TINY_RECIPES if args.tiny else recipes.names():
            try:
                devices, r = measure(name, recipe, seq)
            except ShardingError as e:
                rows.append(
                    [
                        name,
                        recipe,
                        "–",
                        "skipped: " + str(e).splitlines()[0][:80],
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                    ]
                )
                continue
            terms = {t.term: t for t in r.memory_terms}
            live = sum(t.bytes for k, t in terms.items() if k != "heap fragmentation")
            frag = terms["heap fragmentation"].bytes if "heap fragmentation" in terms else 0
            explained = {e.term for e in r.explanations}
            off = [
                t
                for t in (*r.memory_terms, *r.wire_terms)
                if t.bytes and (t.ratio is None or abs(t.ratio - 1) > 0.1)
            ]
            wire_off = (
                ", ".join(
                    f"{t.term} {t.bytes * MIB:,.1f}"
                    + (f" ({t.ratio:.2f}×)" if t.ratio is not None else "")
                    for t in r.wire_terms
                    if t in off
                )
                or "none"
            )
            unexplained = [t.term for t in off if t.term not in explained]
            phase = r.memory_peak_phase or ""
            mesh = "×".join(f"{k}{v}" for k, v in r.mesh.items())
            largest = ", ".join(
                f"{t.term} {t.bytes * MIB:,.0f}"
                + (f" ({t.ratio:.2f}×)" if t.ratio is not None else "")
                for t in sorted(r.memory_terms, key=lambda t: -t.bytes)[:3]
            )
            rows.append(
                [
                    name,
                    recipe,
                    mesh,
                    phase,
                    r.memory.temp * MIB,
                    live / r.memory.temp,
                    frag * MIB,
                    largest,
                    wire_off,
                    ", ".join(unexplained) or "none",
                ]
            )
            details[f"{name}/{recipe}"] = {
                "devices": devices,
                "mesh": r.mesh,
                "temp_bytes": r.memory.temp,
                "memory_terms": [t.to_json() for t in r.memory_terms],
                "wire_terms": [t.to_json() for t in r.wire_terms],
                "explanations": [e.to_json() for e in r.explanations],
            }
    emit(
        "memory_terms",
        f"Temp memory at its peak and wire bytes, by term: {', '.join(names)}, "
        f"seq {seq}, batch 8, f32 AdamW, full remat, per device",
        [
            "model",
            "recipe",
            "mesh",
            "peak phase",
            "temp MiB",
            "live/temp",
            "fragmentation MiB",
            "largest terms MiB (measured/analytic)",
            "wire terms off > 10 % MiB (measured/analytic)",
            "unexplained > 10 %",
        ],
        rows,
        args.out,
        extra={"details": details},
    )


if __name__ == "__main__":
    main()
