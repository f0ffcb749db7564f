"""Pipelines, compile only: schedules' memory and bubble, ZeroPP's unit against the formula,
ZeroPP vs 3D (dp_tp_sp_pp) vs FSDP, with Tang et al.'s crossover condition next to the bytes.

Each row compiles in its own process (a process's emulated device count is fixed).
Memory = arguments + output + temp − alias; wire from ``parse_collectives``; analytic
from :mod:`shardkit.report.pipeline_analytic` (pipelined rows; with a tensor axis, 3D,
its ``pipeline_model`` through ``analytic_model``) or the recipe's analytic model (the
others). Nothing is allocated.

A second table (``pipeline_3d.json``) puts ZeroPP, 3D and FSDP side by side per model and
device count, with ZeroPP's weight traffic (all-gather + reduce-scatter) against 3D's
(TP+SP's activation all-gathers and reduce-scatters) and the crossover condition: ZeroPP
moves fewer bytes than TP when 2·s·U·b > 9·h in Tang et al. (a stage's weights gathered
forward and again backward, 3·Ψ/p per unit), 2·s·U·b > 6·h for this engine (gathered
once per unit, 2·Ψ/p); b is the 3D layout's micro-batch (the rows whose activations TP
moves), U ZeroPP's unit.

Rows run the library's default engine (a stage's layers and like ticks in rolled loops);
rows labelled ``unrolled`` run ``rolled=False`` beside them.

Run: python benchmarks/pipeline.py [--tiny] [--cache rows.json] [--rows REGEX]
(--cache: resume a long run; --rows: only the rows whose label matches, e.g. ``^7b``)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench_util import MIB, emit, parser

from shardkit.report import build_report


def rolled(spec: dict) -> bool:
    """The row's engine: the library's default (rolled) unless the row says ``rolled``."""
    return spec.get("rolled", True)


def worker(spec: dict) -> dict:
    import shardkit as sk

    sk.emulate_devices(spec["devices"])
    import jax

    from shardkit import models, train
    from shardkit.report.pipeline_analytic import zeropp_beats_tp
    from shardkit.report.pipeline_measure import measure, useful_flops

    model = models.get(spec["model"], **spec.get("overrides", {}))
    recipe = sk.recipes.get(spec["recipe"])
    if spec.get("mesh"):
        recipe = recipe.with_mesh(spec["mesh"])
    plan = sk.Plan(recipe, devices=jax.devices()[: spec["devices"]])
    mesh = "×".join(f"{k}={v}" for k, v in plan.mesh.shape.items() if v > 1)
    b, s = spec["batch"], spec["seq"]
    if "stage" not in plan.mesh.shape:
        rep = build_report(plan, model=model, batch=b, seq=s)
        d = rep.to_json()
        wire = sum(d["wire_bytes_by_kind"].values()) if "wire_bytes_by_kind" in d else None
        return {
            "mesh": mesh,
            "total": d["memory_per_device_bytes"]["total"],
            "temp": d["memory_per_device_bytes"]["temp"],
            "wire": wire,
            "by_kind": d.get("wire_bytes_by_kind", {}),
            "analytic_wire": sum(d.get("analytic_wire_bytes_by_kind", {}).values()) or None,
        }
    m = measure(
        plan,
        model,
        train.adamw(),
        batch=b,
        seq=s,
        microbatches=spec["m"],
        schedule=spec["schedule"],
        virtual_stages=spec.get("v", 1),
        unit=spec.get("unit"),
        stack_order=spec.get("order", "layers"),
        rolled=rolled(spec),
    )
    p = plan.mesh.shape["stage"]
    weights = sum(m.wire_bytes_by_kind.get(k, 0.0) for k in ("all-gather", "reduce-scatter"))
    want_w = sum(
        m.analytic.wire_bytes_by_kind.get(k, 0.0) for k in ("all-gather", "reduce-scatter")
    )
    fsdp = plan.mesh.shape.get("fsdp", 1)
    micro = b // (spec["m"] * fsdp * plan.mesh.shape.get("data", 1))
    unit = spec.get("unit") or spec["m"]
    if plan.mesh.shape.get("tensor", 1) > 1:  # 3D: pipeline_model with its TP+SP terms
        from shardkit.report.analytic import analytic_model

        a = analytic_model(
            model.config.dims(),
            recipe,
            dict(plan.mesh.shape),
            batch=b,
            seq=s,
            remat=model.config.remat,
            pipeline={
                "microbatches": spec["m"],
                "schedule": spec["schedule"],
                "virtual_stages": spec.get("v", 1),
                "unit": spec.get("unit"),
            },
        )
        return {
            "mesh": mesh,
            "total": m.memory["total"],
            "temp": m.memory["temp"],
            "wire": sum(m.wire_bytes_by_kind.values()),
            "by_kind": m.wire_bytes_by_kind,
            "analytic_wire": sum(a.wire_bytes_by_kind.values()),
            "analytic_by_kind": a.wire_bytes_by_kind,
            "analytic_total": a.memory.total,
            "micro": micro,
            "seq": s,
            "d_model": model.config.d_model,
            "flops_ratio": m.flops
            / useful_flops(model, batch=b, seq=s, stages=p, devices=plan.mesh.size),
            "analytic_flops_ratio": m.analytic.flops_ratio,
        }
    return {
        "mesh": mesh,
        "total": m.memory["total"],
        "temp": m.memory["temp"],
        "wire": sum(m.wire_bytes_by_kind.values()),
        "analytic_wire": sum(m.analytic.wire_bytes_by_kind.values()),
        "permute_ratio": m.ratio("collective-permute"),
        "weights": weights,
        "analytic_weights": want_w,
        "flops_ratio": m.flops
        / useful_flops(model, batch=b, seq=s, stages=p, devices=plan.mesh.size),
        "analytic_flops_ratio": m.analytic.flops_ratio,
        "bubble": m.analytic.bubble,
        "by_kind": m.wire_bytes_by_kind,
        "micro": micro,
        "unit": unit,
        "seq": s,
        "d_model": model.config.d_model,
        "zeropp_beats_tp": zeropp_beats_tp(
            seq=s, unit=unit, micro_batch=max(micro, 1), d_model=model.config.d_model
        ),
    }


def run(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    if proc.returncode:
        return {"error": error_line(proc.stderr)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def error_line(stderr: str) -> str:
    """The exception's own line (``Type: message``) of a worker's traceback, not the note
    JAX prints after it about the frames it filtered out."""
    lines = stderr.strip().splitlines()
    raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", ln)]
    return (raised or lines or ["no output"])[-1][:160]


def fmt(x, scale=MIB):
    return "—" if x is None else x * scale


def main(argv=None) -> None:
    if argv and argv[0] == "--worker":
        print(json.dumps(worker(json.loads(argv[1]))))
        return
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument(
        "--cache",
        type=Path,
        help="JSON file of finished rows: rows already in it are not compiled again, and "
        "each new row is written to it as it finishes (a long run can be resumed)",
    )
    cli.add_argument(
        "--rows",
        type=re.compile,
        help="only the rows whose label this regular expression finds (re.search)",
    )
    args = cli.parse_args(argv)
    cached = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    small = (
        {"model": "gpt-tiny", "overrides": {"n_layers": 8}, "seq": 16}
        if args.tiny
        else {"model": "gpt-small", "seq": 256}
    )
    v = 2 if args.tiny else 3  # 12 layers: 4 stages × 3 chunks
    m = 4 if args.tiny else 16
    rows = []
    specs = [  # (label, spec)
        (
            "pp gpipe",
            {**small, "recipe": "pp", "devices": 4, "schedule": "gpipe", "m": m, "batch": m},
        ),
        (
            "pp 1f1b",
            {**small, "recipe": "pp", "devices": 4, "schedule": "1f1b", "m": m, "batch": m},
        ),
        (
            "pp 1f1b, 2m",
            {**small, "recipe": "pp", "devices": 4, "schedule": "1f1b", "m": 2 * m, "batch": 2 * m},
        ),
        (
            f"pp interleaved v={v}",
            {
                **small,
                "recipe": "pp",
                "devices": 4,
                "schedule": "interleaved",
                "v": v,
                "m": m,
                "batch": m,
            },
        ),
        (
            f"pp interleaved v={v}, stored",
            {
                **small,
                "recipe": "pp",
                "devices": 4,
                "schedule": "interleaved",
                "v": v,
                "m": m,
                "batch": m,
                "order": "interleaved",
            },
        ),  # the stack stored in its order
    ]
    for unit in (m,) if args.tiny else (m, m // 2, m // 4, 1):  # --tiny: a smoke run
        specs.append(
            (
                f"zeropp U={unit}",
                {
                    **small,
                    "recipe": "zeropp",
                    "devices": 8,
                    "schedule": "1f1b",
                    "m": m // 2,
                    "unit": min(unit, m // 2),
                    "batch": 4 * (m // 2),
                },
            )
        )
    specs += [
        (
            "3D dp_tp_sp_pp",
            {
                **small,
                "recipe": "dp_tp_sp_pp",
                "devices": 8,
                "schedule": "1f1b",
                "m": m // 2,
                "batch": 4 * (m // 2),
            },
        ),
        ("fsdp", {**small, "recipe": "fsdp", "devices": 8, "batch": 2 * m}),
        ("dp_tp_sp", {**small, "recipe": "dp_tp_sp", "devices": 8, "batch": 2 * m}),
    ]
    if args.tiny:  # a smoke run: one row of each kind (pp, ZeroPP, 3D, flat)
        skip = {"pp 1f1b", "pp 1f1b, 2m", f"pp interleaved v={v}", f"pp interleaved v={v}, stored"}
        skip.add("dp_tp_sp")
        specs = [(label, spec) for label, spec in specs if label not in skip]
    if not args.tiny:  # zero-bubble schedules; the unrolled engine beside the default
        specs.append(("pp zb1", {**dict(specs)["pp 1f1b"], "schedule": "zb1"}))
        # zbv's V needs 2p chunks: 12 layers do not split into 4 stages × 2; 16 layers do
        deep = {**dict(specs)["pp 1f1b"], "overrides": {"n_layers": 16}}
        specs.append(("pp 1f1b, 16 layers", deep))
        # stored in zbv's order (its V), as the planner and `shardkit run` keep it
        specs.append(("pp zbv, 16 layers", {**deep, "schedule": "zbv", "order": "interleaved"}))
        for label in ("pp gpipe", "pp 1f1b", "pp 1f1b, 2m"):
            specs.append((f"{label}, unrolled", {**dict(specs)[label], "rolled": False}))
    if not args.tiny:
        big = {"model": "gpt-7b", "seq": 2048, "overrides": {"remat": "full"}}
        for n in (64, 256):
            specs += [
                (
                    f"7b zeropp ({n})",
                    {
                        **big,
                        "recipe": "zeropp",
                        "devices": n,
                        "schedule": "1f1b",
                        "m": 4,
                        "batch": n,
                        "mesh": {"stage": 4},
                    },
                ),
                (
                    f"7b 3D ({n})",
                    {
                        **big,
                        "recipe": "dp_tp_sp_pp",
                        "devices": n,
                        "schedule": "1f1b",
                        "m": 4,
                        "batch": n,
                        "mesh": {"stage": 4, "tensor": 4},
                    },
                ),
                (f"7b fsdp ({n})", {**big, "recipe": "fsdp", "devices": n, "batch": n}),
                (f"7b dp_tp_sp ({n})", {**big, "recipe": "dp_tp_sp", "devices": n, "batch": n}),
            ]
            for label in (f"7b zeropp ({n})", f"7b 3D ({n})"):
                specs.append((f"{label}, unrolled", {**dict(specs)[label], "rolled": False}))
    if args.rows:
        specs = [(label, spec) for label, spec in specs if args.rows.search(label)]
    headers = [
        "row",
        "recipe",
        "mesh",
        "total MiB/device",
        "temp MiB",
        "temp/gpipe",
        "wire MiB",
        "analytic wire MiB",
        "wire/analytic",
        "AG+RS MiB",
        "analytic AG+RS MiB",
        "FLOPs/useful",
        "1/(1-bubble)",
        "2sUb > 9h",
    ]
    title = "Pipelines (compile only): schedules, ZeroPP's unit, ZeroPP vs FSDP vs TP"
    gpipe_temp = {}  # 1f1b's activation memory against gpipe's (same p, m, no remat, engine)
    results = {}
    for label, spec in specs:
        key = json.dumps(spec, sort_keys=True)
        if key in cached:
            r = cached[key]
        else:
            t0 = time.perf_counter()
            r = run(spec)
            r["compile_s"] = time.perf_counter() - t0
            if args.cache:
                cached[key] = r
                args.cache.write_text(json.dumps(cached))
        results[label] = r
        print(label, r, flush=True)
        if "error" in r:
            rows.append([label, spec["recipe"], "—", r["error"], *["—"] * 10])
        else:
            engine = rolled(spec)
            if label.startswith("pp gpipe"):
                gpipe_temp[engine] = r["temp"]
            vs_gpipe = (
                r["temp"] / gpipe_temp[engine]
                if engine in gpipe_temp and spec["recipe"] == "pp"
                else "—"
            )
            rows.append(
                [
                    label,
                    spec["recipe"],
                    r["mesh"],
                    fmt(r["total"]),
                    fmt(r["temp"]),
                    vs_gpipe,
                    fmt(r["wire"]),
                    fmt(r.get("analytic_wire")),
                    r["wire"] / r["analytic_wire"] if r.get("analytic_wire") else "—",
                    fmt(r.get("weights")),
                    fmt(r.get("analytic_weights")),
                    r.get("flops_ratio", "—"),
                    r.get("analytic_flops_ratio", "—"),
                    r.get("zeropp_beats_tp", "—"),
                ]
            )
        emit("pipeline", title, headers, rows, args.out)  # after each row: partial runs keep rows
    name = "gpt-tiny" if args.tiny else "gpt-small"
    groups = [(name, 8, f"zeropp U={m}", "3D dp_tp_sp_pp", "fsdp")]
    if not args.tiny:
        groups += [
            ("gpt-7b", n, f"7b zeropp ({n})", f"7b 3D ({n})", f"7b fsdp ({n})") for n in (64, 256)
        ]
    emit(
        "pipeline_3d",
        "ZeroPP vs 3D (dp_tp_sp_pp) vs FSDP (compile only, per device)",
        COMPARE_HEADERS,
        [compare(g, results) for g in groups],
        args.out,
    )


COMPARE_HEADERS = [
    "model",
    "devices",
    "zeropp mesh",
    "3D mesh",
    "zeropp MiB",
    "3D MiB",
    "fsdp MiB",
    "zeropp wire MiB",
    "3D wire MiB",
    "fsdp wire MiB",
    "least memory",
    "fewest wire bytes",
    "zeropp AG+RS MiB",
    "3D AG+RS MiB",
    "2·s·U·b",
    "6h (engine)",
    "9h (paper)",
    "ZeroPP < TP: predicted (6h, 9h)",
    "ZeroPP < TP: measured",
    "compile s (zeropp, 3D, fsdp)",
]


def compare(group: tuple, results: dict) -> list:
    """One row of the ZeroPP / 3D / FSDP table: measured bytes and the crossover condition."""
    model, n, *labels = group
    rs = [results.get(lb, {"error": "not run"}) for lb in labels]
    if any("error" in r for r in rs):
        return [model, n, *[r.get("error", "") for r in rs], *["—"] * (len(COMPARE_HEADERS) - 5)]
    zpp, d3, fsdp = rs
    names = ("zeropp", "3D", "fsdp")
    weights = lambda r: sum(r["by_kind"].get(k, 0.0) for k in ("all-gather", "reduce-scatter"))  # noqa: E731
    lhs = 2 * zpp["seq"] * zpp["unit"] * d3["micro"]
    h = zpp["d_model"]
    return [
        model,
        n,
        zpp["mesh"],
        d3["mesh"],
        *(fmt(r["total"]) for r in rs),
        *(fmt(r["wire"]) for r in rs),
        names[min(range(3), key=lambda i: rs[i]["total"])],
        names[min(range(3), key=lambda i: rs[i]["wire"])],
        fmt(weights(zpp)),
        fmt(weights(d3)),
        lhs,
        6 * h,
        9 * h,
        f"{lhs > 6 * h}, {lhs > 9 * h}",
        weights(zpp) < weights(d3),
        ", ".join(f"{r['compile_s']:.0f}" for r in rs),
    ]


if __name__ == "__main__":
    main(sys.argv[1:])
