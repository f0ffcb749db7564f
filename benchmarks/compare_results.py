"""Compare the compiled memory and wire figures of two sets of benchmark results.

Each side is a folder of ``benchmarks/results``-style JSON files, or ``git:REV`` for the
files committed at a revision. For every file on both sides (or those ``--only`` names),
the script walks the JSON (table rows by their leading cells, lists of records by their
``model``/``recipe``/``seq``/... fields) and compares every field that holds memory or
wire bytes (MiB columns, ``memory``/``wire_by_kind`` records, analytic terms, memory
terms); timings, dates, FLOPs and counts are skipped. It prints one line per difference
and exits 1 when any differs by more than the tolerance (or a row is missing on one side).

The default tolerance is a relative 1e-9: for the same jax/XLA and the same flags a
compile is deterministic (buffer assignment, the collectives and their shapes), so the
bytes agree exactly, and MiB figures only carry float rounding (~1e-16). Any difference
above it is a change of the compiled program or of the analytic model, never noise.

Run: python benchmarks/compare_results.py git:a87cefc /tmp/results [--only layout,tsp]
[--partial] [--rtol 1e-9]  (``--partial``: the after side ran some rows only)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: Fields whose path names one of these hold memory or wire bytes...
MEMORY_OR_WIRE = re.compile(
    r"mib|bytes|total|temp|wire|state|argument|output|alias|activation|param|grad|"
    r"optimizer|phase|memory|all-|reduce|gather|permute|ag\+rs",
    re.IGNORECASE,
)
#: ...unless their own name says they are something else.
NOT_BYTES = re.compile(
    r"second|compile|\bms\b|date|flops|bubble|count|devices|^seq$|^batch$|buffers|ratio|"
    r"^top$|^why$",
    re.IGNORECASE,
)
#: The fields that name a record in a list (its key, not a figure).
ID_FIELDS = ("model", "recipe", "row", "seq", "batch", "devices", "term", "name")
#: Top-level entries that are provenance or prose, not figures.
SKIP = {"machine", "markdown", "head_markdown", "title", "seconds", "notes", "headers"}


def load(side: str, name: str) -> dict | None:
    """``name``.json of one side (a folder, or ``git:REV``), or ``None`` if it has none."""
    if side.startswith("git:"):
        rev = side[4:]
        proc = subprocess.run(
            ["git", "show", f"{rev}:benchmarks/results/{name}.json"],
            capture_output=True,
            text=True,
            cwd=HERE.parent,
        )
        return json.loads(proc.stdout) if proc.returncode == 0 else None
    path = Path(side) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def names(side: str) -> set[str]:
    if side.startswith("git:"):
        out = subprocess.run(
            ["git", "ls-tree", "--name-only", side[4:], "benchmarks/results/"],
            capture_output=True,
            text=True,
            cwd=HERE.parent,
            check=True,
        ).stdout
        return {Path(p).stem for p in out.split() if p.endswith(".json")}
    return {p.stem for p in Path(side).glob("*.json")}


def _row_keys(rows: list[list]) -> list[tuple]:
    """Each row's key: its fewest leading cells that tell all rows apart."""
    for k in range(1, max((len(r) for r in rows), default=1) + 1):
        keys = [tuple(r[:k]) for r in rows]
        if len(set(map(repr, keys))) == len(keys):
            return keys
    return [(i,) for i in range(len(rows))]


def _record_key(record: dict, i: int) -> str:
    ids = [f"{f}={record[f]}" for f in ID_FIELDS if isinstance(record.get(f), (str, int))]
    return ",".join(ids) if ids else str(i)


def flatten(value: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{path: leaf}`` of a result's JSON, table rows keyed by their leading cells."""
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(value, dict):
        if "rows" in value and "headers" in value and not path:
            rows = value["rows"]
            for key, row in zip(_row_keys(rows), rows, strict=True):
                label = " | ".join(map(str, key))
                for header, cell in zip(value["headers"], row, strict=False):
                    out[("rows", label, header)] = cell
        for k, v in value.items():
            if (not path and k in SKIP) or (not path and k == "rows"):
                continue
            out.update(flatten(v, (*path, str(k))))
    elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        keys = [_record_key(x, i) for i, x in enumerate(value)]
        if len(set(keys)) < len(keys):
            keys = [f"{k}#{i}" for i, k in enumerate(keys)]
        for key, x in zip(keys, value, strict=True):
            out.update(flatten(x, (*path, key)))
    else:
        out[path] = value
    return out


def is_figure(path: tuple[str, ...]) -> bool:
    """A memory or wire figure: some component of its path says so, its name no other."""
    if NOT_BYTES.search(path[-1]):
        return False
    if path[0] == "rows":  # a table's cell: its column's header says what it holds
        return bool(MEMORY_OR_WIRE.search(path[-1]))
    return any(MEMORY_OR_WIRE.search(p) for p in path)


def differs(a: Any, b: Any, rtol: float) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return a != b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    return a != b


def compare(
    before: dict, after: dict, rtol: float, partial: bool = False
) -> tuple[int, int, list[tuple]]:
    """(figures compared, figures not regenerated, [(path, before, after)] for each
    difference); ``partial``: a figure only ``before`` has was not regenerated, no
    difference (a run of some rows only)."""
    a, b = flatten(before), flatten(after)
    paths = sorted(p for p in a.keys() | b.keys() if is_figure(p))
    if partial:
        skipped = [p for p in paths if p not in b]
        paths = [p for p in paths if p in b]
    else:
        skipped = []
    missing = object()
    diffs = []
    for p in paths:
        x, y = a.get(p, missing), b.get(p, missing)
        if x is missing or y is missing or differs(x, y, rtol):
            diffs.append((p, "(none)" if x is missing else x, "(none)" if y is missing else y))
    return len(paths), len(skipped), diffs


def _cell(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.6g}" if abs(x) < 1e6 else f"{x:,.0f}"
    return str(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="a results folder, or git:REV")
    p.add_argument("after", help="a results folder, or git:REV")
    p.add_argument("--only", default=None, help="comma-separated result names (layout,tsp)")
    p.add_argument("--rtol", type=float, default=1e-9, help="relative tolerance (1e-9)")
    p.add_argument(
        "--partial",
        action="store_true",
        help="the after side regenerated some rows only: compare those, count the rest",
    )
    args = p.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else names(args.before) & names(args.after)
    bad = 0
    print("| result | row / record | field | before | after | after/before |")
    print("|---|---|---|---|---|---|")
    summary = []
    for name in sorted(wanted):
        before, after = load(args.before, name), load(args.after, name)
        if before is None or after is None:
            side = "before" if before is None else "after"
            summary.append(f"{name}: missing on the {side} side")
            bad += 1
            continue
        n, skipped, diffs = compare(before, after, args.rtol, args.partial)
        not_run = f", {skipped} not regenerated" if skipped else ""
        summary.append(f"{name}: {n} figures compared, {len(diffs)} differ{not_run}")
        for path, x, y in diffs:
            ratio = (
                f"{y / x:.6f}"
                if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x
                else ""
            )
            where = " / ".join(path[1:-1]) or path[0]
            print(f"| {name} | {where} | {path[-1]} | {_cell(x)} | {_cell(y)} | {ratio} |")
        bad += len(diffs)
    print()
    print("\n".join(summary))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
