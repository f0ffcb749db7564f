"""``shardkit estimate``: a layout's memory per device and wire bytes, without compiling.

The pre-compile estimate (``sk.estimate``, :mod:`shardkit.report.estimator`): each
device's arguments, temp memory at its peak (by the report's term names) and total, and
the wire bytes by collective kind, in about a millisecond; no devices are needed, so
``--devices`` may be any count:

  shardkit estimate --model gpt-7b --recipe fsdp --devices 512 --remat full
  shardkit estimate --model examples.scanned_lm:build --recipe fsdp --devices 256 --json
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from shardkit.cli.model_arg import MODEL_HELP, default_seq, resolve_model
from shardkit.cli.options import (
    add_json,
    add_mesh,
    add_precision,
    add_seq_and_remat,
    emit_json,
    recipe_for,
    wants_tables,
)
from shardkit.errors import ShardingError
from shardkit.report.estimator import estimate
from shardkit.report.records import human_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate", help="estimate one recipe's memory per device and wire bytes (no compile)"
    )
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--recipe", default="fsdp")
    p.add_argument(
        "--devices", type=int, default=8, help="devices of the mesh (any count; default 8)"
    )
    add_mesh(p)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: one per device)")
    add_seq_and_remat(p)
    add_precision(p)
    from shardkit.parallel.cli import add_arguments

    add_arguments(p)  # --microbatches --schedule --virtual-stages --unit
    add_json(p)
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from shardkit.parallel.cli import options

    if args.devices < 1:
        raise ShardingError(f"--devices must be at least 1, got {args.devices}.")
    model = resolve_model(args.model, remat=args.remat)
    recipe = recipe_for(args.recipe, args)
    sizes = recipe.axis_sizes(args.devices)
    batch = args.batch or args.devices
    seq = args.seq or default_seq(model)
    opts = {k: v for k, v in (options(args) or {}).items() if v is not None}
    e = estimate(
        recipe,
        model,
        mesh=sizes,
        batch=batch,
        seq=seq,
        remat=args.remat,
        precision=args.precision,
        pipeline=opts or None,
    )
    emit_json(
        args,
        {
            "model": args.model,
            "recipe": args.recipe,
            "mesh": sizes,
            "batch": batch,
            "seq": seq,
            **e.to_json(),
        },
    )
    if wants_tables(args):
        Console().print(estimate_table(e, f"{args.model} under {args.recipe} on {sizes}"))
    return 0


def estimate_table(e, title: str) -> Table:
    """The estimate's arguments, temp terms at the peak, total and wire bytes."""
    t = Table(title=f"{title}: estimate per device (no compile, {1e3 * e.seconds:.1f} ms)")
    t.add_column("")
    t.add_column("term")
    t.add_column("bytes", justify="right")
    for name, value in e.state.items():
        t.add_row("arguments", name, human_bytes(value))
    for name, value in e.terms.items():
        t.add_row(f"temp ({e.phase})", name, human_bytes(value))
    t.add_row("total", "arguments + temp", human_bytes(e.total), style="bold")
    for kind, value in e.wire_bytes_by_kind.items():
        t.add_row("wire / step", kind, human_bytes(value))
    return t
