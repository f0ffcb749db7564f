"""Rich renderables for reports: ``print(report)`` and ``console.print(report)`` use these.

Library code returns data and renderables; only the CLI (or the user) prints.

Example:
  >>> import shardkit as sk
  >>> report = sk.report.build_report(sk.Plan("dp"), model=sk.models.get("gpt-tiny"), batch=8, seq=32)
  >>> text = str(report)
  >>> "memory per device" in text and "wire bytes per device per step" in text
  True
"""

from __future__ import annotations

import io
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from shardkit.report.records import human_bytes
from shardkit.report.tables import BYTES, Column, fit_table, short_bytes, table_width

__all__ = [
    "estimate_renderables",
    "memory_terms_table",
    "report_renderables",
    "to_text",
]


#: Short pass names for the 80-column table (the JSON has the full ones).
_PASS = {"forward": "fwd", "backward": "bwd", "remat": "remat", "update": "update"}
#: Collective kinds as the 80-column table names them (``--json`` keeps XLA's names).
_KIND = {"collective-permute": "permute"}


def _ratio(measured: float, analytic: float | None) -> str:
    return f"{measured / analytic:.2f}×" if analytic else "–"


def report_renderables(report: Any, *, top: int = 12, width: int = 80) -> list[RenderableType]:
    """The report as rich renderables: header, memory, wire, largest collectives, notes
    (the tables fitted to ``width`` columns)."""
    a = report.analytic
    mesh = " × ".join(f"{k}={v}" for k, v in report.mesh.items())
    out: list[RenderableType] = [Text.from_markup(f"[bold]{report.recipe}[/bold] on {mesh}")]
    w = report.workload
    if w is not None:
        label = f"{w.model}, " if w.model else ""
        seq = f", seq {w.seq}" if w.seq else ""
        remat = f", remat {w.remat}" if w.remat else ""
        out.append(Text(f"{label}batch {w.batch}{seq}{remat}, {w.precision}"))

    mem = Table(title="memory per device", show_lines=False)
    for col in ("", "measured", "analytic", "ratio"):
        mem.add_column(col, justify="right" if col else "left")
    m = report.memory
    state = (a.memory.params + a.memory.optimizer) if a else None
    # Without the model's dimensions the analytic model has no activation terms: its
    # temp and total would be a floor, not an estimate.
    whole = a if a and report.workload is not None and report.workload.has_dims else None
    mem.add_row(
        "arguments (params + optimizer)",
        human_bytes(m.arguments),
        human_bytes(state) if a else "–",
        _ratio(m.arguments, state),
    )
    mem.add_row(
        "temp (grads, activations, gathered weights)",
        human_bytes(m.temp),
        human_bytes(whole.memory.grads + whole.memory.activations) if whole else "–",
        "",
    )
    mem.add_row(
        "total = arguments + output + temp − alias",
        human_bytes(m.total),
        human_bytes(whole.memory.total) if whole else "–",
        _ratio(m.total, whole and whole.memory.total),
    )
    for phase, peak in ((whole.memory.phases or {}) if whole else {}).items():
        mark = " (peak)" if peak == whole.memory.total else ""
        mem.add_row(f"  analytic phase: {phase}{mark}", "", human_bytes(peak), "")
    if report.kv_latent_bytes is not None:  # latent attention: the K/V latent of every layer
        mem.add_row("  K/V latent, every layer", "", human_bytes(report.kv_latent_bytes), "")
    out.append(mem)
    if report.memory_terms:
        out.append(memory_terms_table(report))
    if report.estimate is not None:
        out += estimate_renderables(report)

    wire = Table(title="wire bytes per device per step")
    for col in ("collective", "measured", "analytic", "ratio"):
        wire.add_column(col, justify="right" if col != "collective" else "left")
    measured = report.wire_bytes_by_kind
    analytic = a.wire_bytes_by_kind if a else {}
    for kind in sorted(set(measured) | set(analytic)):
        got, want = measured.get(kind, 0.0), analytic.get(kind)
        wire.add_row(kind, human_bytes(got), human_bytes(want) if want else "–", _ratio(got, want))
    total_a = sum(analytic.values()) if analytic else None
    wire.add_row(
        "[bold]total",
        human_bytes(report.wire_bytes),
        human_bytes(total_a) if total_a else "–",
        _ratio(report.wire_bytes, total_a),
    )
    out.append(wire)
    if report.wire_terms:
        out.append(_wire_terms_table(report))

    out.append(_collectives_table(report, top=top, width=width))

    params = [r for r in report.params if r.kind == "param"]
    out.append(
        Text(
            f"{len(params)} parameters, {report.replicated_fraction:.1%} of parameter bytes "
            f"replicated; FLOPs per step per device: {report.flops:.3g}"
            if report.flops
            else "FLOPs: not reported by this backend"
        )
    )
    prefixed = [r for r in params if r.prefix]
    if prefixed:
        out.append(Text(_prefix_note(prefixed)))
    for e in report.explanations:
        head = f"is {e.ratio:.2f}× analytic" if e.analytic_bytes else "has no analytic term"
        out.append(Text.from_markup(f"[cyan]why {e.term} {head}:[/cyan] ") + Text(e.why))
    for warning in report.warnings:
        out.append(Text.from_markup("[yellow]warning:[/yellow] ") + Text(warning))
    return out


