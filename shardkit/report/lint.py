"""Lint a compiled layout: collectives the recipe did not predict, big replicated
parameters, gradients all-reduced more than once, rules that matched nothing, and
activations whose per-device size grows with the device count.

Each warning is one line: what, how many bytes, which op (its ``op_name``, i.e.
the module/layer that caused it) and the likely cause.

Example:
  >>> from shardkit.report.hlo import Collective
  >>> c = Collective(kind="all-to-all", bytes=4096, group_size=8, wire_bytes=3584.0,
  ...                op_name="jit(step)/mlp/down/dot_general", dtype="f32", shape=(1024,))
  >>> unexpected_collectives([c], frozenset({"all-reduce"}), "tp")[0][:45]
  'unexpected all-to-all under tp: 3.5 KiB per d'
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from shardkit.report.hlo import Collective
from shardkit.report.records import human_bytes
from shardkit.report.wire_terms import ParamMatch, term_of

__all__ = [
    "grows_with_devices",
    "reduced_more_than_once",
    "replicated_params",
    "unexpected_collectives",
    "unused_rules",
]

#: Share of a step's wire bytes below which a collective kind is noise (the loss's and
#: the norms' small reductions, which tiny models make look large).
_WIRE_THRESHOLD = 0.05

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


def unexpected_collectives(
    collectives: Sequence[Collective],
    expected: Iterable[str],
    recipe: str,
    rows: Sequence[object] = (),
) -> list[str]:
    """One warning per collective kind the recipe does not predict, if it moves real bytes.

    The warning names the wire term of its largest op (:mod:`shardkit.report.wire_terms`,
    the vocabulary of the report's explanations; ``rows``, the state's ``ParamRow`` s,
    tell a weight or a gradient from an activation) and the parameter it moves.
    """
    params = ParamMatch.of(rows)
    expected = frozenset(expected)
    total = sum(c.wire_bytes for c in collectives) or 1.0
    warnings = []
    for kind in sorted({c.kind for c in collectives} - expected):
        ops = [c for c in collectives if c.kind == kind]
        wire = sum(c.wire_bytes for c in ops)
        if wire < _WIRE_THRESHOLD * total:
            continue
        top = max(ops, key=lambda c: c.wire_bytes)
        row = params.param_of(top)
        moves = f" of {row.path}" if row is not None else ""
        warnings.append(
            f"unexpected {kind} under {recipe}: {human_bytes(wire)} per device per step "
            f"({wire / total:.0%} of the wire, {len(ops)} op(s)); largest "
            f"{top.dtype}{top.shape_text} from {top.op_name or top.computation!r} (wire "
            f"term: {term_of(top, params)}{moves}). Likely cause: {_CAUSES[kind]}."
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
    collectives: Sequence[Collective], rows: Sequence[object], *, devices: int, min_bytes: int
) -> list[str]:
    """Parameters whose gradient the step all-reduces more than once (a weight read twice).

    A parameter's gradient leaves an all-reduce in its per-device (shard) shape, or
    that shape transposed, once per step. It is reduced over at most the
    ``devices / shards`` devices that hold copies of the parameter: one all-reduce
    over all of them, or one per mesh axis, whose group sizes multiply to at most
    that. When the all-reduces of that shape add up to more, in log2 of the group
    sizes, the model read the weight more than once and XLA reduced each read's
    partial sum apart.

    Not checked: all-reduces inside loops (scanned layers reduce per layer, in another
    shape), reduce-scatters (a weight read twice under FSDP), and parameters of at
    most ``min_bytes``. Parameters sharing a shard shape share its all-reduces
    evenly, so one of several such weights read twice may go unflagged.
    """
    reduced: list[tuple[tuple[int, ...], int]] = []
    for c in collectives:
        if c.kind == "all-reduce" and c.count == 1 and c.group_size > 1:
            for dims in c.shapes:
                reduced.append((_key(dims), c.group_size))
    params = [r for r in rows if r.kind == "param" and r.bytes_per_device > min_bytes]
    holders = Counter(_key(r.shard_shape) for r in params)
    out = []
    for r in params:
        key = _key(r.shard_shape)
        copies = devices * math.prod(r.shard_shape) // max(math.prod(r.shape), 1)
        if copies < 2:
            continue
        # An all-reduce over more devices than hold copies reduces something else.
        bits = sum(math.log2(g) for k, g in reduced if k == key and g <= copies)
        times = bits / holders[key] / math.log2(copies)
        if times >= 1.5:
            out.append(
                f"{r.path} {tuple(r.shape)}: its gradient ({human_bytes(r.bytes_per_device)} "
                f"per device) is all-reduced {times:.3g} times per step. The model reads it "
                "more than once (a tied embedding?) and XLA reduces each read apart. Fix: "
                "read it through sk.per_replica, for one all-reduce per step."
            )
    return out


def _key(shape: Iterable[int]) -> tuple[int, ...]:
    """A shape up to transposition (XLA may reduce a gradient in either layout)."""
    return tuple(sorted(shape))


def grows_with_devices(
    recipe: object, mesh: dict[str, int], workload: object, collectives: Sequence[Collective] = ()
) -> list[str]:
    """Activations gathered over an axis that splits the tokens: per-device memory that
    grows with the device count.

    An activation rule that splits the logits' vocabulary over a mesh axis that also
    splits the tokens (``fsdp``'s ``("vocab", "fsdp")``) makes each device gather the
    hidden states of every token on that axis: ``T_g·d_model`` values per device, with
    ``T_g`` = tokens per device × the axis's size (``Recipe.gathered_tokens``). At a fixed
    batch per device, doubling the devices doubles ``T_g``: those bytes grow with N where
    every other activation stays put. Flagged when the step uses that layout and
    ``T_g`` exceeds the vocabulary (the head's weight, ``vocab·d_model``, is then
    the smaller thing to gather). The all-gather of the compiled program that moves them
    is named when one matches ``T_g·d_model`` elements.

    Example:
      >>> from shardkit import recipes
      >>> from shardkit.workload import Workload
      >>> w = Workload(batch=64, seq=2048, layers=32, d_model=4096, n_heads=32, vocab=50688)
      >>> print(grows_with_devices(recipes.get("fsdp").with_logits("vocab"), {"fsdp": 64}, w)[0][:60])
      activation grows with the device count under fsdp: the logit
      >>> grows_with_devices(recipes.get("fsdp"), {"fsdp": 64}, w)   # auto: split over tokens
      []
    """
    seq, vocab, d = getattr(workload, "seq", None), getattr(workload, "vocab", None), None
    d = getattr(workload, "d_model", None)
    if not seq or not vocab or not d:
        return []
    tokens = workload.batch * seq
    rules = recipe.step_activation_rules(mesh, tokens=tokens, vocab=vocab)
    gather = [
        a
        for a in recipe.vocab_gather_axes(mesh)
        if any(
            name == "vocab" and a in ((axes,) if isinstance(axes, str) else axes or ())
            for name, axes in rules
        )
    ]
    if not gather:
        return []
    gathered = recipe.gathered_tokens(mesh, tokens)
    if gathered <= vocab:
        return []
    nb = 2 if getattr(workload, "precision", "f32") == "bf16" else 4
    hidden, weight = gathered * d * nb, vocab * d * nb
    n = math.prod(mesh.get(a, 1) for a in gather)
    where = ""
    matches = [c for c in collectives if c.kind == "all-gather" and c.elements == gathered * d]
    if matches:
        top = max(matches, key=lambda c: c.bytes)
        where = (
            f" The compiled program gathers them: {top.dtype}{top.shape_text} from {top.op_name!r}."
        )
    axes = ", ".join(repr(a) for a in gather)
    return [
        f"activation grows with the device count under {recipe.name}: the logits (batch, "
        f"length, vocab) are split over the vocabulary on {axes}, which also splits the "
        f"tokens, so each device gathers the hidden states of {gathered:,.0f} tokens "
        f"({human_bytes(hidden)} per device, and as much again for their gradient; "
        f"{human_bytes(2 * hidden)} on {2 * n} devices at the same batch per device) where "
        f"the head's weight ({vocab:,} × {d:,}) is {human_bytes(weight)}.{where} Cause: "
        f"the activation rule ('vocab', {gather[0]!r}) with {gathered:,.0f} tokens gathered "
        f"> vocabulary {vocab:,}. Fix: recipe.with_logits('auto') (the default: split "
        "the logits over the tokens past that point) or 'tokens'."
    ]
