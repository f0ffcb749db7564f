"""``shardkit autoplan``: rank layouts for a model, a device count and a memory budget."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardkit.autoplanner import hardware
from shardkit.cli.fixes import FlagError, problem_of
from shardkit.cli.model_arg import MODEL_HELP, default_seq, resolve_model
from shardkit.cli.options import (
    add_json,
    add_wide,
    check_outputs,
    emit_json,
    recipe_for,
    wants_tables,
)
from shardkit.errors import ShardingError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "autoplan",
        help="rank recipe × mesh × remat × precision by compiled memory and a roofline step time",
    )
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--devices", type=int, required=True, help="device count to plan for")
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="GiB per device (default: the hardware's memory)",
    )
    p.add_argument("--hardware", default="h100", choices=hardware.names())
    p.add_argument("--batch", type=int, default=None, help="global batch (default: --devices)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--recipes", default=None, help="comma-separated recipes (default: all)")
    p.add_argument(
        "--remat",
        default=None,
        help="comma-separated remat policies to try (default: none,save_dots,full)",
    )
    p.add_argument(
        "--precision",
        default="f32",
        help="comma-separated precisions to try: f32, bf16 (default: f32)",
    )
    p.add_argument(
        "--schedules",
        default=None,
        help="comma-separated pipeline schedules a pipelining recipe is tried with "
        "(default: 1f1b,interleaved,zb1,zbv; gpipe on request)",
    )
    p.add_argument(
        "--compile-top",
        "--max-compiles",
        dest="max_compiles",
        metavar="K",
        type=int,
        default=16,
        help="compile the K best candidates by the pre-compile estimate (sk.estimate; "
        "the analytic memory for a model without dims), the best of each recipe first "
        "(default: 16)",
    )
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=120,
        help="seconds one candidate may take to compile (default: 120)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw memory against step time to PNG")
    add_json(p)
    add_wide(p)
    p.set_defaults(handler=main, check=check)


def _list(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def check(args: argparse.Namespace):
    """The flags autoplan can judge before planning; the model."""
    check_outputs(args)
    model = resolve_model(args.model)
    names = _list(args.recipes) or []
    for name in names:
        recipe_for(name, args, flag="--recipes", others=names)
    if args.devices < 1:
        raise FlagError(f"--devices must be at least 1, got {args.devices}.", [{"--devices": "8"}])
    return model


def main(args: argparse.Namespace) -> int:
    from shardkit.autoplanner import NoLayoutFitsError, autoplan
    from shardkit.autoplanner.candidates import SCHEDULES

    model = check(args)
    try:
        result = autoplan(
            args.model,
            batch=args.batch or args.devices,
            seq=args.seq or default_seq(model),
            devices=args.devices,
            memory_per_device=args.memory_gb * 2**30 if args.memory_gb else None,
            hardware=args.hardware,
            recipes=_list(args.recipes),
            remats=_list(args.remat),
            precisions=_list(args.precision) or ["f32"],
            schedules=_list(args.schedules) or SCHEDULES,
            max_compiles=args.max_compiles,
            compile_timeout_s=args.compile_timeout,
            progress=wants_tables(args),
        )
    except NoLayoutFitsError as e:  # its fix names Python arguments: say it in flags
        raise ShardingError(
            f"{problem_of(e)} Fix: --memory-gb of at least the smallest that would fit, "
            "--devices of a count listed, or a smaller --batch or --seq."
        ) from None
    emit_json(args, result.to_json())
    if args.plot:
        from shardkit.autoplanner.plot import plot_autoplan

        plot_autoplan(result, args.plot)
    if wants_tables(args):
        from shardkit.report.tables import print_table

        console = Console()
        print_table(console, result.table(width=console.width, wide=args.wide))
        for line in result.notes():
            console.print(line)
    return 0
