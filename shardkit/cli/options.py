"""Options every command spells and means the same way: ``--json``, ``--mesh``, outputs.

- ``--json`` prints JSON on stdout instead of the tables; ``--json PATH`` writes it to
  PATH and keeps the tables on the terminal.
- ``--precision f32|bf16``: ``bf16`` is mixed precision (bfloat16 activations and matrix
  products, float32 weights, gradients and Adam state), ``sk.Plan(..., precision=...)``.
- ``--mesh data=2,tensor=4`` sets mesh axis sizes (one may be -1) on top of the recipe's.
- ``--wide`` shows every column of a table; by default the columns that do not fit the
  terminal (``COLUMNS``) are left out and named under it. Names are never cut.
- ``--explicit`` makes the mesh's axes Explicit (JAX's sharding-in-types), not Auto.
- ``--attention ring|allgather|ulysses|usp|dense`` replaces the recipe's attention strategy.
- Output paths (``--json PATH``, ``--plot PNG``) are checked before any work starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from shardkit.figures import INSTALL

__all__ = [
    "add_attention",
    "add_explicit",
    "add_json",
    "add_logits",
    "add_mesh",
    "add_precision",
    "add_seq_and_remat",
    "add_wide",
    "check_outputs",
    "emit_json",
    "mesh_axes_of",
    "parse_mesh",
    "recipe_for",
    "wants_tables",
]


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="JSON on stdout instead of tables; with PATH, write it there as well as the tables",
    )


def add_wide(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide",
        action="store_true",
        help="every column, however wide the terminal (by default the secondary columns "
        "that do not fit are left out and named under the table)",
    )


def add_mesh(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        metavar="AXIS=SIZE,...",
        help="mesh axis sizes on top of the recipe's, e.g. data=2,tensor=4 (one may be -1)",
    )


def add_precision(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=["f32", "bf16"],
        default="f32",
        help="f32, or bf16 mixed precision: bfloat16 activations, float32 weights and Adam "
        "state (default: f32)",
    )


def add_seq_and_remat(parser: argparse.ArgumentParser) -> None:
    """``--seq`` (default: the model's, at most 512) and ``--remat`` (a reference model's
    rematerialization policy), as ``report`` and ``estimate`` take them."""
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: min(512, max_seq))"
    )
    parser.add_argument(
        "--remat",
        choices=["none", "full", "save_dots"],
        default=None,
        help="override a reference model's rematerialization policy",
    )


def add_attention(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attention",
        choices=["ring", "allgather", "ulysses", "usp", "dense"],
        default=None,
        help="how attention treats a sequence split over the recipe's context axis: ring "
        "(K/V blocks around a ring), allgather (K/V gathered), ulysses (all-to-all to a "
        "head split; the heads must divide by the axis), usp (Ulysses × ring, on a recipe "
        "with two context axes: cp_usp), dense (XLA's choice) "
        "(default: the recipe's)",
    )


def add_explicit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="Explicit mesh axes (JAX's sharding in types) instead of Auto",
    )


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
        "--logits",
        choices=["auto", "vocab", "tokens"],
        default=None,
        help="the logits' layout where the recipe splits the vocabulary over an axis that "
        "also splits the tokens (fsdp): auto (default) picks vocab while the step has fewer "
        "tokens than the vocabulary, else tokens",
    )


def recipe_for(
    name: str, args: argparse.Namespace, *, flag: str = "--recipe", others: list[str] | None = None
):
    """The recipe ``name`` with ``--mesh`` sizes (and ``--logits``) applied.

    Raises:
      FlagError: an unknown recipe, or a ``--mesh`` axis no rule of the recipe uses.
    """
    from shardkit import recipes
    from shardkit.cli.fixes import FlagError, closest, mesh_text

    known = recipes.names()
    if name not in known:  # --recipes a,b: only the unknown one changes in the fix
        respell = [
            ",".join(dict.fromkeys(r if x == name else x for x in others or [name]))
            for r in closest(name, known)
        ]
        raise FlagError(
            f"{flag} {name}: no such recipe. Recipes: {', '.join(known)}.",
            [{flag: value} for value in respell],
        )
    recipe = recipes.get(name)
    if getattr(args, "logits", None):
        recipe = recipe.with_logits(args.logits)
    if getattr(args, "attention", None):
        recipe = recipe.with_attention(args.attention)
    mesh = getattr(args, "mesh", None)
    if not mesh:
        return recipe
    used = mesh_axes_of(recipe)
    extra = {a: s for a, s in mesh.items() if a not in used and s != 1}
    if extra:
        axis = next(iter(extra))
        having = [r for r in known if axis in dict(recipes.get(r).mesh_axes)]
        rest = {a: s for a, s in mesh.items() if a not in extra}
        raise FlagError(
            f"--mesh {mesh_text(extra)}: recipe {name} shards nothing over {axis!r} (its mesh "
            f"axes: {', '.join(used)}); recipes with a {axis!r} axis: {', '.join(having)}.",
            [{"--mesh": mesh_text(rest) if rest else None}],
        )
    return recipe.with_mesh(mesh)


def mesh_axes_of(recipe) -> list[str]:
    """The mesh axes ``recipe`` declares or names in any of its rules.

    Example:
      >>> from shardkit import recipes
      >>> mesh_axes_of(recipes.get("fsdp_tp"))
      ['fsdp', 'tensor']
    """
    axes = dict(recipe.mesh_axes)
    for rules in (recipe.rules, recipe.activation_rules, recipe.optimizer_rules):
        for _, mapped in rules or ():
            axes.update(dict.fromkeys((mapped,) if isinstance(mapped, str) else mapped or ()))
    return list(axes)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before any work if ``--json PATH`` or ``--plot PNG`` cannot be written."""
    from shardkit.cli.fixes import FlagError

    for flag, path in (
        ("--json", getattr(args, "json", None)),
        ("--plot", getattr(args, "plot", None)),
    ):
        if path is None or path == "-" or not isinstance(path, str):
            continue
        target = Path(path)
        parent = target.parent
        here = {flag: target.name if target.name else f"{args.command}.json"}
        if target.is_dir():
            raise FlagError(
                f"{flag} {path}: is a directory.",
                [
                    {flag: str(target / f"{args.command}{_suffix(flag)}")},
                    {flag: f"{args.command}{_suffix(flag)}"},
                ],
            )
        if not parent.is_dir():
            raise FlagError(
                f"{flag} {path}: the directory {parent} does not exist (mkdir -p {parent} "
                "makes it).",
                [here],
            )
        if not os.access(parent, os.W_OK):
            raise FlagError(f"{flag} {path}: {parent} is not writable.", [here])
        if flag == "--plot" and target.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise FlagError(
                f"--plot {path}: the figure is written by matplotlib as .png, .svg or .pdf.",
                [{flag: str(target.with_suffix(".png"))}],
            )
        if flag == "--plot" and importlib.util.find_spec("matplotlib") is None:
            raise FlagError(f"--plot {path}: {INSTALL}")


def _suffix(flag: str) -> str:
    return ".png" if flag == "--plot" else ".json"


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
