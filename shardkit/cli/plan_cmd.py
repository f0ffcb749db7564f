"""``shardkit plan``: where every leaf of a model's train state goes, without compiling."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardkit.cli import preflight
from shardkit.cli.devices_arg import add_devices_argument, select_devices
from shardkit.cli.model_arg import MODEL_HELP
from shardkit.cli.options import add_json, add_mesh, add_wide, emit_json, wants_tables
from shardkit.report.records import human_bytes
from shardkit.report.tables import BYTES, Column, fit_table, print_table, short_bytes, spec_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show each state leaf's logical axes, spec and bytes/device")
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--recipe", default="fsdp")
    add_devices_argument(p)
    p.add_argument("--all", action="store_true", help="include optimizer state and scalars")
    add_mesh(p)
    add_json(p)
    add_wide(p)
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
    console = Console()
    print_table(console, leaves_table(rows, args, mesh, width=console.width))
    total = sum(r.bytes_per_device for r in rows)
    console.print(f"{len(rows)} leaves, {human_bytes(total)} per device")
    return 0


def _logical(row) -> str:
    """``layers,embed,·``; ``(prefix)`` where the names cover only the leading dimensions."""
    return ",".join(a or "·" for a in row.logical) + (" (prefix)" if row.prefix else "")


def leaves_table(rows, args: argparse.Namespace, mesh: dict[str, int], *, width: int):
    """One line per leaf: its whole path, shape, spec, bytes per device (logical axes
    and the shard's shape where they fit, or with ``--wide``)."""
    columns = [
        Column("path", lambda r: r.path, keep=True),
        Column("shape", lambda r: "×".join(map(str, r.shape)) or "()", priority=1),
        Column("logical axes", _logical, priority=2),
        Column("spec", lambda r: spec_text(r.mesh_axes), keep=True),
        Column("shard", lambda r: "×".join(map(str, r.shard_shape)) or "()", priority=3),
        Column("bytes", lambda r: short_bytes(r.bytes_per_device)),
    ]
    sizes = " × ".join(f"{a}={s}" for a, s in mesh.items())
    return fit_table(
        columns,
        rows,
        width=width,
        wide=args.wide,
        title=f"{args.model} under {args.recipe} on {sizes}",
        caption=f"bytes per device ({BYTES}); spec: the mesh axes splitting each "
        "dimension, · for none",
    )
