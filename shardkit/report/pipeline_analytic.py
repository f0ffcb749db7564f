"""What a pipelined step should cost: bubble, stage-to-stage bytes, ZeroPP's weight traffic.

Per device and step, for the engine in :mod:`shardkit.parallel.pipeline` (ring model, as
:mod:`shardkit.report.analytic`; ``B`` bytes per value):

- **bubble**: ``(p − 1)/(m + p − 1)`` (gpipe, 1f1b), ``(p − 1)/(v·m + p − 1)``
  (interleaved). Every stage computes in every tick where any stage has work, so the
  compiled FLOPs per device are the useful ``6·Ψ_stack·tokens/p`` divided by
  ``1 − bubble``.
- **collective-permute**: one activation ``b·s·h·B`` (``b``: a micro-batch's rows on one
  device) forward after each tick with forward work, one gradient of the same size
  backward after each tick with backward work, but the last of each (nobody receives it:
  XLA drops it): ``2·(T − 1)·b·s·h·B`` with ``T = m + p − 1`` ticks of each kind
  (``v·m + p − 1`` interleaved). Only between neighbouring stages (and ``p − 1 → 0`` when
  interleaved).
- **ZeroPP** (``F`` = fsdp size, ``U`` micro-batches per scheduling unit): a stage's
  ``Ψ_stack/p`` weights are all-gathered once per unit and their gradients
  reduce-scattered once: ``2·(Ψ_stack/p)·B·(F − 1)/F·⌈m/U⌉``. (Tang et al. gather twice per
  unit, forward and backward, for ``3·(Ψ/p)·(F − 1)/F·(m/U)``: here one gathered copy
  serves the unit's forwards and backwards, so the unit's weights stay resident.) The
  non-layer parameters (``Ψ_rest``) are gathered and reduce-scattered once per step.
  Under ``precision="bf16"`` a unit's weights are gathered in bfloat16 (the engine casts
  the float32 shards first), half the bytes; the gradients' reduce-scatter stays float32.
- **all-reduce**: a stage's gradient shard over ``data``: ``2·(Ψ_stack/(p·F))·B·(D − 1)/D``;
  the non-layer gradient over ``data × stage`` (it lives on every stage, and only the
  first and last compute it): ``2·(Ψ_rest/F)·B·(n − 1)/n``, ``n = D·p``.

Crossover (Tang et al. 2024): per layer and micro-batch, ZeroPP moves ``36·h²/U`` values
(12h² weights × 3 collectives per unit) where Megatron TP moves ``≈ 8·s·b·h``; ZeroPP
moves less when ``2·s·U·b > 9·h`` (with one gather per unit, as here: ``24·h²/U``, i.e.
``s·U·b > 3·h``).

Example:
  >>> c = pipeline_costs("1f1b", stages=4, microbatches=16, stack_param_bytes=4e8,
  ...                    rest_param_bytes=0, activation_bytes=1e6)
  >>> round(c.bubble, 4), c.wire_bytes_by_kind["collective-permute"]
  (0.1579, 36000000.0)
  >>> zeropp_beats_tp(seq=4096, unit=8, micro_batch=1, d_model=4096)
  True
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

from shardkit.errors import ShardingError
from shardkit.parallel.schedules import SPLIT, bubble_fraction, make
from shardkit.report.formulas import (
    AnalyticMemory,
    AnalyticModel,
    hybrid_wire,
    logits_bytes,
    megatron_activations_per_layer,
)
from shardkit.report.formulas import (
    activation_bytes as value_bytes,
)
from shardkit.report.phases import layer_peak_bytes

__all__ = [
    "PipelineCosts",
    "chunks_a_stage",
    "in_flight",
    "pipeline_costs",
    "pipeline_model",
    "zeropp_beats_tp",
]


@dataclasses.dataclass(frozen=True)
class PipelineCosts:
    """Analytic costs of one pipelined step per device (see the module docstring)."""

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    unit: int | None
    bubble: float
    flops_ratio: float
    wire_bytes_by_kind: dict[str, float]
    state_bytes: float
    notes: tuple[str, ...]


def pipeline_costs(
    schedule: str,
    *,
    stages: int,
    microbatches: int,
    stack_param_bytes: float,
    rest_param_bytes: float,
    activation_bytes: float,
    virtual: int = 1,
    unit: int | None = None,
    fsdp: int = 1,
    data: int = 1,
    optimizer_factor: float = 2.0,
    unit_gather_fraction: float = 1.0,
) -> PipelineCosts:
    """Analytic bubble, wire bytes and state per device of a pipelined step.

    Args:
      schedule: ``gpipe``, ``1f1b``, ``interleaved``, ``zb1`` or ``zbv``.
      stages, microbatches, virtual, unit: ``p``, ``m``, ``v``, ``U`` (``None``: one unit).
      stack_param_bytes: bytes of the whole layer stack (all ``L`` layers).
      rest_param_bytes: bytes of the other parameters (embedding, head, norms).
      activation_bytes: one micro-batch's stage output on one device, ``b·s·h·B``.
      fsdp, data: sizes of the ZeRO-3 axis and of the replica axis.
      optimizer_factor: optimizer state per parameter byte (2 for Adam's two moments).
      unit_gather_fraction: the bytes a unit's all-gather moves per byte of the stored
        stack: 0.5 under bf16 (gathered in bfloat16 from float32 shards), else 1.
    """
    p, m = stages, microbatches
    v = virtual if schedule == "interleaved" else 2 if schedule == "zbv" else 1
    bubble = bubble_fraction(schedule, p, m, v)
    ticks = v * m + p - 1  # ticks with forward work; as many with backward work
    if schedule == "zbv":  # the V's forwards span 2m + 2p − 2 chunk ticks
        ticks = 2 * m + 2 * p - 2
    stage_bytes = stack_param_bytes / p
    units = 1 if unit is None else math.ceil(m / unit)
    f_share = (fsdp - 1) / fsdp
    wire: dict[str, float] = {}
    if p > 1:
        wire["collective-permute"] = 2.0 * (ticks - 1) * activation_bytes
    if fsdp > 1:
        unit_bytes = units * stage_bytes * f_share
        rest = rest_param_bytes * f_share
        wire["all-gather"] = unit_bytes * unit_gather_fraction + rest
        wire["reduce-scatter"] = unit_bytes + rest
    all_reduce = 0.0
    if data > 1:
        all_reduce += 2.0 * stage_bytes / fsdp * (data - 1) / data
    n = data * p
    if n > 1:
        all_reduce += 2.0 * rest_param_bytes / fsdp * (n - 1) / n
    if all_reduce:
        wire["all-reduce"] = all_reduce
    state = (2.0 + optimizer_factor) * (stage_bytes + rest_param_bytes) / fsdp
    notes = (
        f"{schedule}: p={p}, m={m}, v={v}, bubble "
        + ("2(p-1)/(3m+2(p-1))" if schedule in SPLIT else f"(p-1)/({v}m+p-1)")
        + f" = {bubble:.4f}",
        f"collective-permute: 2·({ticks} - 1) ticks × {activation_bytes:,.0f} B",
        f"ZeroPP units: ceil({m}/{unit}) = {units}, gathered at {unit_gather_fraction:g}× "
        "the stored bytes"
        if fsdp > 1
        else "no fsdp axis",
    )
    return PipelineCosts(schedule, p, m, v, unit, bubble, 1.0 / (1.0 - bubble), wire, state, notes)


def zeropp_beats_tp(
    *, seq: int, unit: int, micro_batch: int, d_model: int, gathers_per_unit: int = 3
) -> bool:
    """Tang et al.'s condition: ZeroPP's weight traffic per layer and micro-batch
    (``12·h²·gathers_per_unit/U``) is below Megatron TP's (``8·s·b·h``).

    With the paper's 3 collectives per unit this is ``2·s·U·b > 9·h``.

    Example:
      >>> zeropp_beats_tp(seq=4096, unit=4, micro_batch=1, d_model=4096)
      False
      >>> zeropp_beats_tp(seq=4096, unit=8, micro_batch=1, d_model=4096)
      True
    """
    return 8 * seq * micro_batch * d_model > 12 * d_model**2 * gathers_per_unit / unit


def _crossover_unit(*, seq: int, micro_batch: int, d_model: int, gathers_per_unit: int = 3) -> int:
    """The smallest unit ``U`` for which :func:`zeropp_beats_tp` holds.

    Example:
      >>> _crossover_unit(seq=4096, micro_batch=1, d_model=4096)
      5
    """
    return math.floor(12 * d_model * gathers_per_unit / (8 * seq * micro_batch)) + 1


def chunks_a_stage(pipeline: Mapping[str, Any]) -> int:
    """The layer chunks a stage runs under a pipeline's options: ``virtual_stages``
    under interleaved, zbv's two (its V), else one.

    Example:
      >>> chunks_a_stage({"schedule": "interleaved", "virtual_stages": 3})
      3
      >>> chunks_a_stage({"schedule": "zbv"}), chunks_a_stage({})
      (2, 1)
    """
    schedule = pipeline.get("schedule", "1f1b")
    if schedule == "interleaved":
        return int(pipeline.get("virtual_stages") or 1)
    return 2 if schedule == "zbv" else 1


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """The most work items (micro-batch × chunk of ``L/(p·v)`` layers) a stage holds the
    activations of at once: ``m`` under gpipe, ``min(m, 2p − 1)`` under 1f1b (stage 0).

    Example:
      >>> in_flight("gpipe", 4, 16), in_flight("1f1b", 4, 16), in_flight("1f1b", 4, 2)
      (16, 7, 2)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # m < p: the schedule's own warning, not ours
        return make(schedule, stages, microbatches, virtual).slots


def pipeline_model(
    par: Any,
    workload: Any,
    *,
    pipeline: Mapping[str, Any],
    param_bytes: float,
    optimizer_bytes: float,
    stack_param_bytes: float,
    stack_optimizer_bytes: float,
    bytes_per_value: int = 4,
    label: str = "pipeline",
    tensor_rest_bytes: float | None = None,
    vocab_tables: int = 2,
    gather_bytes: float | None = None,
    vocab_split_head: bool = True,
) -> Any:
    """The analytic model (:class:`shardkit.report.analytic.AnalyticModel`) of a pipelined
    step: what :func:`shardkit.report.analytic.analytic_costs` returns for a recipe with a
    ``stage`` axis.

    State per device: the stage's ``1/p`` of the layer stack and all the other parameters
    (replicated over ``stage``), each divided by ``fsdp`` (the optimizer state also by
    ``data`` under ZeRO-1). Activations (with the model's dimensions): Megatron's per layer
    at the micro-batch ``b = batch/(m·data·fsdp)``, times the ``L/(p·v)`` layers of a work
    item, times the items a stage holds at once (:func:`in_flight`), plus one micro-batch's
    logits. Wire: :func:`pipeline_costs`.

    With a ``tensor`` axis of size ``t`` (TP+SP inside each stage, ``dp_tp_sp_pp``): the
    layer stack and the vocab-parallel tables are split over ``t`` (the rest, e.g. GPT's
    position table, is not); activations are Megatron's ``tp_sp`` at ``t``; the
    stage-to-stage permutes move ``b·s·h/t`` (the sequence is split); and every layer run
    in a tick (``(v·m + p − 1)·L/(p·v)`` per device, the bubble's ticks included: every
    stage computes in every tick) adds TP+SP's all-gathers and reduce-scatters of
    ``b·s·h``, as :func:`shardkit.report.analytic.wire_bytes_hybrid` counts them for
    ``dp_tp_sp`` (6 all-gathers, the backward's re-gathers included, and ``2 +
    in_projections`` reduce-scatters a layer, one more under remat), and each of the ``m``
    micro-batches the vocab-parallel embedding's, head's and cross-entropy's (the head's
    input gather is the stage's code here: ``activation collectives``).

    Args:
      par: the recipe's :class:`shardkit.recipes.recipe.Parallelism` (``stage > 1``).
      workload: the step's :class:`shardkit.workload.Workload`.
      pipeline: ``{"microbatches": m, "schedule": ..., "virtual_stages": v, "unit": U}``
        (what ``shardkit.parallel.cli.options`` gives; a pipelined step's ``.pipeline``).
      param_bytes, optimizer_bytes: all parameters / optimizer state, unsharded.
      stack_param_bytes, stack_optimizer_bytes: the layer stack's part of them.
      tensor_rest_bytes: bytes of the non-layer parameters split over ``tensor`` (default:
        ``vocab_tables`` vocabulary tables, ``vocab·d_model·B`` each).
      vocab_tables: vocabulary tables among the parameters: 1 tied (GPT), 2 untied.
      gather_bytes: the bytes a ZeroPP unit's gather moves per weight (default: the
        compute dtype's, 2 under bf16; XLA:CPU's float normalisation gathers the cast
        weights in f32, 4).
      vocab_split_head: whether the head computes on vocabulary shards over ``tensor``
        (else in the tokens' layout: the tables gathered, no b·s·h pairs for the
        embedding and the head; :meth:`shardkit.recipes.Recipe.step_activation_rules`).

    Raises:
      ShardingError: a sequence or TSP axis next to ``stage``, a tensor axis without
        sequence parallelism or with ``fsdp`` (not modelled).

    Example:
      >>> from shardkit import recipes
      >>> from shardkit.workload import Workload
      >>> par = recipes.get("dp_tp_sp_pp").parallelism({"data": 2, "stage": 2, "tensor": 2})
      >>> w = Workload(batch=8, seq=16, layers=4, d_model=64, n_heads=4, vocab=256)
      >>> m = pipeline_model(par, w, pipeline={"microbatches": 2}, param_bytes=1e6,
      ...                    optimizer_bytes=2e6, stack_param_bytes=8e5, stack_optimizer_bytes=16e5)
      >>> m.wire_bytes_by_kind["collective-permute"]  # 2·(3 − 1) ticks × 2·16·64·4/2 B
      16384.0
    """
    p, f, d, t = par.stage, par.fsdp, par.data, par.tensor
    if par.sequence > 1 or par.tsp > 1 or (t > 1 and (par.tensor_kind != "tp_sp" or f > 1)):
        raise ShardingError(
            f"{label}: the analytic pipeline model covers stage × data × fsdp, and stage × "
            f"data × tensor with sequence parallelism (TP+SP, dp_tp_sp_pp), got {par}.\nFix: "
            "one of those layouts, or read the compiled wire bytes (sk.report.build_report) alone."
        )
    m = int(pipeline["microbatches"])
    schedule = pipeline.get("schedule", "1f1b")
    v = chunks_a_stage(pipeline)
    unit = pipeline.get("unit")
    nb = bytes_per_value
    # bf16: a unit's weights gathered in the compute dtype, 2 bytes of the stored 4
    # (gather_bytes: what a gathered value moves, where the program upcasts it)
    if gather_bytes is None:
        gather_bytes = value_bytes(getattr(workload, "precision", "f32"))
    gather_fraction = gather_bytes / 4
    rest_p, rest_o = param_bytes - stack_param_bytes, optimizer_bytes - stack_optimizer_bytes
    # Per device before fsdp: the stack and the rest's tensor-split part (the vocab-parallel
    # tables) over t; the rest's other part (norms, a position table) whole.
    split = 0.0
    if t > 1:
        split = tensor_rest_bytes
        if split is None:
            split = vocab_tables * (workload.vocab or 0) * (workload.d_model or 0) * nb
        split = min(split, rest_p)
    rest_dev_p = rest_p - split * (t - 1) / t
    rest_dev_o = rest_o - (split / rest_p if rest_p else 0.0) * rest_o * (t - 1) / t
    state = (stack_param_bytes / (p * t) + rest_dev_p) / f
    opt_degree = f * (d if par.data_kind == "zero1" else 1)
    notes = [
        f"{label} as {par}: {schedule}, m={m}, v={v}, U={unit}, B = {nb} bytes per value",
        f"state: the stage's 1/{p} of the stack ({stack_param_bytes:,.0f} B) + the rest "
        f"({rest_p:,.0f} B, replicated over stage), / fsdp {f}; optimizer likewise / {opt_degree}",
    ]
    if t > 1:
        notes.append(
            f"tensor {t}: the stack / {t} (its norms and biases counted as split), the "
            f"rest's {split:,.0f} B of vocabulary tables / {t}, its other "
            f"{rest_p - split:,.0f} B whole"
        )
    b = workload.batch / (m * d * f)
    activations, act_bytes, recomputed = 0.0, 0.0, 0.0
    if workload.has_dims:
        s, h = workload.seq, workload.d_model
        remat = (workload.remat or "none") == "full"
        mode = "full_recompute" if remat else "tp_sp" if t > 1 else "none"
        per_layer = megatron_activations_per_layer(
            s, b, h, workload.n_heads, t=t, mode=mode, bytes_per_value=nb
        )
        if remat:  # a layer's input, kept for its recomputation, is split along the
            per_layer /= t  # sequence over ``tensor`` (as the stage-to-stage permutes)
        items = in_flight(schedule, p, m, v)
        layers = workload.layers / (p * v)
        logits = logits_bytes(b=b, s=s, vocab=workload.vocab, nbytes=nb, t=t)
        activations = items * layers * per_layer + logits
        act_bytes = b * s * h * nb / t
        recomputed = layer_peak_bytes(  # remat "full": the layer being recomputed
            s=s,
            b=b,
            h=h,
            a=workload.n_heads,
            t=t,
            mode="tp_sp" if t > 1 else "none",
            bytes_per_value=nb,
            recompute=remat,
        )
        notes.append(
            f"activations: {items} items in flight × {layers:g} layers × Megatron '{mode}' at "
            f"b={b:g}, s={s}, t={t}, + one micro-batch's logits / {t}; a guide, not a bound"
        )
    else:
        notes.append("activations and stage-to-stage bytes: not modelled (no model dimensions)")
    costs = pipeline_costs(
        schedule,
        stages=p,
        microbatches=m,
        virtual=v,
        unit=unit,
        fsdp=f,
        data=d,
        stack_param_bytes=stack_param_bytes / t,
        rest_param_bytes=rest_dev_p,
        activation_bytes=act_bytes,
        unit_gather_fraction=gather_fraction,
    )
    memory = AnalyticMemory(
        params=state,
        grads=state,
        optimizer=(stack_optimizer_bytes / (p * t) + rest_dev_o) / opt_degree,
        activations=activations,
    )
    # The layers' phase: the state and the activations in flight, the layer being
    # recomputed (remat "full"), and under ZeroPP (fsdp > 1) the stage's stack gathered for
    # its unit (in the gather's dtype) with its gradient, summed whole until the unit's
    # reduce-scatter.
    unit = stack_param_bytes / (p * t) if f > 1 else 0.0
    layers_peak = memory.total + recomputed + unit * (gather_fraction + 1)
    memory = dataclasses.replace(memory, phases={"layers": layers_peak})
    if recomputed or unit:
        notes.append(
            f"layers' peak: the state and activations + {recomputed:,.0f} B of the layer "
            f"being recomputed + {unit:,.0f} B of the stage's stack gathered "
            f"({gather_fraction:g}×) and its gradient"
        )
    wire = {k: x for k, x in costs.wire_bytes_by_kind.items() if x}
    # By wire term: stage-to-stage permutes; ZeroPP's gathers per unit; its reduce-scatter
    # and the replicas' all-reduces reduce gradients.
    names = {
        "collective-permute": "pipeline transfers",
        "all-gather": "weight all-gathers",
        "reduce-scatter": "gradient reductions",
        "all-reduce": "gradient reductions",
    }
    terms: dict[str, float] = {}
    for kind, x in wire.items():
        terms[names[kind]] = terms.get(names[kind], 0.0) + x
    if t > 1 and workload.has_dims:
        tp_wire, tp_notes = _tensor_wire(
            workload,
            t=t,
            b=b,
            ticks=v * m + p - 1,
            layers=workload.layers / (p * v),
            microbatches=m,
            bytes_per_value=nb,
            terms=terms,
            vocab_split_head=vocab_split_head,
            tables=vocab_tables,
        )
        for kind, x in tp_wire.items():
            wire[kind] = wire.get(kind, 0.0) + x
        notes += tp_notes
    elif t > 1:
        notes.append("tensor activation traffic: not modelled (no model dimensions)")
    return AnalyticModel(
        memory=memory, wire_bytes_by_kind=wire, notes=(*notes, *costs.notes), wire_terms=terms
    )


def _tensor_wire(
    workload: Any,
    *,
    t: int,
    b: float,
    ticks: int,
    layers: float,
    microbatches: int,
    bytes_per_value: int,
    terms: dict[str, float],
    vocab_split_head: bool = True,
    tables: int = 2,
) -> tuple[dict[str, float], list[str]]:
    """TP+SP's wire bytes by kind (and by term into ``terms``) of a pipelined step, with the
    formula of the unpipelined ``dp_tp_sp`` (:func:`shardkit.report.formulas.wire_bytes_hybrid`
    on the tensor axis alone): ``ticks·layers`` layer runs of a ``b``-row micro-batch, and
    the embedding, head and loss once per micro-batch."""
    w, runs = workload, ticks * layers
    out: dict[str, float] = {}
    notes = [
        f"tensor {t}: {ticks} ticks × {layers:g} layers = {runs:g} layer runs of b={b:g} "
        f"rows, and {microbatches} × the embedding, head and loss (TP+SP, as dp_tp_sp)"
    ]
    for n, vocab, scale in ((runs, None, 1), (0, w.vocab, microbatches)):
        part: dict[str, float] = {}
        wire, why = hybrid_wire(
            {"tensor": t},
            psi=0.0,
            nbytes=bytes_per_value,
            layers=n,
            b=b,
            s=w.seq,
            h=w.d_model,
            vocab=vocab,
            h_kv=None,
            data_kind="dp",
            tensor_kind="tp_sp",
            recompute=(w.remat or "none") == "full",
            terms=part,
            in_projections=w.in_projections,
            head_term="activation collectives",
            vocab_split_head=vocab_split_head,
            tables=tables,
        )
        for kind, x in wire.items():
            out[kind] = out.get(kind, 0.0) + scale * x
        for term, x in part.items():
            terms[term] = terms.get(term, 0.0) + scale * x
        notes += [f"{note} (× {scale})" if scale != 1 else note for note in why]
    return out, notes
