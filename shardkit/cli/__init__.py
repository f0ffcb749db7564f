"""The ``shardkit`` command line: ``run``, ``report``, ``compare``, ``estimate``, ``plan``,
``autoplan``, ``recipes``, ``launch``, ``reshard-plan``.

Each subcommand lives in its own module and exposes ``add_parser(subparsers)``
and ``main(args) -> int``. User mistakes exit with status 2 and one line whose "Fix:"
is a command line that passes the command's checks (``shardkit.cli.fixes``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardkit.cli import (
    autoplan_cmd,
    estimate_cmd,
    launch_cmd,
    plan_cmd,
    recipes_cmd,
    report_cmd,
    reshard_cmd,
    run_cmd,
)
from shardkit.errors import ShardingError

__all__ = ["build_parser", "main"]

_COMMANDS = (
    run_cmd,
    report_cmd,
    estimate_cmd,
    plan_cmd,
    autoplan_cmd,
    recipes_cmd,
    launch_cmd,
    reshard_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="Shard Flax models by logical axis names; see what each device holds.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ShardingError as e:
        from shardkit.cli.fixes import explain

        print(f"shardkit {args.command}: error: {explain(e, argv, args)}", file=sys.stderr)
        return 2
