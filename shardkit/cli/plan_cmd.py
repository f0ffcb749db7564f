"""``shardkit plan``: where every leaf of a model's train state goes, without compiling."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from shardkit.cli import preflight
from shardkit.cli.devices_arg import add_devices_argument, select_devices
from shardkit.cli.model_arg import MODEL_HELP
from shardkit.cli.options import add_json, add_mesh, emit_json, wants_tables
from shardkit.report.lint import human_bytes
from shardkit.report.render import abbreviate

#: Paths are cut from the middle to this width, keeping the leaf name.
PATH_WIDTH = 26


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show each state leaf's logical axes, spec and bytes/device")
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--recipe", default="fsdp")
    add_devices_argument(p)
    p.add_argument("--all", action="store_true", help="include optimizer state and scalars")
    add_mesh(p)
    add_json(p)
    p.set_defaults(handler=main, check=preflight.check)


def main(args: argparse.Namespace) -> int:
    model = preflight.prepare(args)
    devices = select_devices(args.devices)
    import jax

    from shardkit import train
    from shardkit.report.report import param_rows

    plan = preflight.layout(args, args.recipe, model, devices)
    state = plan.abstract_init(train.init_fn(model, train.adamw()), jax.random.key(0))
    rows = [r for r in param_rows(plan, state) if args.all or r.kind == "param"]
    mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    emit_json(
        args,
        {
            "model": args.model,
            "recipe": args.recipe,
            "mesh": mesh,
            "leaves": [{**r.to_json(), "kind": r.kind} for r in rows],
        },
    )
    if not wants_tables(args):
        return 0
    table = Table(title=f"{args.model} under {args.recipe} on {mesh}")
    table.add_column("path", no_wrap=True, min_width=PATH_WIDTH)
    for col in ("shape", "logical axes", "spec", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left")
    for r in rows:
        logical = ", ".join("·" if a is None else a for a in r.logical)
        logical += " (prefix)" if r.prefix else ""
        table.add_row(
            abbreviate(r.path, PATH_WIDTH),
            "×".join(map(str, r.shape)),
            logical,
            r.spec,
            human_bytes(r.bytes_per_device),
        )
    total = sum(r.bytes_per_device for r in rows)
    Console().print(table)
    Console().print(f"{len(rows)} leaves, {human_bytes(total)} per device")
    return 0
