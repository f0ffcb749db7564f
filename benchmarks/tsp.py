"""TSP (tensor and sequence parallelism on one axis) against TP+SP, CP and FSDP+CP.

Compile only (nothing runs), 8 emulated CPU devices, llama-1b (full remat per block),
f32 AdamW, batch 1 per data replica. Per recipe and device: memory (arguments + output
+ temp − alias, from ``compiled.memory_analysis()``; state = the arguments) and ring
wire bytes per step (``parse_collectives``), next to the analytic model
(``report.analytic``; TSP's in ``report.analytic_tsp``).

Two tables:

1. llama-1b at sequence 8,192: both TSP implementations (``tsp``: the paper's
   weight-shard rings; ``tsp_gspmd``: the same layout by rules, XLA all-gathers each
   layer's weights) against ``tp``, ``tp_sp`` and ``cp (replicated)``.
2. A sweep of the sequence, 512 → 32,768 (and on to 65,536, where the crossover
   lies), for tp_sp, cp (replicated), fsdp_cp (replicated) and both TSPs; "TSP <
   TP+SP" marks where the paper's
   schedule moves fewer bytes than TP+SP, measured and analytic; the two crossovers
   are reported with the sweep step between them.

``cp (replicated)`` and ``fsdp_cp (replicated)`` are the context-parallel layouts these
tables were measured with: the state whole over ``sequence``
(``with_context_state("replicated")``). Today's ``cp`` and ``fsdp_cp`` split it over
``sequence`` too (ZeRO-3); benchmarks/context_parallel.py measures them (llama-1b at
8,192 and 32,768 in its second table).

Run: python benchmarks/tsp.py [--tiny] [--seqs 512,1024]
(--tiny: llama-tiny at sequence 64, TINY_HEAD and TINY_SWEEP, a smoke test of every path;
--seqs: the sweep at these sequence lengths only, e.g. to compare a few rows with
compare_results --partial)
"""

from __future__ import annotations

import collections
import json
import sys
import time

import shardkit as sk

sk.emulate_devices(8)

from bench_util import MIB, emit, parser  # noqa: E402

from shardkit import models  # noqa: E402
from shardkit.report import build_report  # noqa: E402
from shardkit.report.analytic import analytic_model  # noqa: E402

#: Labels of the layouts measured that are not a registered recipe as it stands:
#: (recipe, its context_state).
LAYOUTS = {
    "cp (replicated)": ("cp", "replicated"),
    "fsdp_cp (replicated)": ("fsdp_cp", "replicated"),
}
#: (recipe or label, mesh axis sizes) on 8 devices; batch 1 per data replica.
HEAD_TO_HEAD = (
    ("tp", {"tensor": 8}),
    ("tp_sp", {"tensor": 8}),
    ("cp (replicated)", {"sequence": 8}),
    ("tsp_gspmd", {"tsp": 8}),
    ("tsp", {"tsp": 8}),
)
SWEEP = (
    ("tp_sp", {"tensor": 8}),
    ("cp (replicated)", {"sequence": 8}),
    ("fsdp_cp (replicated)", {"fsdp": 4, "sequence": 2}),
    ("tsp_gspmd", {"tsp": 8}),
    ("tsp", {"tsp": 8}),
)
#: --tiny: one layout of each kind (a registered recipe, a LAYOUTS one), TSP against TP+SP
TINY_HEAD = tuple(r for r in HEAD_TO_HEAD if r[0] != "tp")
TINY_SWEEP = tuple(r for r in SWEEP if r[0] in ("tp_sp", "tsp"))
SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


_CACHE: dict = {}


def measure(model_name: str, recipe: str, mesh: dict[str, int], seq: int) -> dict:
    """Compile the train step; memory, wire and analytic wire per device (cached)."""
    key = (model_name, recipe, tuple(mesh.items()), seq)
    if key not in _CACHE:
        _CACHE[key] = _measure(model_name, recipe, mesh, seq)
    return _CACHE[key]


def _measure(model_name: str, recipe: str, mesh: dict[str, int], seq: int) -> dict:
    batch = 1
    for axis in ("data", "fsdp"):
        batch *= mesh.get(axis, 1)
    model = models.get(model_name, remat="full", max_seq=max(seq, 128))
    name, state = LAYOUTS.get(recipe, (recipe, None))
    layout = sk.recipes.get(name).with_mesh(mesh)
    layout = layout if state is None else layout.with_context_state(state)
    plan = sk.Plan(layout)
    t0 = time.perf_counter()
    report = build_report(plan, model=model, batch=batch, seq=seq)
    mem = report.memory
    by_kind: dict[str, float] = collections.Counter()
    for c in report.collectives:
        by_kind[c.kind] += c.wire_bytes
    analytic = analytic_model(model.config.dims(), layout, mesh, batch=batch, seq=seq, remat="full")
    return {
        "recipe": recipe,
        "seq": seq,
        "batch": batch,
        "state": mem.arguments,
        "temp": mem.temp,
        "total": mem.arguments + mem.output + mem.temp - mem.alias,
        "wire": sum(by_kind.values()),
        "wire_by_kind": dict(by_kind),
        "analytic_wire": sum(analytic.wire_bytes_by_kind.values()),
        "compile_s": time.perf_counter() - t0,
    }


