"""``shardkit recipes``: list the recipes, one line each."""

from __future__ import annotations

import argparse
from textwrap import shorten

from rich.console import Console

from shardkit import recipes
from shardkit.cli.options import add_json, add_wide, check_outputs, emit_json, wants_tables
from shardkit.report.tables import Column, fit_table, print_table, table_width


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the sharding recipes")
    add_json(p)
    add_wide(p)
    p.set_defaults(handler=main, check=check_outputs)


def main(args: argparse.Namespace) -> int:
    rows = []
    for name in recipes.names():
        r = recipes.get(name)
        mesh = ", ".join(f"{a}={'rest' if s == -1 else s}" for a, s in r.mesh_axes)
        rows.append(
            {"name": name, "mesh": mesh, "summary": r.summary, "mesh_axes": list(r.mesh_axes)}
        )
    check_outputs(args)
    emit_json(args, [{k: v for k, v in row.items() if k != "mesh_axes"} for row in rows])
    if not wants_tables(args):
        return 0
    console = Console()
    print_table(console, recipes_table(rows, width=console.width, wide=args.wide))
    return 0


def recipes_table(rows: list[dict], *, width: int, wide: bool = False):
    """One line per recipe: its name whole; its mesh where the summaries fit beside it
    (else with ``--wide``); the summary whole, or cut at a word to fit (``--json`` and
    ``--wide`` have it whole)."""
    name = Column("name", lambda r: r["name"], keep=True)
    summary = Column("summary", lambda r: r["summary"], keep=True)
    mesh = Column("mesh", _mesh, keep=True)
    everything = fit_table([name, mesh, summary], rows, width=width)
    if wide or table_width(everything) <= width:
        return fit_table([name, mesh, summary], rows, width=width, title="shardkit recipes")
    room = max(24, width - table_width(fit_table([name], rows, width=width)) - 2)
    cut = Column("summary", lambda r: shorten(r["summary"], room, placeholder=" …"), keep=True)
    return fit_table(
        [name, cut],
        rows,
        width=width,
        title="shardkit recipes",
        caption="--wide adds: mesh (and the summaries whole)",
    )


def _mesh(row: dict) -> str:
    return ",".join(f"{a}={'rest' if s == -1 else s}" for a, s in row["mesh_axes"])
