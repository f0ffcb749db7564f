"""Layout quality: shardkit against the hand-written Flax path and the analytic limit.

Compile only (nothing runs), 8 emulated CPU devices, GPT-2-small shape (full remat per
block), f32 AdamW (``shardkit.train.adamw()``), seq 512, global batch 8. Per recipe,
per device: memory total (arguments + output + temp − alias) and ring wire bytes per step,
for (a) shardkit (``sk.report.build_report(sk.Plan(recipe), model=model, ...)``), (b) the Flax baseline of
``flax_baseline.py`` (the hand-written Flax path) and (c) the analytic model
(``report.analytic``). "Flax" is the baseline as written, whose activation constraints the
legacy ``with mesh:`` silently drops; "Flax pinned" passes the mesh to them explicitly.
shardkit's models scan their layers and the baseline unrolls them; "shardkit unrolled"
(``scan=False``) separates what the layer structure costs from what the layout does.

Also shows the mistake of 8-way tensor parallelism with 12 heads: the error Flax raises
next to shardkit's ``ShardingError``.

Run: python benchmarks/layout.py [--tiny]
(--tiny: gpt-tiny with 4 heads, seq 64, fsdp/tp only: a smoke test of every path)
"""

from __future__ import annotations

import json
import sys
import time

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
from bench_util import MIB, emit, parser  # noqa: E402
from flax_baseline import LAYOUTS, compile_baseline, measure, param_count  # noqa: E402

from shardkit import train  # noqa: E402
from shardkit.models import get  # noqa: E402
from shardkit.report import build_report  # noqa: E402

#: (recipe, devices). The Flax baseline covers the recipes in ``flax_baseline.LAYOUTS``;
#: the others are shardkit only (ZeRO-1 needs optimizer rules Flax's derivation lacks).
RECIPES = (
    ("dp", 8),
    ("fsdp", 8),
    ("tp", 4),
    ("tp_sp", 4),
    ("zero1", 8),
    ("dp_fsdp", 8),
    ("fsdp_tp", 8),
)
TINY_RECIPES = (("fsdp", 8), ("tp", 4))  # --tiny: a smoke test of every path
BATCH = 8

