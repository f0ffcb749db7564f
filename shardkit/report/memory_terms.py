"""The measured temp memory at its peak, split into the analytic model's named terms.

:mod:`shardkit.report.buffers` gives the values live where XLA's temp heap peaks. Each
is given to one term, by its defining instruction (opcode, the pass and model path of
its ``op_name``, :mod:`shardkit.report.provenance`), its users and its shape against
the state's parameters, first rule that matches:

- ``gathered weights``: all-gather results of a parameter's shape and same-sized
  copies of them; under a sharded layout, a layer's unreduced gradient (whole
  parameter shape, feeding a reduction): the analytic ``layers`` phase counts both;
- ``gradients``: backward, update or loop-carried values of a parameter's shape;
- ``attention scores``: values of an attention module (a Flax scope named ``attn`` or
  ``attention``) ending in ``[…, s, s]`` (the sequence, whole or local);
- ``logits / loss``: values computed in shardkit's loss block (its ``loss`` scopes: the
  head and its cross-entropy);
- ``collective buffers``: results and operands of other collectives;
- ``recomputation``: the rest of the rematerialised forward (the layer recomputed);
- ``saved activations``: forward values still live (the backward pass reads them),
  and what the rolled pipeline engine's tick loops carry (its residual rings);
- ``activation gradients``: the rest of the backward pass;
- ``other XLA temporaries``: loop counters, masks, constants, copies;
- ``heap fragmentation``: temp heap bytes no value holds at the peak.

The terms add up to ``temp_size_in_bytes``. :func:`analytic_terms` gives the analytic
value of each term that the model has for the phase the peak is in
(:mod:`shardkit.report.phases`), and :func:`explain` one line per term off by more
than 10 %.

Example:
  >>> import shardkit as sk
  >>> r = sk.report.build_report(sk.Plan("fsdp"), model=sk.models.get("gpt-tiny", remat="full"),
  ...                            batch=8, seq=32, itemise=True)
  >>> sum(t.bytes for t in r.memory_terms) == r.memory.temp
  True
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from shardkit import recipes
from shardkit.dims import ModelDims
from shardkit.report.analytic import analytic_model
from shardkit.report.buffers import BufferAssignment, Value
from shardkit.report.formulas import logits_bytes
from shardkit.report.phases import head_weight_copy_bytes, layer_peak_bytes, phase_peaks
from shardkit.report.provenance import blocks_in, module_path_of, pass_of, without_blocks
from shardkit.report.records import TOLERANCE, Explanation, MemoryTerm, human_bytes
from shardkit.scopes import PIPELINE_TICKS, PREFIX

__all__ = ["MemoryTerm", "TERMS", "analytic_terms", "attribute", "explain", "peak_phase_of"]

#: The terms, in the order the report lists them.
TERMS = (
    "gradients",
    "gathered weights",
    "saved activations",
    "recomputation",
    "attention scores",
    "logits / loss",
    "activation gradients",
    "collective buffers",
    "other XLA temporaries",
    "heap fragmentation",
)

#: What each term is, for terms the analytic model has no value of.
_UNMODELLED = {
    "activation gradients": "the analytic model counts the recomputed layer's activations, "
    "not the gradients the backward pass computes from them",
    "collective buffers": "the analytic model has no term for collective inputs and outputs",
    "other XLA temporaries": "loop counters, masks and layout copies are not modelled",
    "heap fragmentation": "space XLA's heap could not pack; not modelled",
}

_COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "all-to-all",
    "all-reduce-start",
    "all-gather-start",
    "collective-permute-start",
)
_REDUCTIONS = ("all-reduce", "reduce-scatter", "all-reduce-start")


def _dims(v: Value) -> tuple[int, ...] | None:
    """The dimensions of a value without its 1s: ``f32[1,8,256]`` → ``(8, 256)``."""
    return None if v.dims is None else _squeeze(v.dims)


def _squeeze(dims: Any) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """Shapes of the parameters: as stored (a shard) and gathered, each per layer too.

    ``stored`` also holds the optimizer state's shards (a gradient reduce-scattered
    under ZeRO-1 has their shape); ``whole`` every shape a sharded parameter has when
    some of its split dimensions are gathered (all of them, or one mesh axis's).
    """

    stored: frozenset[tuple[int, ...]]
    whole: frozenset[tuple[int, ...]]

    @classmethod
    def of(cls, rows: Sequence[Any]) -> _Shapes:
        stored, whole = set(), set()
        for r in rows:
            if r.kind not in ("param", "optimizer"):
                continue
            shard, full = tuple(r.shard_shape or r.shape), tuple(r.shape)
            layered = bool(r.logical) and r.logical[0] == "layers"
            per_layer = (
                (lambda d: [_squeeze(d), _squeeze(d[1:])]) if layered else (lambda d: [_squeeze(d)])
            )
            stored |= {*per_layer(shard)}
            if r.kind != "param" or shard == full:
                continue
            split = [i for i, (a, b) in enumerate(zip(shard, full, strict=True)) if a != b]
            for mask in itertools.product((False, True), repeat=len(split)):
                if any(mask):
                    dims = list(shard)
                    for i, gathered in zip(split, mask, strict=True):
                        dims[i] = full[i] if gathered else shard[i]
                    whole |= {*per_layer(tuple(dims))}
        return cls(frozenset(stored), frozenset(whole - stored))

    def param(self, dims: tuple[int, ...] | None) -> bool:
        return dims is not None and len(dims) > 0 and (dims in self.stored or dims in self.whole)


def _term(v: Value, shapes: _Shapes, gathered: set[str], seq: set[int], head: bool) -> str:
    dims = _dims(v)
    pass_ = pass_of(v.op_name) if v.op_name else ""
    if v.opcode in ("all-gather", "all-gather-start") and shapes.param(dims):
        return "gathered weights"
    if v.instruction in gathered:
        return "gathered weights"
    reduced = any(u in _REDUCTIONS for u in v.users)
    if pass_ == "backward" and reduced and dims in shapes.whole:
        return "gathered weights"
    if shapes.param(dims) and (pass_ in ("backward", "update") or (v.phi or not v.op_name)):
        return "gradients"
    model_scopes = without_blocks(v.op_name)
    attention = "attn" in model_scopes or "attention" in model_scopes.lower()
    if attention and seq and dims and len(dims) >= 2 and set(dims[-2:]) <= seq and pass_:
        return "attention scores"
    if head and pass_:
        return "logits / loss"
    if v.opcode in _COLLECTIVES or any(u in _COLLECTIVES for u in v.users):
        return "collective buffers"
    if pass_ == "remat":
        return "recomputation"
    if pass_ == "forward":
        return "saved activations"
    if pass_ == "backward":
        return "activation gradients"
    if v.opcode == "while" and PREFIX + PIPELINE_TICKS in v.op_name:
        return "saved activations"  # a rolled pipeline's residual rings, carried by its ticks
    return "other XLA temporaries"


def _describe(v: Value) -> str:
    where = module_path_of(v.op_name) or v.instruction
    pass_ = pass_of(v.op_name) if v.op_name else "loop-carried" if v.phi else ""
    return f"{v.shape} {where} ({pass_ + ' ' if pass_ else ''}{v.opcode or 'value'})"


def attribute(
    ba: BufferAssignment,
    rows: Sequence[Any],
    *,
    seq: int | Sequence[int] = (),
    analytic: Mapping[str, float] | None = None,
    top: int = 3,
) -> list[MemoryTerm]:
    """The temp bytes live at the peak of ``ba``, by term (see the module docstring).

    Args:
      ba: the program's buffer assignment.
      rows: the state's ``ParamRow`` s (their shapes tell parameters and gradients apart).
      seq: the sequence length, or lengths (whole and per device): attention scores
        are ``[…, s, s]``.
      analytic: the analytic bytes of each term (:func:`analytic_terms`).
      top: how many of each term's largest buffers to name.

    Returns:
      One ``MemoryTerm`` per term with bytes, in :data:`TERMS` order; their bytes add up
      to ``ba.temp_bytes``.
    """
    shapes = _Shapes.of(rows)
    live = ba.live_temps()
    lengths = {seq} if isinstance(seq, int) else set(seq)
    # Same-sized values computed from a gathered weight are layout copies of it.
    gathered_names = {
        v.instruction
        for v in ba.values
        if v.opcode in ("all-gather", "all-gather-start") and shapes.param(_dims(v))
    }
    sizes = {v.instruction: v.size for v in ba.values}
    copies = {u for v in ba.values if v.instruction in gathered_names for u in v.user_names}
    gathered = {
        name for name in copies if any(sizes.get(g) == sizes.get(name) for g in gathered_names)
    }
    by_term: dict[str, list[Value]] = {}
    for v in live:
        by_term.setdefault(_term(v, shapes, gathered, lengths, _in_loss(v)), []).append(v)
    analytic = analytic or {}
    out = []
    for term in TERMS:
        values = sorted(by_term.get(term, []), key=lambda v: -v.size)
        total = sum(v.size for v in values)
        if term == "heap fragmentation":
            total = ba.temp_bytes - ba.peak_bytes
            top_value = ba.top_value
            if total and top_value is not None and top_value.start is not None:
                then = sum(v.size for v in ba.live_temps(top_value.start))
                where = (
                    f"the heap's top is {_describe(top_value)} at offset "
                    f"{top_value.offset:,}, placed while {then:,} B were live"
                )
                out.append(MemoryTerm(term, total, None, (where,), 0))
                continue
        if total or term in analytic:
            out.append(
                MemoryTerm(
                    term,
                    total,
                    analytic.get(term),
                    tuple(_describe(v) for v in values[:top]),
                    len(values),
                )
            )
    return out


def analytic_terms(
    dims: ModelDims,
    recipe: Any,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    phase: str,
    remat: str = "none",
    bytes_per_value: int = 4,
) -> dict[str, float]:
    """The analytic temp bytes of each term in ``phase`` (the phase the peak is in).

    The terms of :func:`shardkit.report.phases.phase_peaks` beyond the stored state:
    ``gradients`` (ZeRO's gradient shard), ``saved activations`` (Megatron's, less the
    logits), and per phase ``layers``: ``recomputation`` and ``attention scores`` (the
    layer recomputed under full remat: Megatron's per-layer count, its ``5as/h`` term
    the scores) and ``gathered weights`` (under FSDP a layer's weights and their gradient); ``head_loss``:
    ``logits / loss`` and ``gathered weights`` (the head's weight in its own layout); ``optimizer_step``: nothing more (saved activations are freed).

    Example:
      >>> import shardkit as sk
      >>> dims = sk.models.CONFIGS["gpt-tiny"].dims()
      >>> t = analytic_terms(dims, "fsdp", {"fsdp": 8}, batch=8, seq=32, phase="layers",
      ...                    remat="full")
      >>> t["gathered weights"] == 2 * dims.layer_params * 4
      True
    """
    recipe = recipes.get(recipe)
    base = analytic_model(
        dims, recipe, mesh, batch=batch, seq=seq, bytes_per_value=bytes_per_value, remat=remat
    ).memory
    par = recipe.parallelism(mesh)
    d, f, t, c = par.data, par.fsdp, par.tensor, par.sequence * max(par.tsp, 1)
    nb = bytes_per_value
    logits = logits_bytes(b=batch / (d * f), s=seq / c, vocab=dims.vocab, nbytes=nb, t=t)
    out = {"gradients": base.grads}
    if phase == "optimizer_step":
        return out
    out["saved activations"] = base.activations - logits
    if phase == "layers":
        if remat == "full":  # Megatron's per-layer count: sbh·k + 5·a·s²·b/t (scores)
            mode = par.tensor_kind if t > 1 else "none"
            s, b = seq / c, batch / (d * f)
            layer = layer_peak_bytes(
                s=s, b=b, h=dims.d_model, a=dims.n_heads, t=t, mode=mode, bytes_per_value=nb
            )
            out["attention scores"] = 5 * dims.n_heads * s * s * b / t * nb / 2
            out["recomputation"] = layer - out["attention scores"]
        if f > 1:
            out["gathered weights"] = 2 * dims.layer_params * nb / t
    elif phase == "head_loss":
        peaks = phase_peaks(
            dims, recipe, mesh, batch=batch, seq=seq, bytes_per_value=nb, remat=remat, base=base
        )
        state = base.params + base.grads + base.optimizer
        copies = 3 * head_weight_copy_bytes(dims, recipe, mesh, bytes_per_value=nb)
        out["gathered weights"] = copies  # the copy, its gradient, that gradient reduced
        out["logits / loss"] = peaks["head_loss"] - state - out["saved activations"] - copies
    return {k: v for k, v in out.items() if v > 0}


def peak_phase_of(ba: BufferAssignment) -> str:
    """The phase of the step the temp peak is in: ``layers``, ``head_loss`` or
    ``optimizer_step``, from the instruction that runs at the peak (or the value defined
    last before it): computed in shardkit's loss block, the head; outside the differentiated function, the optimizer step; else the layers."""
    named = [v for v in ba.values if v.op_name and v.start is not None]
    at_peak = [v for v in named if v.instruction == ba.peak_instruction]
    before = [v for v in named if v.start <= ba.peak_time]
    if not at_peak and not before:
        return "layers"
    value = at_peak[0] if at_peak else max(before, key=lambda v: v.start or 0)
    if _in_loss(value):
        return "head_loss"
    return "optimizer_step" if pass_of(value.op_name) == "update" else "layers"


def _in_loss(v: Value) -> bool:
    """Computed in shardkit's loss block (its scopes, also where it calls the model's
    head back)."""
    return any(b.split(".", 1)[0] == "loss" for b in blocks_in(v.op_name))


def explain(terms: Sequence[MemoryTerm], phase: str, *, tolerance: float = TOLERANCE) -> list[Any]:
    """One ``Explanation`` per term off by more than ``tolerance`` from its analytic value
    (or with no analytic value), saying what is live and why."""
    modelled = any(t.analytic_bytes for t in terms)
    out = []
    for t in terms:
        ratio = t.ratio
        if ratio is not None and abs(ratio - 1) <= tolerance:
            continue
        what = f"{t.count} buffer{'s' if t.count != 1 else ''} live at the {phase} peak"
        if t.top:
            what += " (" + "; ".join(t.top) + ")"
        if t.term == "heap fragmentation":
            what = "; ".join(t.top) or f"{human_bytes(t.bytes)} of the heap unused at the peak"
        if not t.bytes:
            what, why = f"nothing of it is live at the {phase} peak", ""
        elif not modelled:  # a layout the phase model does not cover (a pipeline)
            why = "the analytic phase model does not cover this layout (no term of it is modelled)"
        elif ratio is None:
            why = _UNMODELLED.get(
                t.term, f"the analytic model has no such term in the {phase} phase"
            )
        else:
            why = _WHY.get(t.term, ("", ""))[0 if ratio > 1 else 1]
        out.append(
            Explanation(
                t.term,
                float(t.bytes),
                float(t.analytic_bytes or 0.0),
                f"{what}; {why}" if why else what,
            )
        )
    return out


#: Why a term is (over, under) its analytic value.
_WHY = {
    "gradients": (
        "whole gradients not reduced yet (a tied embedding's, from the head to "
        "the lookup's backward) and the loop's accumulators, where the analytic "
        "model counts each gradient as its stored shard",
        "at the peak some gradients are not computed yet, or already reduced to a "
        "shard and consumed by the update",
    ),
    "gathered weights": (
        "layout copies of gathered weights and the next weight's gather "
        "live next to the analytic layer and its gradient",
        "XLA gathers each weight just before its use and frees it after, "
        "where the analytic model holds a whole layer and its gradient",
    ),
    "saved activations": (
        "forward values kept beyond Megatron's count (the loss's "
        "per-token statistics, the stacked layer inputs)",
        "the stacked layer inputs are split as the layout splits them (sequence parallelism "
        "splits them over tensor, Megatron's full-recompute 2sbh does not) and XLA frees "
        "what the backward pass has consumed",
    ),
    "recomputation": (
        "f32 temporaries of the recomputed layer beyond Megatron's 16-bit count",
        "XLA frees parts of the recomputed layer before the peak, and fuses others away",
    ),
    "attention scores": (
        "the scores, their softmax and its gradient live at once",
        "XLA fuses the mask and dropout into the softmax",
    ),
    "logits / loss": (
        "more of the chunked head's buffers live than the analytic three f32 chunks of logits",
        "fewer of the head's buffers live at once than the analytic three",
    ),
}
