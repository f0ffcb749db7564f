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

from shardkit.parallel.schedules import bubble_fraction

__all__ = ["PipelineCosts", "pipeline_costs", "zeropp_beats_tp", "crossover_unit"]


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
) -> PipelineCosts:
    """Analytic bubble, wire bytes and state per device of a pipelined step.

    Args:
      schedule: ``gpipe``, ``1f1b`` or ``interleaved``.
      stages, microbatches, virtual, unit: ``p``, ``m``, ``v``, ``U`` (``None``: one unit).
      stack_param_bytes: bytes of the whole layer stack (all ``L`` layers).
      rest_param_bytes: bytes of the other parameters (embedding, head, norms).
      activation_bytes: one micro-batch's stage output on one device, ``b·s·h·B``.
      fsdp, data: sizes of the ZeRO-3 axis and of the replica axis.
      optimizer_factor: optimizer state per parameter byte (2 for Adam's two moments).
    """
    p, m = stages, microbatches
    v = virtual if schedule == "interleaved" else 1
    bubble = bubble_fraction(schedule, p, m, v)
    ticks = v * m + p - 1  # ticks with forward work; as many with backward work
    stage_bytes = stack_param_bytes / p
    units = 1 if unit is None else math.ceil(m / unit)
    f_share = (fsdp - 1) / fsdp
    wire: dict[str, float] = {}
    if p > 1:
        wire["collective-permute"] = 2.0 * (ticks - 1) * activation_bytes
    if fsdp > 1:
        gather = units * stage_bytes * f_share + rest_param_bytes * f_share
        wire["all-gather"] = gather
        wire["reduce-scatter"] = gather
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
        f"{schedule}: p={p}, m={m}, v={v}, bubble (p-1)/({v}m+p-1) = {bubble:.4f}",
        f"collective-permute: 2·({ticks} - 1) ticks × {activation_bytes:,.0f} B",
        f"ZeroPP units: ceil({m}/{unit}) = {units}" if fsdp > 1 else "no fsdp axis",
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


def crossover_unit(*, seq: int, micro_batch: int, d_model: int, gathers_per_unit: int = 3) -> int:
    """The smallest unit ``U`` for which :func:`zeropp_beats_tp` holds.

    Example:
      >>> crossover_unit(seq=4096, micro_batch=1, d_model=4096)
      5
    """
    return math.floor(12 * d_model * gathers_per_unit / (8 * seq * micro_batch)) + 1