HEADERS = (
    "recipe",
    "mesh",
    "shardkit total MiB",
    "Flax total MiB",
    "Flax/shardkit total",
    "shardkit unrolled total MiB",
    "analytic total MiB",
    "shardkit/analytic total",
    "analytic peak phase",
    "shardkit state MiB",
    "analytic state MiB",
    "shardkit/analytic state",
    "shardkit wire MiB",
    "Flax wire MiB",
    "Flax/shardkit wire",
    "analytic wire MiB",
    "shardkit/analytic wire",
    "Flax pinned total MiB",
    "Flax pinned wire MiB",
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _flax(config, recipe: str, devices, seq: int, pin: bool) -> tuple | None:
    if recipe not in LAYOUTS:
        return None
    t = time.perf_counter()
    compiled = compile_baseline(config, recipe, devices, batch=BATCH, seq=seq, pin_activations=pin)
    _log(f"  flax{' pinned' if pin else ''} {recipe}: {time.perf_counter() - t:.1f}s")
    return measure(compiled)


def _ratio(a: float | None, b: float | None) -> float | str:
    return a / b if a is not None and b else "—"


def _mib(x: float | None) -> float | str:
    return x * MIB if x is not None else "—"


def _shardkit(model, tx, recipe: str, devices, seq: int, label: str):
    t = time.perf_counter()
    report = build_report(
        sk.Plan(recipe, devices=devices), model=model, tx=tx, batch=BATCH, seq=seq
    )
    _log(f"  {label} {recipe}: {time.perf_counter() - t:.1f}s")
    return report


def row(model, unrolled, tx, recipe: str, n: int, seq: int) -> tuple[list, dict]:
    devices = jax.devices()[:n]
    report = _shardkit(model, tx, recipe, devices, seq, "shardkit")
    flat = _shardkit(unrolled, tx, recipe, devices, seq, "shardkit unrolled")
    flax = _flax(model.config, recipe, devices, seq, pin=False)
    pinned = _flax(model.config, recipe, devices, seq, pin=True)
    a = report.analytic
    a_state = a.memory.params + a.memory.optimizer
    a_wire = sum(a.wire_bytes_by_kind.values())
    sk_total, sk_state, sk_wire = report.memory.total, report.memory.arguments, report.wire_bytes
    fl_total, _, fl_wire, _ = flax or (None,) * 4
    pin_total, _, pin_wire, _ = pinned or (None,) * 4
    cells = [
        recipe,
        "×".join(f"{k}{v}" for k, v in report.mesh.items()),
        _mib(sk_total),
        _mib(fl_total),
        _ratio(fl_total, sk_total),
        _mib(flat.memory.total),
        _mib(a.memory.total),
        _ratio(sk_total, a.memory.total),
        a.memory.to_dict().get("peak_phase", "—"),
        _mib(sk_state),
        _mib(a_state),
        _ratio(sk_state, a_state),
        _mib(sk_wire),
        _mib(fl_wire),
        _ratio(fl_wire, sk_wire),
        _mib(a_wire),
        _ratio(sk_wire, a_wire),
        _mib(pin_total),
        _mib(pin_wire),
    ]
    detail = {
        "recipe": recipe,
        "mesh": report.mesh,
        "shardkit": {"memory": report.memory.to_dict(), "wire_by_kind": report.wire_bytes_by_kind},
        "shardkit_unrolled": {
            "memory": flat.memory.to_dict(),
            "wire_by_kind": flat.wire_bytes_by_kind,
        },
        "analytic": {"memory": a.memory.to_dict(), "wire_by_kind": a.wire_bytes_by_kind},
    }
    for name, m in (("flax", flax), ("flax_pinned", pinned)):
        if m is not None:
            detail[name] = {"total": m[0], "state": m[1], "wire_by_kind": m[3]}
    return cells, detail


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def indivisible_tp(model, seq: int) -> list[str]:
    """The same mistake (8-way TP, heads not divisible by 8) through both paths."""
    heads, n = model.config.n_heads, len(jax.devices())
    out = [f"TP on {n} devices with {heads} heads (first line of each error):"]
    try:
        compile_baseline(model.config, "tp", jax.devices(), batch=BATCH, seq=seq)
        out.append("- Flax: compiled (no error)")
    except Exception as e:  # whatever Flax/JAX raise
        out.append(f"- Flax: `{_first_line(e)}`")
    try:
        build_report(sk.Plan("tp"), model=model, batch=BATCH, seq=seq)
        out.append("- shardkit: compiled (no error)")
    except sk.ShardingError as e:
        out.append(f"- shardkit: `{_first_line(e)}`")
    return out


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    start = time.perf_counter()
    if args.tiny:  # 4 heads so that 8-way TP is the same mistake as 12 heads at full size
        name, overrides, seq = "gpt-tiny", {"n_heads": 4, "n_kv_heads": 4}, 64
    else:
        name, overrides, seq = "gpt-small", {}, 512
    model = get(name, remat="full", **overrides)
    unrolled = get(name, remat="full", scan=False, **overrides)  # the baseline's structure
    if param_count(model.config) != model.config.param_count():
        raise SystemExit("flax_baseline.GPT does not match shardkit's parameter count")
    tx = train.adamw()
    rows, details = [], []
    for recipe, n in TINY_RECIPES if args.tiny else RECIPES:
        _log(f"{recipe} on {n} devices")
        cells, detail = row(model, unrolled, tx, recipe, n, seq)
        rows.append(cells)
        details.append(detail)
    notes = indivisible_tp(model, seq)
    elapsed = time.perf_counter() - start
    _log(f"total {elapsed:.1f}s")
    title = (
        f"Layout quality: {model.name} (Ψ = {model.config.param_count():,}), seq {seq}, "
        f"batch {BATCH}, f32 AdamW, full remat, per device"
    )
    text = emit(
        "layout",
        title,
        HEADERS,
        rows,
        args.out,
        extra={"details": details, "notes": notes, "seconds": elapsed},
    )
    legend = (
        "analytic total = the largest phase peak (`shardkit.report.phases`: layers, head and "
        "loss, optimizer step), the phase named; "
        "state = arguments (params + optimizer state + batch) against the analytic params + "
        'optimizer; "Flax" is the baseline as written (its `nn.with_logical_constraint`s are '
        'silent no-ops under the legacy `with mesh:`), "Flax pinned" passes `mesh=` to them; '
        'shardkit scans the layers, the Flax baseline unrolls them; "shardkit unrolled" is '
        "shardkit with `scan=False`, the baseline's structure (JSON details: its wire bytes)."
    )
    tail = "\n" + legend + "\n\n" + "\n".join(notes) + "\n"
    print(tail, flush=True)
    result = args.out / "layout.json"
    payload = json.loads(result.read_text())
    payload["markdown"] = text + tail
    result.write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
