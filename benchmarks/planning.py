"""Planning scale: compile-only reports of a 7B model on 64-512 emulated devices.

Each device count runs ``shardkit report --json`` in its own process (a process's
emulated device count is fixed), measuring the wall time of the whole command and the
per-device memory against the analytic model. Nothing is allocated.

A second table (``planning_logits.json``) compiles ``fsdp`` with the logits split over
the vocabulary (``--logits vocab``, the layout before issue 12) and as the recipe now
chooses it (``auto``: over the tokens once a step has as many tokens as the vocabulary)
on 64 to 512 devices: the first grows with the device count, the second does not.

Run: python benchmarks/planning.py [--tiny]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench_util import MIB, emit, parser

_CACHE: dict[tuple, tuple[dict, float]] = {}


def report(model: str, recipe: str, devices: int, seq: int, *extra: str) -> tuple[dict, float]:
    key = (model, recipe, devices, seq, *extra)
    if key not in _CACHE:
        _CACHE[key] = _report(model, recipe, devices, seq, *extra)
    return _CACHE[key]


def _report(model: str, recipe: str, devices: int, seq: int, *extra: str) -> tuple[dict, float]:
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "report",
        "--model",
        model,
        "--recipe",
        recipe,
        "--devices",
        str(devices),
        "--seq",
        str(seq),
        "--remat",
        "full",
        "--json",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    return json.loads(proc.stdout), time.perf_counter() - start


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    model, seq = ("gpt-tiny", 64) if args.tiny else ("gpt-7b", 2048)
    counts = (8,) if args.tiny else (64, 256, 512)
    rows = []
    for recipe in ("fsdp", "fsdp_tp"):
        for n in counts:
            d, seconds = report(model, recipe, n, seq)
            mem, analytic = d["memory_per_device_bytes"], d["analytic_memory_per_device_bytes"]
            state = analytic["params"] + analytic["optimizer"]
            mesh = "×".join(f"{k}={v}" for k, v in d["mesh"].items())
            rows.append(
                [
                    recipe,
                    n,
                    mesh,
                    mem["arguments"] * MIB,
                    state * MIB,
                    mem["arguments"] / state,
                    mem["total"] * MIB,
                    d["ratios"].get("wire_bytes", float("nan")),
                    seconds,
                ]
            )
    emit(
        "planning",
        f"Planning {model} (seq {seq}, one sequence per device, full remat), compile only",
        [
            "recipe",
            "devices",
            "mesh",
            "state MiB/device",
            "analytic state MiB",
            "state ratio",
            "total MiB/device",
            "wire/analytic",
            "seconds",
        ],
        rows,
        args.out,
    )
    logits_layouts(model, seq, (8,) if args.tiny else (64, 128, 256, 512), args.out)


def logits_layouts(model: str, seq: int, counts: tuple[int, ...], out) -> None:
    """fsdp's per-device memory with the logits split over the vocabulary, and as chosen."""
    rows = []
    for n in counts:
        row: list = [n, n * seq]
        for logits in ("vocab", "auto"):  # auto is the recipe as it is: the first table's
            d, _ = report(
                model, "fsdp", n, seq, *(("--logits", logits) if logits != "auto" else ())
            )
            mem = d["memory_per_device_bytes"]
            grows = [w for w in d["warnings"] if w.startswith("activation grows")]
            row += [
                mem["total"] * MIB,
                mem["temp"] * MIB,
                sum(d["wire_bytes_by_kind"].values()) * MIB,
                "yes" if grows else "no",
            ]
        rows.append(row)
    emit(
        "planning_logits",
        f"fsdp's logits layout, {model} (seq {seq}, one sequence per device, "
        "full remat), compile only: split over the vocabulary (before) vs chosen per step (after)",
        [
            "devices",
            "tokens per step",
            "vocab-split total MiB",
            "vocab-split temp MiB",
            "vocab-split wire MiB",
            "lint: grows",
            "auto total MiB",
            "auto temp MiB",
            "auto wire MiB",
            "auto lint: grows",
        ],
        rows,
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
