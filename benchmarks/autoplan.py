"""Auto-planner at scale: ``shardkit autoplan`` for gpt-7b on 64 and 512 H100s (80 GiB).

Each device count runs the command in its own process (compile only, emulated
devices), timed end to end with an empty cache; 512 devices again compiling the 64 best
by the estimate instead of 16 (the same first choice says the 16 were enough), and with
both precisions (``--precision f32,bf16``). The table shows the chosen layout, its compiled
memory and roofline step time, how many candidates there were, how many the
pre-compile estimate ranked (those the analytic checks let through), how many were
compiled (``--compile-top``, 16), and how well the analytic model ranked them: discordant pairs between the
analytic and the compiled wire bytes of the compiled candidates (0 = same order), and
the range of analytic / compiled memory, and how many candidates outside 0.8–1.25 of it
have the gap itemised (the compiled temp memory split into named terms, each term off
its analytic value with an explanation).

Run: python benchmarks/autoplan.py [--tiny]
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_util import MIB, emit, parser

from shardkit.autoplanner.candidates import Candidate


def autoplan(
    model: str, devices: int, extra: list[str], *, memory_gb: float = 80, cache: str | None = None
) -> tuple[dict, float]:
    """``shardkit autoplan --json`` on H100s and its wall time, compiling into ``cache``
    (default: an empty temporary one)."""
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "autoplan",
        "--model",
        model,
        "--devices",
        str(devices),
        "--memory-gb",
        repr(memory_gb),
        "--hardware",
        "h100",
        "--json",
        *extra,
    ]
    with tempfile.TemporaryDirectory() as fresh:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "SHARDKIT_CACHE_DIR": cache or fresh}
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        return json.loads(proc.stdout), time.perf_counter() - start


def discordant(rows: list[dict]) -> int:
    """Pairs the analytic wire bytes order differently from the compiled ones."""
    bad = 0
    for a, b in itertools.combinations(rows, 2):
        da = a["analytic_wire_bytes"] - b["analytic_wire_bytes"]
        dc = a["wire_bytes"] - b["wire_bytes"]
        rel = abs(dc) / max(a["wire_bytes"], b["wire_bytes"], 1)
        bad += da * dc < 0 and rel > 0.01  # a 1 % tie is no disagreement
    return bad


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    model = "gpt-tiny" if args.tiny else "gpt-7b"
    runs = [(16, "f32", 16)]
    if not args.tiny:
        runs = [(64, "f32", 16), (512, "f32", 16), (512, "f32", 64), (512, "f32,bf16", 16)]
    extra = ["--recipes", "dp,fsdp", "--remat", "none"] if args.tiny else []
    rows, details = [], {}
    for n, precisions, top in runs:
        flags = [*extra, "--precision", precisions, "--compile-top", str(top)]
        got, seconds = autoplan(model, n, flags)
        ranked = got["candidates"]
        everything = len(ranked) + len(got["rejected"])
        estimated = everything - sum(r["stage"] == "analytic" for r in got["rejected"])
        best = ranked[0]
        ratios = [
            c["analytic_memory_per_device_bytes"] / c["memory_per_device_bytes"]["total"]
            for c in ranked
        ]
        off = [c for c in ranked if not 0.8 <= c["analytic_over_compiled_memory"] <= 1.25]
        itemised = sum(bool(c["memory_terms"]) and bool(c["memory_explanations"]) for c in off)
        layout = f"{best['recipe']} " + "×".join(f"{k}={v}" for k, v in best["mesh"].items())
        rows.append(
            [
                n,
                precisions,
                layout,
                Candidate.from_json(best).schedule_label or "–",
                best["remat"],
                best["precision"],
                best["memory_per_device_bytes"]["total"] * MIB,
                best["step_time_s"] * 1e3,
                best["mfu"],
                everything,
                estimated,
                len(ranked),
                f"{discordant(ranked)} of {len(ranked) * (len(ranked) - 1) // 2}",
                f"{min(ratios):.2f}–{max(ratios):.2f}",
                f"{itemised} of {len(off)}",
                seconds,
            ]
        )
        details[f"{n} {precisions} top {top}"] = got
    emit(
        "autoplan",
        f"Auto-planner: {model} on H100s (80 GiB), compile only, empty cache",
        [
            "devices",
            "precisions tried",
            "chosen layout",
            "schedule",
            "remat",
            "precision",
            "MiB/device",
            "step ms (roofline)",
            "MFU",
            "candidates",
            "ranked by estimate",
            "compiled",
            "wire order disagreements",
            "analytic/compiled memory",
            "gap itemised",
            "seconds",
        ],
        rows,
        args.out,
        extra={"runs": details},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
