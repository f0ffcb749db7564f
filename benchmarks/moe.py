"""Expert parallelism: the state each device holds and the expert dispatch's bytes,
measured on the compiled step against the analytic model.

Compile only (nothing runs), f32 AdamW, moe-small (8 experts, top-2, on llama-small's
trunk), global batch 8, seq 256, 8 devices. Per recipe: the expert state (parameters and
Adam moments of the experts) and the rest of the state each device holds, from the
state's shardings; the state per device XLA reports (its arguments) against the analytic
count (:mod:`shardkit.report.analytic_moe`); the all-to-all bytes per device per step
against the analytic dispatch bytes; and all the wire bytes per device.

Targets (issue 29): ``ep`` holds at most 1/8 of the expert state plus the dense part,
within 5 % of the analytic count; its all-to-all bytes are within 1.15× the analytic
model; ``ep`` moves fewer bytes than ``ep_gspmd`` and holds no more.

Run: python benchmarks/moe.py [--tiny]  (--tiny: moe-tiny, seq 16)
"""

from __future__ import annotations

import math

import shardkit as sk

sk.emulate_devices(8)

from bench_util import MIB, emit, parser  # noqa: E402

from shardkit import models  # noqa: E402

RECIPES = ("dp", "fsdp", "ep", "ep_gspmd", "fsdp_ep", "ep_tp")


def measure(name: str, recipe: str, batch: int, seq: int) -> dict:
    model = models.get(name)
    report = sk.report.build_report(sk.Plan(recipe), model=model, batch=batch, seq=seq)
    rows = [r for r in report.params if r.kind in ("param", "optimizer")]
    expert = sum(r.bytes_per_device for r in rows if "expert" in r.logical)
    expert_full = sum(_full(r) for r in rows if "expert" in r.logical)
    a = report.analytic
    terms = {t.term: t for t in report.wire_terms}
    dispatch = terms.get("expert dispatch")
    return {
        "recipe": recipe,
        "expert_state_bytes": expert,
        "expert_state_share": expert / expert_full,
        "dense_state_bytes": sum(r.bytes_per_device for r in rows) - expert,
        "state_bytes": report.memory.arguments,
        "state_analytic_bytes": a.memory.params + a.memory.optimizer,
        "all_to_all_bytes": report.wire_bytes_by_kind.get("all-to-all", 0.0),
        "all_to_all_analytic_bytes": a.wire_bytes_by_kind.get("all-to-all", 0.0),
        "dispatch_term_bytes": dispatch.bytes if dispatch else 0.0,
        "wire_bytes": report.wire_bytes,
        "warnings": list(report.warnings),
    }


def _full(row) -> int:
    """A leaf's bytes over all devices: its shape's size times its item size."""
    itemsize = row.bytes_per_device // math.prod(row.shard_shape or row.shape)
    return math.prod(row.shape) * itemsize


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    name, batch, seq = ("moe-tiny", 8, 16) if args.tiny else ("moe-small", 8, 256)
    # --tiny: a smoke run of the two layouts the checks compare
    layouts = ("ep", "ep_gspmd") if args.tiny else RECIPES
    results = {r: measure(name, r, batch, seq) for r in layouts}
    rows = []
    for r, m in results.items():
        a2a = m["all_to_all_analytic_bytes"]
        rows.append(
            [
                r,
                m["expert_state_bytes"] * MIB,
                m["expert_state_share"],
                m["dense_state_bytes"] * MIB,
                m["state_bytes"] * MIB,
                m["state_bytes"] / m["state_analytic_bytes"],
                m["all_to_all_bytes"] * MIB,
                m["all_to_all_bytes"] / a2a if a2a else "–",
                m["wire_bytes"] * MIB,
            ]
        )
    ep, gspmd = results["ep"], results["ep_gspmd"]
    checks = {
        "ep expert share <= 1/8": ep["expert_state_share"] <= 1 / 8 + 1e-12,
        "ep state within 5% of analytic": abs(ep["state_bytes"] / ep["state_analytic_bytes"] - 1)
        <= 0.05,
        "ep all-to-all <= 1.15x analytic": ep["all_to_all_bytes"]
        <= 1.15 * ep["all_to_all_analytic_bytes"],
        "ep moves fewer bytes than ep_gspmd": ep["wire_bytes"] < gspmd["wire_bytes"],
        "ep holds no more than ep_gspmd": ep["state_bytes"] <= gspmd["state_bytes"],
    }
    headers = [
        "recipe",
        "expert state MiB/dev",
        "expert share",
        "dense state MiB/dev",
        "state MiB/dev (XLA)",
        "÷ analytic",
        "all-to-all MiB/dev",
        "÷ analytic",
        "wire MiB/dev",
    ]
    emit(
        "moe",
        f"Expert parallelism: {name}, batch {batch}, seq {seq}, 8 devices (compile only)",
        headers,
        rows,
        args.out,
        extra={"results": results, "checks": checks},
    )
    print({k: "ok" if v else "MISSED" for k, v in checks.items()})


if __name__ == "__main__":
    main()
