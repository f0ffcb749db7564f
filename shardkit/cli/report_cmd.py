"""``shardkit report`` and ``shardkit compare``: compile-only layout reports.

``--itemise`` splits the temp memory at its peak into named terms (gradients, gathered
weights, saved activations, ...) next to their analytic values, as
``build_report(..., itemise=True)`` does (``Report.memory_terms``; ``memory_terms`` in
``--json``):

  shardkit report --model gpt-tiny --recipe fsdp --remat full --itemise
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console

from shardkit import recipes
from shardkit.cli import preflight
from shardkit.cli.devices_arg import add_devices_argument, select_devices
from shardkit.cli.model_arg import MODEL_HELP
from shardkit.cli.options import (
    add_attention,
    add_explicit,
    add_json,
    add_logits,
    add_mesh,
    add_precision,
    add_seq_and_remat,
    add_wide,
    emit_json,
    wants_tables,
)
from shardkit.errors import ShardingError
from shardkit.report import build_report


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    add_devices_argument(p)
    add_mesh(p)
    add_attention(p)
    add_explicit(p)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch size (default: one example per device)",
    )
    add_seq_and_remat(p)
    add_precision(p)
    add_logits(p)
    p.add_argument(
        "--itemise",
        action="store_true",
        help="split the temp memory at its peak into named terms (gradients, "
        "gathered weights, saved activations, ...) against the analytic model",
    )
    add_json(p)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="compile one recipe (nothing allocated) and report its costs")
    _common(p)
    p.add_argument("--recipe", default="fsdp")
    p.add_argument("--plot", metavar="PNG", help="also draw memory and wire bytes to PNG")
    from shardkit.parallel.cli import add_arguments

    add_arguments(p)  # --microbatches --schedule --virtual-stages --unit
    p.set_defaults(handler=main_report, check=preflight.check)

    c = sub.add_parser("compare", help="compile several recipes and compare them side by side")
    _common(c)
    c.add_argument(
        "--recipes", default=None, help="comma-separated (default: every recipe that fits)"
    )
    c.add_argument(
        "--plot",
        metavar="PNG",
        help="draw memory and wire bytes per device of every recipe into one figure (.png or .svg)",
    )
    add_wide(c)
    c.set_defaults(handler=main_compare, check=preflight.check)


def _report(model, recipe: str, devices, args):
    from shardkit.parallel.cli import options

    plan = preflight.layout(args, recipe, model, devices)
    return build_report(
        plan,
        model=model,
        batch=args.batch,
        seq=args.seq,
        pipeline=options(args),
        itemise=args.itemise,
    )


def main_report(args: argparse.Namespace) -> int:
    model = preflight.prepare(args)
    devices = select_devices(args.devices)
    start = time.perf_counter()
    report = _report(model, args.recipe, devices, args)
    if args.plot:
        from shardkit.report.plot import plot_reports

        plot_reports({args.recipe: report}, args.plot, title=_title(args, devices))
    emit_json(args, {"model": args.model, **report.to_json()})
    if wants_tables(args):
        console = Console()
        console.print(f"{args.model}, compiled in {time.perf_counter() - start:.1f} s")
        console.print(report)
    return 0


def _title(args: argparse.Namespace, devices) -> str:
    return f"{args.model} on {len(devices)} devices: batch {args.batch}, seq {args.seq}" + (
        f", remat {args.remat}" if args.remat else ""
    )


def main_compare(args: argparse.Namespace) -> int:
    model = preflight.prepare(args)  # checks the recipes --recipes names
    names = preflight.recipe_names(args) or recipes.names()
    devices = select_devices(args.devices)
    args.batch = args.batch or len(devices)
    console = Console(stderr=True)
    reports, skipped = {}, {}
    with console.status("compiling") as status:
        for name in names:
            status.update(f"compiling {name}")
            try:
                reports[name] = _report(model, name, devices, args)
            except ShardingError as e:
                if args.recipes:  # asked for by name: a real error
                    raise
                skipped[name] = str(e).splitlines()[0]
    if args.plot:
        from shardkit.report.plot import plot_reports

        plot_reports(reports, args.plot, title=_title(args, devices), skipped=skipped)
    emit_json(
        args,
        {
            "model": args.model,
            "devices": len(devices),
            "reports": {n: r.to_json() for n, r in reports.items()},
            "skipped": skipped,
        },
    )
    if wants_tables(args):
        from shardkit.report.render import memory_terms_table
        from shardkit.report.tables import print_table

        out = Console()
        print_table(out, comparison_table(reports, width=out.width, wide=args.wide))
        for name, report in reports.items() if args.itemise else ():
            out.print(f"[bold]{name}[/bold]")
            out.print(memory_terms_table(report))
        for name, why in skipped.items():
            out.print(f"[dim]skipped {name}: {why}[/dim]")
    return 0


def comparison_table(reports, *, width: int, wide: bool = False):
    """The reports side by side, one line per recipe, fitted to ``width`` columns."""
    from shardkit.report.tables import BYTES, Column, fit_table, short_bytes

    def ratio(r, key):
        value = r.ratios().get(key)
        return f"{value:.2f}" if value is not None else "–"

    def total_ratio(r):  # against the analytic total only where it has activation terms
        a, w = r.analytic, r.workload
        whole = a is not None and w is not None and w.has_dims and a.memory.total
        return f"{r.memory.total / a.memory.total:.2f}" if whole else "–"

    columns = [
        Column("recipe", lambda x: x[0], keep=True),
        Column("mesh", lambda x: "×".join(f"{k}={v}" for k, v in x[1].mesh.items()), keep=True),
        Column("state", lambda x: short_bytes(x[1].memory.arguments), priority=1),
        Column("temp", lambda x: short_bytes(x[1].memory.temp), priority=1),
        Column("total", lambda x: short_bytes(x[1].memory.total)),
        Column("wire/step", lambda x: short_bytes(x[1].wire_bytes)),
        Column("total/analytic", lambda x: total_ratio(x[1]), priority=3),
        Column("wire/analytic", lambda x: ratio(x[1], "wire_bytes"), priority=2),
        Column("replicated", lambda x: f"{x[1].replicated_fraction:.0%}", priority=4),
        Column("warnings", lambda x: str(len(x[1].warnings)), priority=5),
    ]
    return fit_table(
        columns,
        reports.items(),
        width=width,
        wide=wide,
        title=f"recipes side by side, bytes per device ({BYTES})",
    )
