"""Pipelines, compile only: schedules' memory and bubble, ZeroPP's unit against the formula,
ZeroPP vs FSDP vs dp_tp_sp, with Tang et al.'s crossover condition next to the bytes.

Each row compiles in its own process (a process's emulated device count is fixed).
Memory = arguments + output + temp − alias; wire from ``parse_collectives``; analytic
from :mod:`shardkit.report.pipeline_analytic` (pipelined rows) or the recipe's analytic
model (the others). Nothing is allocated.

Run: python benchmarks/pipeline.py [--tiny]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench_util import MIB, emit, parser


def worker(spec: dict) -> dict:
    import shardkit as sk

    sk.emulate_devices(spec["devices"])
    import jax

    from shardkit import models, train
    from shardkit.parallel.report import measure, useful_flops
    from shardkit.report.pipeline_analytic import zeropp_beats_tp

    model = models.get(spec["model"], **spec.get("overrides", {}))
    recipe = sk.recipes.get(spec["recipe"])
    if spec.get("mesh"):
        recipe = recipe.with_mesh(spec["mesh"])
    plan = sk.Plan(recipe, devices=jax.devices()[: spec["devices"]])
    mesh = "×".join(f"{k}={v}" for k, v in plan.mesh.shape.items() if v > 1)
    b, s = spec["batch"], spec["seq"]
    if "stage" not in plan.mesh.shape:
        rep = models.report(plan, model, train.adamw(), batch=b, seq=s)
        d = rep.to_json()
        wire = sum(d["wire_bytes_by_kind"].values()) if "wire_bytes_by_kind" in d else None
        return {"mesh": mesh, "total": d["memory_per_device_bytes"]["total"],
                "temp": d["memory_per_device_bytes"]["temp"], "wire": wire,
                "analytic_wire": sum(d.get("analytic_wire_bytes_by_kind", {}).values()) or None}  # fmt: skip
    m = measure(plan, model, train.adamw(), batch=b, seq=s, microbatches=spec["m"],
                schedule=spec["schedule"], virtual_stages=spec.get("v", 1), unit=spec.get("unit"))  # fmt: skip
    p = plan.mesh.shape["stage"]
    weights = sum(m.wire_bytes_by_kind.get(k, 0.0) for k in ("all-gather", "reduce-scatter"))
    want_w = sum(
        m.analytic.wire_bytes_by_kind.get(k, 0.0) for k in ("all-gather", "reduce-scatter")
    )
    fsdp = plan.mesh.shape.get("fsdp", 1)
    micro = b // (spec["m"] * fsdp * plan.mesh.shape.get("data", 1))
    unit = spec.get("unit") or spec["m"]
    return {
        "mesh": mesh, "total": m.memory["total"], "temp": m.memory["temp"],
        "wire": sum(m.wire_bytes_by_kind.values()),
        "analytic_wire": sum(m.analytic.wire_bytes_by_kind.values()),
        "permute_ratio": m.ratio("collective-permute"),
        "weights": weights, "analytic_weights": want_w,
        "flops_ratio": m.flops / useful_flops(model, batch=b, seq=s, stages=p,
                                              devices=plan.mesh.size),  # fmt: skip
        "analytic_flops_ratio": m.analytic.flops_ratio, "bubble": m.analytic.bubble,
        "zeropp_beats_tp": zeropp_beats_tp(seq=s, unit=unit, micro_batch=max(micro, 1),
                                           d_model=model.config.d_model),  # fmt: skip
    }  # fmt: skip


def run(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:160]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(x, scale=MIB):
    return "—" if x is None else x * scale


def main(argv=None) -> None:
    if argv and argv[0] == "--worker":
        print(json.dumps(worker(json.loads(argv[1]))))
        return
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    small = {"model": "gpt-tiny", "overrides": {"n_layers": 8}, "seq": 16} if args.tiny else \
        {"model": "gpt-small", "seq": 256}  # fmt: skip
    v = 2 if args.tiny else 3  # 12 layers: 4 stages × 3 chunks
    m = 4 if args.tiny else 16
    rows = []
    specs = [  # (label, spec)
        ("pp gpipe", {**small, "recipe": "pp", "devices": 4, "schedule": "gpipe", "m": m,
                      "batch": m}),
        ("pp 1f1b", {**small, "recipe": "pp", "devices": 4, "schedule": "1f1b", "m": m,
                     "batch": m}),
        ("pp 1f1b, 2m", {**small, "recipe": "pp", "devices": 4, "schedule": "1f1b", "m": 2 * m,
                         "batch": 2 * m}),
        (f"pp interleaved v={v}", {**small, "recipe": "pp", "devices": 4,
                                   "schedule": "interleaved", "v": v, "m": m, "batch": m}),
    ]  # fmt: skip
    for unit in (m, 1) if args.tiny else (m, m // 2, m // 4, 1):  # --tiny: a smoke run
        specs.append((f"zeropp U={unit}", {**small, "recipe": "zeropp", "devices": 8,
                      "schedule": "1f1b", "m": m // 2, "unit": min(unit, m // 2),
                      "batch": 4 * (m // 2)}))  # fmt: skip
    specs += [
        ("fsdp", {**small, "recipe": "fsdp", "devices": 8, "batch": 2 * m}),
        ("dp_tp_sp", {**small, "recipe": "dp_tp_sp", "devices": 8, "batch": 2 * m}),
    ]
    if not args.tiny:
        big = {"model": "gpt-7b", "seq": 2048, "overrides": {"remat": "full"}}
        for n in (64, 256):
            specs += [
                (f"7b zeropp ({n})", {**big, "recipe": "zeropp", "devices": n, "schedule": "1f1b",
                                      "m": 4, "batch": n, "mesh": {"stage": 4}}),
                (f"7b fsdp ({n})", {**big, "recipe": "fsdp", "devices": n, "batch": n}),
                (f"7b dp_tp_sp ({n})", {**big, "recipe": "dp_tp_sp", "devices": n, "batch": n}),
            ]  # fmt: skip
    headers = ["row", "recipe", "mesh", "total MiB/device", "temp MiB", "temp/gpipe", "wire MiB",
               "analytic wire MiB", "wire/analytic", "AG+RS MiB", "analytic AG+RS MiB",
               "FLOPs/useful", "1/(1-bubble)", "2sUb > 9h"]  # fmt: skip
    title = "Pipelines (compile only): schedules, ZeroPP's unit, ZeroPP vs FSDP vs TP"
    gpipe_temp = None  # 1f1b's activation memory against gpipe's (same p, m, no remat)
    for label, spec in specs:
        r = run(spec)
        print(label, r, flush=True)
        if "error" in r:
            rows.append([label, spec["recipe"], "—", r["error"], *["—"] * 10])
        else:
            if label == "pp gpipe":
                gpipe_temp = r["temp"]
            vs_gpipe = r["temp"] / gpipe_temp if gpipe_temp and spec["recipe"] == "pp" else "—"
            rows.append([
                label, spec["recipe"], r["mesh"], fmt(r["total"]), fmt(r["temp"]), vs_gpipe,
                fmt(r["wire"]), fmt(r.get("analytic_wire")),
                r["wire"] / r["analytic_wire"] if r.get("analytic_wire") else "—",
                fmt(r.get("weights")), fmt(r.get("analytic_weights")),
                r.get("flops_ratio", "—"), r.get("analytic_flops_ratio", "—"),
                r.get("zeropp_beats_tp", "—"),
            ])  # fmt: skip
        emit("pipeline", title, headers, rows, args.out)  # after each row: partial runs keep rows


if __name__ == "__main__":
    main(sys.argv[1:])
