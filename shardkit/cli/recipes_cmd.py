"""``shardkit recipes``: list the recipes, one line each."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from shardkit import recipes
from shardkit.cli.options import add_json, check_outputs, emit_json, wants_tables


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the sharding recipes")
    add_json(p)
    p.set_defaults(handler=main, check=check_outputs)


def main(args: argparse.Namespace) -> int:
    rows = []
    for name in recipes.names():
        r = recipes.get(name)
        mesh = ", ".join(f"{a}={'rest' if s == -1 else s}" for a, s in r.mesh_axes)
        rows.append({"name": name, "mesh": mesh, "summary": r.summary})
    check_outputs(args)
    emit_json(args, rows)
    if not wants_tables(args):
        return 0
    table = Table(title="shardkit recipes")
    for column in ("name", "mesh", "summary"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["mesh"], row["summary"])
    Console().print(table)
    return 0
