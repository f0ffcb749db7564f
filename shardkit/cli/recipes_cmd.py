"""``shardkit recipes``: list the recipes, one line each."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from shardkit import recipes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the sharding recipes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    rows = []
    for name in recipes.names():
        r = recipes.get(name)
        mesh = ", ".join(f"{a}={'rest' if s == -1 else s}" for a, s in r.mesh_axes)
        rows.append({"name": name, "mesh": mesh, "summary": r.summary})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="shardkit recipes")
    for column in ("name", "mesh", "summary"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["mesh"], row["summary"])
    Console().print(table)
    return 0
