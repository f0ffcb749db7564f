"""``shardkit reshard-plan --from fsdp@8 --to tp@4 --model M``: a restore's reads, beforehand."""

from __future__ import annotations

import argparse
import re

from rich.console import Console

from shardkit import recipes
from shardkit.cli.fixes import FlagError, closest, problem_of
from shardkit.cli.options import add_json, check_outputs, emit_json, wants_tables
from shardkit.errors import IndivisibleError, MeshError
from shardkit.report.tables import BYTES, Column, fit_table, print_table, short_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reshard-plan",
        help="bytes each device reads when a checkpoint is restored into another layout",
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="RECIPE@N",
        help="the layout that saved, e.g. fsdp@8",
    )
    p.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="RECIPE@N",
        help="the layout to restore into, e.g. tp@4",
    )
    p.add_argument("--model", default="gpt-tiny", help="reference model (default: gpt-tiny)")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes the restoring devices are split over (default 1)",
    )
    add_json(p)
    p.set_defaults(handler=main, check=_states)


def _layout(text: str, flag: str) -> tuple[str, int]:
    recipe, _, count = text.partition("@")
    if not count.isdigit() or int(count) < 1:
        name, digits = re.fullmatch(r"(.*?)(\d*)", text.replace("@", "")).groups()
        raise FlagError(
            f"{flag} {text}: expected RECIPE@DEVICES, e.g. fsdp@8.",
            [{flag: f"{name or 'fsdp'}@{digits or 8}"}, {flag: "fsdp@8"}],
        )
    if recipe not in recipes.names():
        raise FlagError(
            f"{flag} {text}: no such recipe. Recipes: {', '.join(recipes.names())}.",
            [{flag: f"{r}@{count}"} for r in closest(recipe, recipes.names())],
        )
    return recipe, int(count)


def _states(args: argparse.Namespace):
    """The saved and the restored abstract states, and the restoring device count."""
    from shardkit.cli.model_arg import resolve_model

    check_outputs(args)
    source, n_source = _layout(args.source, "--from")
    target, n_target = _layout(args.target, "--to")
    model = resolve_model(args.model)
    if args.processes < 1 or n_target % args.processes:
        raise FlagError(
            f"--processes {args.processes} does not split the {n_target} restoring devices.",
            [
                {"--processes": str(p)}
                for p in range(min(args.processes, n_target), 0, -1)
                if n_target % p == 0
            ],
        )
    from shardkit.cli.devices_arg import select_devices

    devices = select_devices(max(n_source, n_target))
    import jax

    from shardkit import train
    from shardkit.plan import Plan

    init = train.init_fn(model, train.adamw())
    states = []
    for flag, recipe, n in (("--from", source, n_source), ("--to", target, n_target)):
        try:
            plan = Plan(recipe, devices=devices[:n])
            states.append(plan.abstract_init(init, jax.random.key(0)))
        except (IndivisibleError, MeshError) as e:  # the fix is another device count
            nearby = sorted({2**k for k in range(10)} - {n}, key=lambda c: (abs(c - n), c))
            raise FlagError(problem_of(e), [{flag: f"{recipe}@{c}"} for c in nearby[:6]]) from None
    return (*states, devices[:n_target])


def main(args: argparse.Namespace) -> int:
    from shardkit.reshard import reshard_plan

    saved, restored, devices = _states(args)
    n_target = len(devices)
    # Emulated devices share one process; --processes groups them as separate hosts would.
    position = {d.id: i for i, d in enumerate(devices)}
    per_process = n_target // args.processes
    plan = reshard_plan(saved, restored, process_of=lambda d: position[d.id] // per_process)
    emit_json(args, plan.to_json())
    if wants_tables(args):
        _print(plan, args, n_target)
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _ratio(leaf) -> str:
    """What a device reads over what it holds of ``leaf``."""
    return f"{leaf.read_per_device / leaf.held_per_device if leaf.held_per_device else 1.0:.2f}"


def _short_spec(spec: str) -> str:
    """``"P(None, 'tensor')"`` → ``"·,tensor"``: a spec in few columns.

    Example:
      >>> _short_spec("P(None, 'tensor', None)"), _short_spec("P()")
      ('·,tensor,·', '–')
    """
    inner = spec.removeprefix("P(").removesuffix(")").replace("'", "").rstrip(",")
    return ",".join("·" if p.strip() == "None" else p.strip() for p in inner.split(",")) or "–"


def _print(plan, args, n_target) -> None:
    console = Console()
    columns = [
        Column("leaf", lambda leaf: leaf.path, keep=True),
        Column("restored spec", lambda leaf: _short_spec(leaf.restored_spec), keep=True),
        Column("holds", lambda leaf: short_bytes(leaf.held_per_device), keep=True, justify="right"),
        Column("reads", lambda leaf: short_bytes(leaf.read_per_device), keep=True, justify="right"),
        Column("×", _ratio, keep=True, justify="right"),
    ]
    table = fit_table(
        columns,
        plan.leaves,
        width=console.width,
        title=f"restore {args.model}: {args.source} → {args.target}",
        caption=f"bytes per device ({BYTES}); shapes and saved chunks: --json",
    )
    print_table(console, table)
    reads, held = plan.read_by_device, plan.held_by_device
    low, high = _size(min(reads.values())), _size(max(reads.values()))
    console.print(
        f"Each of the {n_target} devices reads {low if low == high else low + ' to ' + high} "
        f"to hold {_size(max(held.values()))}. Peak host memory: "
        f"{_size(plan.peak_host_bytes)} in the largest of {plan.processes} process(es), "
        "with every leaf in flight at once, as orbax restores."
    )
