"""The measured wire bytes split into named terms, each set against its analytic value.

Every collective of the compiled step (:mod:`shardkit.report.hlo`) is given to one
term, first rule that matches, from its kind, pass, source line and shapes against the
state's parameters (:class:`ParamMatch`):

- ``pipeline transfers``: collective-permutes of a layout with a ``stage`` axis, outside
  the attention code;
- ``expert dispatch``: all-to-alls, and collectives of no parameter's shape, made by
  shardkit's mixture-of-experts block (the ``moe`` scopes: tokens sent to their experts
  and the outputs brought home, :mod:`shardkit.nn.moe`);
- ``context-parallel K/V``: collectives made by shardkit's attention block (the
  ``attention`` scopes: ring or all-gather attention over a sequence axis, its zigzag
  reorder);
- ``weight all-gathers``: all-gathers and collective-permutes of a parameter's shape (a
  layer's slice of a stacked weight, whole or gathered over some of its mesh axes);
- ``gradient reductions``: reduce-scatters and all-reduces of a parameter's shape;
- ``logits / loss collectives``: collectives made by shardkit's loss block (the ``loss``
  scopes: the chunked head and its cross-entropy: vocab-parallel statistics, hidden
  states gathered for it; not the head's projection, which is the model's code);
- ``other collectives``: reductions of scalars (the gradient norm, the loss's mean);
- ``activation collectives``: the rest (tensor and sequence parallelism's b·s·h
  all-reduces, or reduce-scatters and all-gathers, a vocab-parallel embedding lookup).

The analytic value of each term comes from the formulas of
:mod:`shardkit.report.analytic` (``AnalyticModel.wire_terms``, recorded term by term as
they add up the bytes by kind). :func:`explain` gives every term off by more than 10 %
(or with no analytic value) one line computed from the collectives in it: how many
times each weight is gathered or its gradient reduced per step and in which passes,
the parameters never gathered or never reduced (and the rule that put them where they
are), reduce-scatters lowered as all-reduce + dynamic-slice, and the largest groups of
collectives by source line with their runs per step.

Example:
  >>> import shardkit as sk
  >>> model = sk.models.get("gpt-tiny", remat="full")
  >>> r = sk.report.build_report(sk.Plan("fsdp"), model=model, batch=8, seq=32)
  >>> sum(t.bytes for t in r.wire_terms) == r.wire_bytes
  True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardkit.dtypes import itemsize
from shardkit.report.hlo import Collective
from shardkit.report.records import TOLERANCE, Explanation, WireTerm, human_bytes

__all__ = [
    "TERMS",
    "ParamMatch",
    "WireTerm",
    "attach_layouts",
    "attribute",
    "explain",
    "term_of",
]

#: The terms, in the order the report lists them.
TERMS = (
    "weight all-gathers",
    "gradient reductions",
    "activation collectives",
    "context-parallel K/V",
    "expert dispatch",
    "logits / loss collectives",
    "pipeline transfers",
    "other collectives",
)

_GATHERS = ("all-gather", "collective-permute")
_REDUCTIONS = ("reduce-scatter", "all-reduce")


def _squeeze(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


@dataclasses.dataclass(frozen=True)
class ParamMatch:
    """The parameters a collective's array may be: by shape, per layer for stacked ones.

    ``of(rows)`` indexes every shape a parameter can have on the wire: its stored shard,
    the whole array, and each partly gathered form (some of its split dimensions whole),
    without the leading ``layers`` dimension of a stacked weight and without 1s, and
    each of those transposed.

    Example:
      >>> from shardkit.report.records import ParamRow
      >>> row = ParamRow("params/layers/mlp/up/kernel", (2, 64, 256), "float32",
      ...                ("layers", "embed", "mlp"), "P(None, 'fsdp')", 0, False, "param",
      ...                shard_shape=(2, 8, 256))
      >>> [r.path for r in ParamMatch.of([row]).rows((64, 256))]
      ['params/layers/mlp/up/kernel']
    """

    by_shape: Mapping[tuple[int, ...], tuple[Any, ...]]

    @classmethod
    def of(cls, rows: Sequence[Any]) -> ParamMatch:
        index: dict[tuple[int, ...], list[Any]] = defaultdict(list)
        for r in rows:
            if r.kind != "param":
                continue
            full, shard = tuple(r.shape), tuple(r.shard_shape or r.shape)
            split = [i for i, (a, b) in enumerate(zip(shard, full, strict=True)) if a != b]
            shapes = set()
            for mask in itertools.product((False, True), repeat=len(split)):
                dims = list(shard)
                for i, whole in zip(split, mask, strict=True):
                    dims[i] = full[i] if whole else shard[i]
                shapes.add(tuple(dims))
                if _layered(r):
                    shapes.add(tuple(dims[1:]))
            for s in shapes:
                for key in (_squeeze(s), ("T", *sorted(_squeeze(s)))):
                    if len(key) > 1 and r not in index[key]:
                        index[key].append(r)
        return cls({k: tuple(v) for k, v in index.items()})

    def rows(self, dims: tuple[int, ...]) -> tuple[Any, ...]:
        """Parameters of this wire shape or of this shape transposed (XLA may move a
        gradient in another layout: ``[3,12,64,768]`` for a ``[768,3,12,64]`` kernel, so an
        MLP's ``[768,2048]`` may be its up or its down kernel)."""
        dims = _squeeze(dims)
        exact = self.by_shape.get(dims, ())
        return exact + tuple(
            r for r in self.by_shape.get(("T", *sorted(dims)), ()) if r not in exact
        )

    def candidates(self, c: Collective, dims: tuple[int, ...]) -> tuple[Any, ...]:
        """The parameters one array of ``c`` may be: those of its shape, narrowed to the
        ones under ``c``'s model path where any is, and to stacked ones where ``c`` runs a
        multiple of the layers times (in the layer loop), else to the others."""
        rows = self.rows(dims)
        if c.kind == "all-gather":  # an all-gather's result is more than the stored shard
            rows = tuple(r for r in rows if not _is_shard(r, dims))
        looped = tuple(r for r in rows if _layered(r) and c.count % _per_layer(r) == 0)
        rows = looped or tuple(r for r in rows if not _layered(r)) or rows
        path = c.module_path
        named = tuple(r for r in rows if path and f"/{path}/" in f"/{r.path}/")
        return named or rows

    def param_of(self, c: Collective) -> Any | None:
        """The first parameter ``c`` moves (:meth:`candidates` of its first array that has
        any), ``None`` if none."""
        for dims in c.shapes:
            rows = self.candidates(c, dims)
            if rows:
                return rows[0]
        return None


def _is_shard(row: Any, dims: tuple[int, ...]) -> bool:
    """Whether ``dims`` is ``row``'s stored shard (or one layer of it), in any order."""
    shard = tuple(row.shard_shape or row.shape)
    if tuple(shard) == tuple(row.shape):
        return False
    forms = [shard, shard[1:]] if _layered(row) else [shard]
    return sorted(_squeeze(dims)) in [sorted(_squeeze(f)) for f in forms]


def _layered(row: Any) -> bool:
    return bool(row.logical) and row.logical[0] == "layers"


def _family(c: Collective) -> str:
    """The building block a collective's innermost shardkit scope names
    (``attention`` for ``attention.ring``), ``""`` for the model's own ops."""
    return c.block.split(".", 1)[0]


def _is_attention(c: Collective) -> bool:
    return _family(c) == "attention"


def _is_loss(c: Collective) -> bool:
    return _family(c) == "loss"


def term_of(c: Collective, params: ParamMatch, *, stages: int = 1) -> str:
    """The wire term of one collective (see the module docstring)."""
    if stages > 1 and c.kind == "collective-permute" and not _is_attention(c):
        return "pipeline transfers"
    if _is_attention(c):
        return "context-parallel K/V"
    row = params.param_of(c)
    if _family(c) == "moe" and (c.kind == "all-to-all" or row is None):
        return "expert dispatch"
    if row is not None and c.kind in _GATHERS:
        return "weight all-gathers"
    if row is not None and c.kind in _REDUCTIONS and c.pass_ in ("backward", "update"):
        return "gradient reductions"
    if _is_loss(c):
        return "logits / loss collectives"
    if c.kind in _REDUCTIONS and all(math.prod(s) <= 1 for s in c.shapes):
        return "other collectives"
    return "activation collectives"


def attribute(
    collectives: Sequence[Collective],
    rows: Sequence[Any],
    *,
    analytic: Mapping[str, float] | None = None,
    stages: int = 1,
) -> list[WireTerm]:
    """The wire bytes of ``collectives`` by term, in :data:`TERMS` order.

    Args:
      collectives: the step's collectives (``Report.collectives``).
      rows: the state's ``ParamRow`` s (their shapes tell weights and gradients).
      analytic: the analytic bytes of each term (``AnalyticModel.wire_terms``).
      stages: the size of the layout's ``stage`` axis (1: no pipeline).

    Returns:
      One ``WireTerm`` per term with measured or analytic bytes; the measured bytes add
      up to the step's wire bytes.
    """
    params = ParamMatch.of(rows)
    by_term: dict[str, list[Collective]] = defaultdict(list)
    for c in collectives:
        by_term[term_of(c, params, stages=stages)].append(c)
    analytic = analytic or {}
    out = []
    for term in TERMS:
        cs = by_term.get(term, [])
        total = float(sum(c.wire_bytes for c in cs))
        if total or analytic.get(term):
            out.append(WireTerm(term, total, analytic.get(term), tuple(cs)))
    return out


def attach_layouts(collectives: Sequence[Collective], rows: Sequence[Any]) -> list[Collective]:
    """``collectives`` with the logical axes of the parameter each moves and the rules
    that shard them (``Collective.logical``, ``Collective.rule``), where one matches.

    ``rule`` lists the ``(logical, mesh_axes)`` pairs the parameter's layout realises:
    its sharded dimensions and the mesh axes the plan's rules put them on (the layout the
    all-gather undoes, or the reduce-scatter restores).
    """
    params = ParamMatch.of(rows)
    out = []
    for c in collectives:
        row = params.param_of(c)
        if row is None:
            out.append(c)
            continue
        out.append(dataclasses.replace(c, logical=tuple(row.logical), rule=_rule_of(row)))
    return out


def _rule_of(row: Any) -> str:
    """``('embed', 'fsdp')``: each sharded dimension's logical name and mesh axes."""
    pairs = []
    for name, axes in zip(row.logical, getattr(row, "mesh_axes", ()) or (), strict=False):
        if axes:
            pairs.append(f"({name!r}, {axes[0]!r})" if len(axes) == 1 else f"({name!r}, {axes!r})")
    return ", ".join(pairs)


def explain(
    terms: Sequence[WireTerm], rows: Sequence[Any], *, tolerance: float = TOLERANCE
) -> list[Any]:
    """One ``Explanation`` per wire term off by more than ``tolerance`` from its analytic
    value (or with none), computed from the collectives in it (module docstring)."""
    params = ParamMatch.of(rows)
    layers = max((_per_layer(r) for r in rows if r.kind == "param" and _layered(r)), default=0)
    out = []
    for t in terms:
        ratio = t.ratio
        if ratio is not None and abs(ratio - 1) <= tolerance:
            continue
        if t.term == "weight all-gathers":
            why = _per_param(t, params, rows, "gathered")
        elif t.term == "gradient reductions":
            why = _per_param(t, params, rows, "reduced")
        else:
            why = _by_source(t, layers=layers)
        if ratio is None:
            head = (
                f"nothing of it is in the analytic model; {human_bytes(t.bytes)} measured"
                if t.bytes
                else "the analytic model counts it; the program moves none"
            )
        else:
            head = f"{human_bytes(t.bytes)} measured vs {human_bytes(t.analytic_bytes)} analytic"
        out.append(
            Explanation(
                t.term, t.bytes, float(t.analytic_bytes or 0.0), f"{head}: {why}" if why else head
            )
        )
    return out


def _full_bytes(row: Any) -> float:

    return math.prod(row.shape) * itemsize(row.dtype)


def _short(path: str) -> str:
    return path.removeprefix("params/")


def _per_layer(row: Any) -> int:
    return row.shape[0] if _layered(row) and row.shape else 1


_PASS_ORDER = ("forward", "remat", "backward", "update", "")


def _per_param(t: WireTerm, params: ParamMatch, rows: Sequence[Any], verb: str) -> str:
    """Runs per step of each parameter's gather (or gradient reduction), by pass; the
    sharded parameters with none; lowered forms."""
    runs: dict[str, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    found: dict[str, Any] = {}
    for c in t.collectives:
        for dims in c.shapes:  # each array of a tuple-combined op is one parameter's
            cands = params.candidates(c, dims)
            for row in cands:  # same shape, same model path: split evenly
                found[row.path] = row
                runs[row.path][(c.pass_, c.kind)] += c.count / _per_layer(row) / len(cands)
    by_pattern: dict[str, list[str]] = defaultdict(list)
    size = {path: math.prod(row.shape) for path, row in found.items()}
    for path, passes in sorted(runs.items(), key=lambda kv: -size[kv[0]]):  # largest first
        total = sum(passes.values())
        split = " + ".join(
            f"{n:.3g} {p or 'other'} {k}"
            for (p, k), n in sorted(passes.items(), key=lambda kv: _PASS_ORDER.index(kv[0][0]))
        )
        by_pattern[f"{total:.3g}× per step ({split})"].append(path)
    parts = []
    for pattern, paths in sorted(by_pattern.items(), key=lambda kv: -sum(map(size.get, kv[1]))):
        names = ", ".join(map(_short, paths[:3]))
        names += f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        parts.append(f"{names} {verb} {pattern}")
    # Sharded parameters (the ones the analytic model gathers or reduces) with none.
    psi = sum(math.prod(r.shape) for r in rows if r.kind == "param") or 1
    if verb == "gathered":
        candidates = [
            r
            for r in rows
            if r.kind == "param" and tuple(r.shard_shape or r.shape) != tuple(r.shape)
        ]
    else:
        candidates = [r for r in rows if r.kind == "param"]
    # (only against an analytic value: a term the model has not has no expected movers)
    missing = [r for r in candidates if r.path not in found and t.analytic_bytes]
    missing.sort(key=lambda r: -math.prod(r.shape))
    for r in missing[:2]:
        share = math.prod(r.shape) / psi
        if share < 0.01:
            break
        rule = _rule_of(r)
        layout = f"the rule {rule} keeps it sharded" if rule else "it is replicated"
        split = [n for n, axes in zip(r.logical, r.mesh_axes or (), strict=False) if axes]
        if verb == "reduced":
            how = "each device computes its shard's gradient whole"
        elif "vocab" in split:
            how = "the program computes with the shard where it lies"
        else:
            how = "no all-gather has its shape, or a layer's (it is read in slices, if at all)"
        if "vocab" in split:
            how += " (vocab-parallel lookup and logits: activations move instead)"
        of = (
            f" (−{share:.0%} of the analytic term: its share of the parameters)"
            if t.analytic_bytes
            else ""
        )
        parts.append(f"{_short(r.path)} {tuple(r.shape)} is never {verb}: {layout} and {how}{of}")
    reduced = {path: {k for _, k in passes} for path, passes in runs.items()}
    both = {k for kinds in reduced.values() for k in kinds}
    if verb == "reduced" and both == {"all-reduce", "reduce-scatter"}:
        # an all-reduce moves 2(N-1)/N of the buffer, twice a reduce-scatter's (N-1)/N
        whole = [found[p] for p, kinds in reduced.items() if "all-reduce" in kinds]
        share = sum(math.prod(r.shape) for r in whole) / psi
        parts.append(
            f"{len(whole)} of {len(reduced)} gradients ({share:.1%} of the "
            "parameters) are all-reduced, which moves twice a reduce-scatter's bytes"
        )
    if verb == "gathered" and t.analytic_bytes:
        # the analytic value in units of "every sharded weight gathered once", each over
        # the devices that split it
        once = sum(
            _full_bytes(r) * (1 - math.prod(r.shard_shape) / math.prod(r.shape)) for r in candidates
        )
        if once:
            parts.append(
                f"the analytic {human_bytes(t.analytic_bytes)} is "
                f"{t.analytic_bytes / once:.3g} gathers of every sharded weight"
            )
    lowered = [c for c in t.collectives if c.lowered_as]
    if lowered:
        parts.append(
            f"{len(lowered)} of {len(t.collectives)} ops are reduce-scatters the CPU "
            f"program runs as {lowered[0].lowered_as} (counted at a reduce-scatter's "
            "bytes)"
        )
    return "; ".join(parts)


def _by_source(t: WireTerm, layers: int = 0, top: int = 3) -> str:
    """The largest groups of the term's collectives by kind, source line, block and
    function, with their runs per step by pass (and per layer, for ``layers`` > 1)."""
    groups: dict[tuple[str, ...], list[Collective]] = defaultdict(list)
    for c in t.collectives:
        where = c.source or c.computation
        groups[(c.kind, where, c.block, c.function or c.module_path)].append(c)
    ranked = sorted(groups.items(), key=lambda kv: -sum(c.wire_bytes for c in kv[1]))
    parts = []
    for (kind, source, block, function), cs in ranked[:top]:
        wire = sum(c.wire_bytes for c in cs)
        runs = sum(c.count for c in cs)
        big = max(cs, key=lambda c: c.wire_bytes)
        by_pass = {p: sum(c.count for c in cs if c.pass_ == p) for p in _PASS_ORDER}
        passes = " + ".join(f"{n} {p or 'other'}" for p, n in by_pass.items() if n)
        if layers > 1 and runs % layers == 0 and runs > layers:
            passes += f"; {runs // layers} per layer"
        arrays = {len(c.shapes) for c in cs}
        of = f" of {max(arrays)} arrays" if max(arrays) > 1 else ""
        parts.append(
            f"{runs} run{'s' if runs != 1 else ''} of {kind}{of} ({passes}, "
            f"largest {big.dtype}{big.shape_text} over {big.group_size}) from {source}"
            f"{f' ({block})' if block else ''}{' in ' + function if function else ''}: "
            f"{human_bytes(wire)}"
        )
    if len(ranked) > top:
        rest = sum(c.wire_bytes for _, cs in ranked[top:] for c in cs)
        parts.append(f"{len(ranked) - top} more groups, {human_bytes(rest)}")
    first = sum(c.wire_bytes for c in ranked[0][1]) if ranked else 0.0
    if t.analytic_bytes and len(parts) > 1 and abs(first / t.analytic_bytes - 1) <= TOLERANCE:
        # the largest group is the analytic formula's traffic; the others are beyond it
        return (
            f"the analytic formula's traffic is {parts[0]} ({first / t.analytic_bytes:.2f}×); "
            "beyond it: " + "; ".join(parts[1:])
        )
    return "; ".join(parts)