def _collectives_table(report: Any, *, top: int = 12, width: int = 80) -> Table:
    """The ``top`` collectives by cause, one line each, fitted to ``width`` columns: the
    kind, pass and source line whole, the model path cut from the middle to what is left."""
    groups = report.collective_groups()
    lowered = any(g.kind.endswith("*") for g in groups)
    notes = [f"wire: bytes per device per step ({BYTES})"]
    if lowered:
        notes.append("* a reduce-scatter lowered as all-reduce + dynamic-slice on CPU")

    def kind(g: Any) -> str:
        return _KIND.get(g.kind.rstrip("*"), g.kind.rstrip("*")) + "*" * g.kind.endswith("*")

    def columns(where_width: int | None) -> list[Column]:
        def where(g: Any) -> str:
            text = g.block or g.where or "–"  # the block that made it, if any
            return text if where_width is None else _abbreviate(text, where_width)

        return [
            Column("kind", kind, keep=True),
            Column("pass", lambda g: _PASS.get(g.pass_, g.pass_), keep=True),
            Column("where", where, keep=True),
            Column("source", lambda g: g.source, keep=True),
            Column("runs", lambda g: str(g.executions), keep=True, justify="right"),
            Column("wire", lambda g: short_bytes(g.wire_bytes), keep=True, justify="right"),
        ]

    rows = groups[:top]
    title = f"largest collectives by cause ({len(report.collectives)} ops, {len(groups)} causes)"
    spare = width - table_width(fit_table(columns(None), rows, width=width))
    longest = max((len(g.block or g.where or "–") for g in rows), default=1)
    # Too wide, the model path gives way, cut from the middle (both its ends stay).
    return fit_table(
        columns(None if spare >= 0 else max(12, longest + spare)),
        rows,
        width=width,
        title=title,
        caption="\n".join(notes),
    )


def _prefix_note(rows: Any) -> str:
    """One line on parameters whose logical names were a prefix of their dimensions."""
    first = rows[0]
    return (
        f"{len(rows)} parameter(s) carry fewer logical names than dimensions (e.g. "
        f"{first.path} {tuple(first.shape)} as {tuple(first.logical)}): as Flax does, the "
        "names apply to the leading dimensions and the rest are replicated."
    )


def estimate_renderables(report: Any, tolerance: float = 0.10) -> list[RenderableType]:
    """The pre-compile estimate next to the compiled memory, by part and by term, and a
    line naming the term off by more than ``tolerance`` where the total is."""
    vs = report.estimate_vs_compiled(tolerance)
    e = report.estimate
    table = Table(
        title=f"estimate (no compile, {1e3 * e.seconds:.1f} ms) against compiled, per device",
        box=box.SIMPLE_HEAD,
    )
    for col in ("", "estimated", "compiled", "ratio"):
        table.add_column(col, justify="right" if col else "left", no_wrap=True)
    for name, est, got, ratio in vs["rows"]:
        bold = "[bold]" if name == "total" else ""
        table.add_row(
            bold + name, human_bytes(est), human_bytes(got), f"{ratio:.2f}×" if ratio else "–"
        )
    out: list[RenderableType] = [table]
    total = vs["rows"][2][3]
    if total is not None and abs(total - 1) > tolerance and vs["off"]:
        worst = next(r for r in vs["rows"][3:] or vs["rows"][:2] if r[0] == vs["off"][0])
        out.append(
            Text(
                f"the estimate is {total:.2f}× the compiled total; the term off most: "
                f"{worst[0]} ({human_bytes(worst[1])} estimated, {human_bytes(worst[2])} "
                "compiled)"
            )
        )
    return out


def memory_terms_table(report: Any) -> Table:
    """The temp memory at its peak by term (``Report.memory_terms``), 80 columns wide."""
    phase = f" ({report.memory_peak_phase} phase)" if report.memory_peak_phase else ""
    table = Table(title=f"temp memory at its peak{phase}, by term", box=box.SIMPLE_HEAD)
    for col in ("term", "measured", "analytic", "ratio", "buffers"):
        table.add_column(col, justify="left" if col == "term" else "right", no_wrap=True)
    for t in report.memory_terms:
        table.add_row(
            t.term,
            human_bytes(t.bytes),
            human_bytes(t.analytic_bytes) if t.analytic_bytes else "–",
            _ratio(t.bytes, t.analytic_bytes),
            str(t.count) if t.count else "",
        )
    table.add_row("[bold]temp", human_bytes(sum(t.bytes for t in report.memory_terms)), "", "", "")
    return table


def _wire_terms_table(report: Any) -> Table:
    """The wire bytes by term (``Report.wire_terms``), 80 columns wide."""
    table = Table(title="wire bytes by term", box=box.SIMPLE_HEAD)
    for col in ("term", "measured", "analytic", "ratio", "runs"):
        table.add_column(col, justify="left" if col == "term" else "right", no_wrap=True)
    for t in report.wire_terms:
        table.add_row(
            t.term,
            human_bytes(t.bytes),
            human_bytes(t.analytic_bytes) if t.analytic_bytes else "–",
            _ratio(t.bytes, t.analytic_bytes),
            str(sum(c.count for c in t.collectives)),
        )
    return table


def _abbreviate(text: str, width: int) -> str:
    """``text`` cut from the middle to ``width`` characters, keeping its distinctive end.

    Example:
      >>> _abbreviate("params/layers/mlp/down/kernel", 20)
      'params/…/down/kernel'
      >>> _abbreviate("short", 20)
      'short'
    """
    if len(text) <= width:
        return text
    parts = text.split("/")
    if len(parts) > 1:
        head, tail = parts[0], parts[-1]
        for i in range(len(parts) - 2, 0, -1):  # keep as many trailing parts as fit
            longer = parts[i] + "/" + tail
            if len(head) + len(longer) + 3 > width:
                break
            tail = longer
        candidate = f"{head}/…/{tail}"
        if len(candidate) <= width:
            return candidate
        if len(tail) + 2 <= width:
            return "…/" + tail
    return "…" + text[-(width - 1) :]


def to_text(report: Any, *, width: int = 120) -> str:
    """The report rendered as plain text (what ``str(report)`` returns)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(report)
    return buffer.getvalue()
