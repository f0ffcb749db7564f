"""Rich tables for reports (the CLI renders; the library returns data)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from shardkit.report.lint import human_bytes
from shardkit.report.report import Report


def _ratio(measured: float, analytic: float | None) -> str:
    return f"{measured / analytic:.2f}×" if analytic else "–"


def print_report(report: Report, console: Console, *, top: int = 12) -> None:
    a = report.analytic
    mesh = " × ".join(f"{k}={v}" for k, v in report.mesh.items())
    console.print(f"[bold]{report.recipe}[/bold] on {mesh}")

    mem = Table(title="memory per device", show_lines=False)
    for col in ("", "measured", "analytic", "ratio"):
        mem.add_column(col, justify="right" if col else "left")
    m = report.memory
    state = (a.memory.params + a.memory.optimizer) if a else None
    mem.add_row("arguments (params + optimizer)", human_bytes(m.arguments),
                human_bytes(state) if a else "–", _ratio(m.arguments, state))  # fmt: skip
    mem.add_row("temp (grads, activations, gathered weights)", human_bytes(m.temp),
                human_bytes(a.memory.grads + a.memory.activations) if a else "–", "")  # fmt: skip
    mem.add_row("total = arguments + output + temp − alias", human_bytes(m.total),
                human_bytes(a.memory.total) if a else "–", _ratio(m.total, a and a.memory.total))  # fmt: skip
    for phase, peak in ((a.memory.phases or {}) if a else {}).items():
        mark = " (peak)" if peak == a.memory.total else ""
        mem.add_row(f"  analytic phase: {phase}{mark}", "", human_bytes(peak), "")
    console.print(mem)

    wire = Table(title="wire bytes per device per step")
    for col in ("collective", "measured", "analytic", "ratio"):
        wire.add_column(col, justify="right" if col != "collective" else "left")
    measured = report.wire_bytes_by_kind
    analytic = a.wire_bytes_by_kind if a else {}
    for kind in sorted(set(measured) | set(analytic)):
        got, want = measured.get(kind, 0.0), analytic.get(kind)
        wire.add_row(kind, human_bytes(got), human_bytes(want) if want else "–", _ratio(got, want))
    total_a = sum(analytic.values()) if analytic else None
    wire.add_row("[bold]total", human_bytes(report.wire_bytes),
                 human_bytes(total_a) if total_a else "–", _ratio(report.wire_bytes, total_a))  # fmt: skip
    console.print(wire)

    ops = Table(title=f"largest collectives (of {len(report.collectives)})")
    for col in ("kind", "buffer", "N", "×", "wire", "op_name"):
        ops.add_column(col)
    for c in sorted(report.collectives, key=lambda c: -c.wire_bytes)[:top]:
        kind = c.kind + (f" ({c.lowered_as})" if c.lowered_as else "")
        ops.add_row(kind, f"{c.dtype}{c.shape}"[:40], str(c.group_size), str(c.count),
                    human_bytes(c.wire_bytes), c.op_name[-70:])  # fmt: skip
    console.print(ops)

    params = [r for r in report.params if r.kind == "param"]
    console.print(
        f"{len(params)} parameters, {report.replicated_fraction:.1%} of parameter bytes "
        f"replicated; FLOPs per step per device: "
        f"{report.flops:.3g}"
        if report.flops
        else "FLOPs: not reported by this backend"
    )
    for w in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")


def print_comparison(reports: Mapping[str, Report], console: Console) -> None:
    table = Table(title="recipes side by side (per device)")
    for col in ("recipe", "mesh", "state", "temp", "total", "wire", "wire/analytic",
                "replicated", "warnings"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("recipe", "mesh") else "right")
    for name, r in reports.items():
        ratios = r.ratios()
        table.add_row(
            name,
            "×".join(f"{k}={v}" for k, v in r.mesh.items()),
            human_bytes(r.memory.arguments),
            human_bytes(r.memory.temp),
            human_bytes(r.memory.total),
            human_bytes(r.wire_bytes),
            f"{ratios['wire_bytes']:.2f}" if "wire_bytes" in ratios else "–",
            f"{r.replicated_fraction:.0%}",
            str(len(r.warnings)),
        )
    console.print(table)
