"""Lint a compiled layout: collectives the recipe did not predict, big replicated
parameters, gradients all-reduced more than once, rules that matched nothing.

Each warning is one line: what, how many bytes, which op (its ``op_name``, i.e.
the module/layer that caused it) and the likely cause.

Example:
  >>> from shardkit.report.hlo import Collective
  >>> c = Collective("all-to-all", 4096, 8, 3584.0, 1, "jit(step)/mlp/down/dot_general", "main",
  ...                "f32", "[1024]")
  >>> unexpected_collectives([c], frozenset({"all-reduce"}), "tp")[0][:45]
  'unexpected all-to-all under tp: 3.5 KiB per d'
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

from shardkit.report.hlo import Collective

__all__ = [
    "human_bytes",
    "reduced_more_than_once",
    "replicated_params",
    "unexpected_collectives",
    "unused_rules",
]

#: Share of a step's wire bytes below which a collective kind is noise (the loss's and
#: the norms' small reductions, which tiny models make look large).
WIRE_THRESHOLD = 0.05

_CAUSES = {
    "all-gather": "XLA gathered a sharded array: a weight read with a layout other than its "
    "own (a missing sk.constrain on the activation next to it, or a logical axis with no "
    "rule), or an activation resharded between layers",
    "all-to-all": "a resharding between two layouts of one array: activation rules that "
    "disagree at a layer boundary, or a missing sk.constrain",
    "all-reduce": "a full reduction where a sharded one was planned: a gradient or "
    "activation whose logical axes are not sharded (a dimension the mesh could not divide, "
    "or a logical axis with no rule)",
    "reduce-scatter": "a reduction into a sharded layout the recipe does not use",
    "collective-permute": "a shift between shardings (slicing or padding a sharded axis)",
}


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def unexpected_collectives(
    collectives: Sequence[Collective], expected: Iterable[str], recipe: str
) -> list[str]:
    """One warning per collective kind the recipe does not predict, if it moves real bytes."""
    expected = frozenset(expected)
    total = sum(c.wire_bytes for c in collectives) or 1.0
    warnings = []
    for kind in sorted({c.kind for c in collectives} - expected):
        ops = [c for c in collectives if c.kind == kind]
        wire = sum(c.wire_bytes for c in ops)
        if wire < WIRE_THRESHOLD * total:
            continue
        top = max(ops, key=lambda c: c.wire_bytes)
        warnings.append(
            f"unexpected {kind} under {recipe}: {human_bytes(wire)} per device per step "
            f"({wire / total:.0%} of the wire, {len(ops)} op(s)); largest "
            f"{top.dtype}{top.shape} from {top.op_name or top.computation!r}. "
            f"Likely cause: {_CAUSES[kind]}."
        )
    return warnings


def replicated_params(rows: Sequence[object], recipe: str, *, min_bytes: int) -> list[str]:
    """Parameters (not optimizer state) of at least ``min_bytes`` left fully replicated."""
    return [
        f"{row.path} {tuple(row.shape)} ({human_bytes(row.bytes_per_device)}) is replicated "
        f"under {recipe}: logical axes {tuple(row.logical)} map to no mesh axis. Fix: "
        "give a dimension a logical name the recipe shards, or add a rule for one."
        for row in rows
        if row.kind == "param" and row.replicated and row.bytes_per_device >= min_bytes
    ]


def unused_rules(rules: Iterable[tuple[str, object]], logical_names: set[str]) -> list[str]:
    """Rules whose logical name no leaf carries (a typo, or a model without that axis)."""
    seen, out = set(), []
    for name, mesh_axes in rules:
        if name not in logical_names and name not in seen:
            seen.add(name)
            out.append(
                f"rule ({name!r}, {mesh_axes!r}) matched no parameter or state leaf "
                "(a misspelt name, or an axis this model does not have)."
            )
    return out


def reduced_more_than_once(
    collectives: Sequence[Collective], rows: Sequence[object], *, min_bytes: int
) -> list[str]:
    """Parameters whose gradient the step all-reduces more than once (a weight read twice).

    A parameter's gradient leaves an all-reduce in its per-device (shard) shape. When a
    step all-reduces buffers of that shape more often than there are parameters with it,
    the model read the weight more than once and XLA reduced each read's partial sum
    apart. Parameters in scanned layers are reduced per layer, in another shape, and are
    not checked.
    """
    reduced: Counter[str] = Counter()
    for c in collectives:
        if c.kind == "all-reduce":
            for dims in re.findall(r"\[[\d,]*\]", c.shape):
                reduced[dims] += c.count
    params = [r for r in rows if r.kind == "param" and r.bytes_per_device >= min_bytes]
    holders = Counter(_dims(r.shard_shape) for r in params)
    out = []
    for r in params:
        dims = _dims(r.shard_shape)
        times = reduced[dims] / holders[dims]
        if times >= 2:
            out.append(
                f"{r.path} {tuple(r.shape)}: its gradient ({human_bytes(r.bytes_per_device)} "
                f"per device) is all-reduced {times:g} times per step. The model reads it "
                "more than once (a tied embedding?) and XLA reduces each read apart. Fix: "
                "read it through sk.per_replica, for one all-reduce per step."
            )
    return out


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"