def crossover(rows: list[dict], key: str) -> int | None:
    """First sequence from which TSP's ``key`` stays below TP+SP's (None: never)."""
    by = {(r["recipe"], r["seq"]): r[key] for r in rows}
    seqs = sorted({r["seq"] for r in rows})
    below = [s for s in seqs if by[("tsp", s)] < by[("tp_sp", s)]]
    for s in below:
        if all(t in below for t in seqs if t >= s):
            return s
    return None


def main(argv=None) -> int:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument(
        "--seqs",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        help="comma-separated sequence lengths of the sweep (default: all of SEQS)",
    )
    args = cli.parse_args(argv)
    name, seqs, head_seq = ("llama-tiny", (64,), 64) if args.tiny else ("llama-1b", SEQS, 8192)
    head_to_head, sweep_layouts = (TINY_HEAD, TINY_SWEEP) if args.tiny else (HEAD_TO_HEAD, SWEEP)
    seqs = args.seqs or seqs
    cfg = models.get(name).config
    psi_l, psi_in = cfg.dims().ringed_layer_params

    # 1. head to head at one sequence
    head = [measure(name, r, m, head_seq) for r, m in head_to_head]
    by = {r["recipe"]: r for r in head}
    rows = [
        [
            r["recipe"],
            r["state"] * MIB,
            r["temp"] * MIB,
            r["total"] * MIB,
            r["wire"] * MIB,
            r["analytic_wire"] * MIB,
            r["wire"] / r["analytic_wire"],
        ]
        for r in head
    ]
    layer_mib = 4 * psi_l * MIB
    saved = (by["tsp_gspmd"]["temp"] - by["tsp"]["temp"]) * MIB
    title = (
        f"TSP head to head: {name}, sequence {head_seq}, 8 devices, full remat (per device, MiB)"
    )
    text = emit(
        "tsp_head",
        title,
        ["recipe", "state", "temp", "total", "wire", "analytic wire", "wire / analytic"],
        rows,
        args.out,
    )
    print(
        f"temp saved by the paper's schedules over rules only: {saved:,.1f} MiB; one "
        f"gathered layer's weights: {layer_mib:,.1f} MiB\n"
    )

    # 2. the sweep
    sweep = [measure(name, r, m, s) for s in seqs for r, m in sweep_layouts]
    at = {(r["recipe"], r["seq"]): r for r in sweep}
    rows = []
    for s in seqs:
        tsp, tp = at[("tsp", s)], at[("tp_sp", s)]
        for r, _ in sweep_layouts:
            row = at[(r, s)]
            mark = ""
            if r == "tsp":
                mark = (
                    ("yes" if tsp["wire"] < tp["wire"] else "no")
                    + " / "
                    + ("yes" if tsp["analytic_wire"] < tp["analytic_wire"] else "no")
                )
            rows.append(
                [
                    s,
                    r,
                    row["total"] * MIB,
                    row["temp"] * MIB,
                    row["wire"] * MIB,
                    row["analytic_wire"] * MIB,
                    row["wire"] / row["analytic_wire"],
                    mark,
                ]
            )
    measured, analytic = crossover(sweep, "wire"), crossover(sweep, "analytic_wire")
    steps = (
        None
        if measured is None or analytic is None
        else abs(seqs.index(measured) - seqs.index(analytic))
    )
    title = (
        f"TSP sweep: {name}, 8 devices, batch 1 per data replica, full remat "
        "(per device, MiB; 'TSP < TP+SP' measured / analytic)"
    )
    tail = (
        f"\nCrossover (TSP moves fewer bytes than TP+SP from this sequence on): measured "
        f"{measured}, analytic {analytic} ({steps} sweep steps apart). Ψ_l = {psi_l:,}, "
        f"Ψ_in = {psi_in:,}; temp saved by the paper's schedules at {head_seq}: "
        f"{saved:,.1f} MiB (one gathered layer: {layer_mib:,.1f} MiB).\n"
    )
    sweep_text = emit(
        "tsp",
        title,
        [
            "seq",
            "recipe",
            "total",
            "temp",
            "wire",
            "analytic wire",
            "wire / analytic",
            "TSP < TP+SP",
        ],
        rows,
        args.out,
        extra={
            "head_to_head": head,
            "sweep": sweep,
            "crossover_measured": measured,
            "crossover_analytic": analytic,
            "crossover_steps_apart": steps,
            "head_markdown": text,
        },
    )
    print(tail)
    result = args.out / "tsp.json"
    payload = json.loads(result.read_text())
    payload["markdown"] = text + "\n" + sweep_text + tail
    result.write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
