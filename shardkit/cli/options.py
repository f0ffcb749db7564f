"""Options every command spells and means the same way: ``--json``, ``--mesh``, outputs.

- ``--json`` prints JSON on stdout instead of the tables; ``--json PATH`` writes it to
  PATH and keeps the tables on the terminal.
- ``--precision f32|bf16``: ``bf16`` is mixed precision (bfloat16 activations and matrix
  products, float32 weights, gradients and Adam state), ``sk.Plan(..., precision=...)``.
- ``--mesh data=2,tensor=4`` sets mesh axis sizes (one may be -1) on top of the recipe's.
- ``--explicit`` makes the mesh's axes Explicit (JAX's sharding-in-types), not Auto.
- Output paths (``--json PATH``, ``--plot PNG``) are checked before any work starts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from shardkit.errors import ShardingError

__all__ = ["add_explicit", "add_json", "add_logits", "add_mesh", "add_precision", "check_outputs",
           "emit_json", "parse_mesh", "recipe_for", "wants_tables"]  # fmt: skip


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH",
        help="JSON on stdout instead of tables; with PATH, write it there as well as the tables",
    )  # fmt: skip


def add_mesh(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh", type=parse_mesh, default=None, metavar="AXIS=SIZE,...",
        help="mesh axis sizes on top of the recipe's, e.g. data=2,tensor=4 (one may be -1)",
    )  # fmt: skip


def add_precision(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision", choices=["f32", "bf16"], default="f32",
        help="f32, or bf16 mixed precision: bfloat16 activations, float32 weights and Adam "
        "state (default: f32)",
    )  # fmt: skip


def add_explicit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explicit", action="store_true",
        help="Explicit mesh axes (JAX's sharding in types) instead of Auto",
    )  # fmt: skip


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=4"`` → ``{"data": 2, "tensor": 4}``.

    Example:
      >>> parse_mesh("data=-1,tensor=4")
      {'data': -1, 'tensor': 4}
    """
    axes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        try:
            value = int(size)
        except ValueError:
            value = None
        if not sep or not name or value is None or name in axes:
            raise argparse.ArgumentTypeError(
                f"{text!r}: each axis is NAME=SIZE, once (e.g. --mesh data=2,tensor=4)"
            )
        axes[name] = value
    if not axes:
        raise argparse.ArgumentTypeError(f"{text!r} names no axis: each is NAME=SIZE (e.g. data=2)")
    return axes


def add_logits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--logits", choices=["auto", "vocab", "tokens"], default=None,
        help="the logits' layout where the recipe splits the vocabulary over an axis that "
        "also splits the tokens (fsdp): auto (default) picks vocab while the step has fewer "
        "tokens than the vocabulary, else tokens",
    )  # fmt: skip


def recipe_for(name: str, args: argparse.Namespace):
    """The recipe ``name`` with ``--mesh`` sizes (and ``--logits``) applied."""
    from shardkit import recipes

    recipe = recipes.get(name)
    if getattr(args, "logits", None):
        recipe = recipe.with_logits(args.logits)
    return recipe.with_mesh(args.mesh) if getattr(args, "mesh", None) else recipe


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before any work if ``--json PATH`` or ``--plot PNG`` cannot be written."""
    for flag, path in (
        ("--json", getattr(args, "json", None)),
        ("--plot", getattr(args, "plot", None)),
    ):
        if path is None or path == "-":
            continue
        target = Path(path)
        parent = target.parent
        if target.is_dir():
            raise ShardingError(f"{flag} {path}: is a directory.\nFix: give a file name.")
        if not parent.is_dir():
            raise ShardingError(
                f"{flag} {path}: the directory {parent} does not exist.\nFix: create it first "
                f"(mkdir -p {parent}) or choose another path."
            )
        if not os.access(parent, os.W_OK):
            raise ShardingError(f"{flag} {path}: {parent} is not writable.\nFix: another path.")
        if flag == "--plot" and target.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise ShardingError(
                f"--plot {path}: the figure is written by matplotlib as .png, .svg or .pdf.\n"
                f"Fix: --plot {target.with_suffix('.png')}."
            )


def wants_tables(args: argparse.Namespace) -> bool:
    """True unless ``--json`` alone asked for JSON on stdout instead."""
    return getattr(args, "json", None) != "-"


def emit_json(args: argparse.Namespace, data: Any) -> None:
    """Print ``data`` (``--json``) or write it to PATH (``--json PATH``); nothing otherwise."""
    if args.json is None:
        return
    text = json.dumps(data, indent=None if args.json == "-" else 2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text)
