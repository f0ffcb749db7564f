"""``shardkit run``: train a reference model under a recipe, with progress and a summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shardkit import recipes
from shardkit.cli.devices_arg import add_devices_argument, select_devices
from shardkit.cli.model_arg import MODEL_HELP, resolve_model
from shardkit.errors import ShardingError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a reference model under a recipe")
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--recipe", default="fsdp", help="sharding recipe (default: fsdp)")
    add_devices_argument(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    p.add_argument("--no-report", action="store_true",
                   help="skip the layout report (memory, collectives vs analytic) after the run")  # fmt: skip
    from shardkit.parallel.cli import add_arguments

    add_arguments(p)  # --microbatches --schedule --virtual-stages --unit
    p.set_defaults(handler=main)


def _validate(args: argparse.Namespace):
    model = resolve_model(args.model)
    recipes.get(args.recipe)
    for flag in ("steps", "batch", "seq"):
        if getattr(args, flag) < 1:
            raise ShardingError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    return model


def main(args: argparse.Namespace) -> int:
    model = _validate(args)
    devices = select_devices(args.devices)
    from shardkit.plan import Plan  # imports JAX-heavy modules only once devices are set
    from shardkit.run import run

    plan = Plan(args.recipe, devices=devices, annotations=getattr(model, "annotations", None))
    plan.batch_sharding((args.batch, args.seq), path="--batch/--seq")  # fail before compiling

    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(
            f"{args.model} · {args.recipe} · compiling",
            total=args.steps,
            loss=float("nan"),
            tps=0.0,
        )

        def on_step(step: int, loss: float, tps: float) -> None:
            progress.update(
                task, advance=1, loss=loss, tps=tps, description=f"{args.model} · {args.recipe}"
            )

        result = run(
            model,
            plan,
            steps=args.steps,
            batch=args.batch,
            seq=args.seq,
            learning_rate=args.lr,
            seed=args.seed,
            on_step=on_step,
            pipeline=_pipeline_options(args),
        )
    _print_summary(result)
    if not args.no_report:
        from shardkit.cli.render import print_report

        print_report(result.report, Console(), top=6)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2))
    return 0


def _print_summary(result) -> None:
    mib = 1 / 2**20
    mem = result.memory_per_device_bytes
    table = Table(title=f"shardkit run: {result.model} under {result.recipe}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    mesh = " × ".join(f"{a}={s}" for a, s in result.mesh.items())
    table.add_row("mesh", f"{mesh} ({result.devices} {result.platform} devices)")
    table.add_row(
        "memory / device",
        f"{mem['total'] * mib:,.2f} MiB (arguments {mem['arguments'] * mib:,.2f}, "
        f"temp {mem['temp'] * mib:,.2f}, output {mem['output'] * mib:,.2f}, "
        f"alias {mem['alias'] * mib:,.2f})",
    )
    first, last = result.losses[0], result.losses[-1]
    table.add_row("loss", f"{first:.4f} → {last:.4f} nats/token")
    table.add_row("entropy bound", f"{result.entropy_bound:.4f} nats/token (no model can beat it)")
    table.add_row("gap to bound", f"{last - result.entropy_bound:.4f} nats/token")
    table.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s (after the compile step)")
    Console().print(table)


def _pipeline_options(args: argparse.Namespace):
    from shardkit.parallel.cli import options

    return options(args)
