"""Step time from a compiled program: a roofline with overlapped communication.

``time = max(compute + ticks · tick, Σ_collectives (α + wire_bytes / bandwidth(link)))``,
where

- ``compute = max(flops, useful · r / (1 − bubble)) / peak``: the model's useful
  FLOPs per device (below), times ``r = 4/3`` under full remat (one more forward,
  ``2Ψ`` of ``6Ψ``), stretched by the pipeline schedule's bubble
  (:func:`shardkit.parallel.schedules.bubble_fraction`: ``(p−1)/(m+p−1)`` for 1F1B,
  ``(p−1)/(vm+p−1)`` interleaved over ``v`` chunks, ``2(p−1)/(3m+2(p−1))`` for zb1 and
  zbv), at the precision's dense peak. The compiled program's FLOPs (``flops``, XLA's
  cost analysis with each while loop weighted by its trip count,
  :mod:`shardkit.report.flops`) are a floor: they hold the useful work plus elementwise
  work the formula leaves out (measured: gpt-tiny's 4 scanned layers, 1.10x the formula
  below);
- each collective's link is the node's fast link when its first replica group sits in
  one node (devices ``k·n .. k·n+n−1``), the inter-node link otherwise;
- ``α`` is each execution's latency, NCCL's ring model (:mod:`shardkit.autoplanner.hardware`):
  ``collective_latency + steps · step_latency(link)``, with ``2(n − 1)`` steps for an
  all-reduce over ``n`` devices, ``n − 1`` for an all-gather, reduce-scatter or
  all-to-all, one for a collective-permute;
- a pipeline runs its schedule's ticks in lock-step, and a tick cannot start before its
  neighbour's activations arrive: each tick adds one point-to-point latency
  (``collective_latency + step_latency`` of the stage link) to the critical path, not
  hidden behind compute (``tick``; ``ticks`` the schedule's, 1F1B's ``m + 2p − 2``).

Overlap assumption, stated once: full. XLA's GPU and TPU schedulers run collectives
asynchronously beside independent compute, and the estimate assumes all of it
hides; it is a lower bound (a tensor-parallel all-reduce that the next matmul waits
for does not really hide). ``no_overlap_s`` (compute plus communication) is the
upper bound; both are in the JSON. The same assumption holds for every candidate,
so the ranking compares layouts by their larger side: FLOPs (with remat, the pipeline
bubble and ticks) or bytes and latencies on the links they use. Latency is what ranks a
small model: gpt-tiny's step is microseconds of FLOPs, and a layout's collectives and
ticks, not its bytes, decide it.

MFU is the model's useful FLOPs (PaLM's ``6Ψ + 12·L·d·s`` per token, Chowdhery et al.
2022, appendix B; ``6Ψ`` per token for a model without known dimensions) per device,
divided by ``time × peak``.

Example:
  >>> from shardkit.autoplanner.hardware import get
  >>> from shardkit.autoplanner.roofline import crosses_nodes
  >>> crosses_nodes((0, 8), 8), crosses_nodes((8, 9, 15), 8)
  (True, False)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

from shardkit.autoplanner.hardware import Hardware
from shardkit.parallel.schedules import bubble_fraction, make

__all__ = [
    "Estimate",
    "estimate",
    "crosses_nodes",
    "model_flops",
    "bubble",
    "latency",
    "ticks",
    "ring_steps",
]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per step and their parts."""

    step_time_s: float
    compute_s: float
    intra_node_s: float
    inter_node_s: float
    mfu: float
    latency_s: float = 0.0  # the collectives' α, included in intra_node_s + inter_node_s
    ticks_s: float = 0.0  # the pipeline ticks' latency, included in compute_s

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.intra_node_s + self.inter_node_s

    @property
    def comm_s(self) -> float:
        return self.intra_node_s + self.inter_node_s


def crosses_nodes(group: tuple[int, ...], devices_per_node: int) -> bool:
    """True when the devices of a replica group sit in more than one node."""
    return len({d // devices_per_node for d in group}) > 1


def bubble(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Idle fraction of a pipeline running ``schedule`` (``virtual`` chunks a stage under
    ``interleaved``).

    Example:
      >>> bubble(4, 8), round(bubble(4, 8, "interleaved", 2), 3), bubble(1, 8)
      (0.2727272727272727, 0.158, 0.0)
    """
    if stages <= 1:
        return 0.0
    return bubble_fraction(schedule, stages, microbatches, virtual)


@functools.lru_cache(maxsize=256)
def ticks(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> int:
    """Ticks of ``schedule``'s table (:func:`shardkit.parallel.schedules.make`, ``virtual``
    chunks a stage under ``interleaved``), each one point-to-point hop on the critical
    path.

    Example:
      >>> ticks(4, 8), ticks(4, 8, "interleaved", 2)  # interleaved: a tick per chunk
      (14, 38)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # m < p: the schedule's own warning
        return make(schedule, stages, microbatches, virtual).ticks


def ring_steps(kind: str, group_size: int) -> int:
    """Steps of a ring collective over ``group_size`` devices (NCCL's ring algorithm).

    Example:
      >>> ring_steps("all-reduce", 8), ring_steps("all-gather", 8), ring_steps("collective-permute", 8)
      (14, 7, 1)
    """
    if kind == "collective-permute":
        return 1
    n = max(group_size, 1)
    return 2 * (n - 1) if kind == "all-reduce" else n - 1


def latency(kind: str, group_size: int, crosses: bool, hardware: Hardware) -> float:
    """Seconds one execution of a collective takes whatever its bytes (α)."""
    if group_size <= 1 and kind != "collective-permute":
        return 0.0
    steps = ring_steps(kind, group_size)
    return hardware.collective_latency + steps * hardware.step_latency(crosses)


def model_flops(
    *,
    params: float,
    tokens: int,
    layers: int | None = None,
    d_model: int | None = None,
    seq: int | None = None,
) -> float:
    """Useful training FLOPs of one step, all devices (PaLM's formula)."""
    attention = 12 * layers * d_model * seq if None not in (layers, d_model, seq) else 0
    return (6 * params + attention) * tokens


def estimate(
    *,
    flops: float,
    collectives,
    hardware: Hardware,
    precision: str,
    useful_flops: float,
    devices: int,
    stages: int = 1,
    microbatches: int | None = None,
    remat: str | None = None,
    schedule: str = "1f1b",
    virtual: int = 1,
) -> Estimate:
    """The roofline :class:`Estimate` of one device's step.

    Args:
      flops: the compiled step's FLOPs per device, loops weighted by their trip counts.
      collectives: ``(kind, wire_bytes, first_group[, count, group_size])``: wire bytes
        per step, executions per step (default 1) and devices per group (default: the
        first group's, else every device).
      hardware: the accelerator and its links.
      precision: ``"f32"`` or ``"bf16"`` (picks the peak).
      useful_flops: the model's useful FLOPs per device.
      devices: the mesh's device count (a collective with no replica groups spans all).
      stages, microbatches, schedule, virtual: the pipeline (``virtual`` chunks a stage
        under ``interleaved``), for its bubble and ticks.
      remat: ``"full"`` recomputes the forward (``4/3`` of the useful FLOPs).
    """
    peak = hardware.peak_flops(precision)
    idle = bubble(stages, microbatches or 1, schedule, virtual)
    recompute = 4 / 3 if remat == "full" else 1.0
    compute = max(flops, useful_flops * recompute / (1 - idle)) / peak
    intra = inter = alpha = 0.0
    stage_crosses = False
    everything = tuple(range(devices))
    for kind, wire, group, *rest in collectives:
        count = rest[0] if rest else 1
        size = rest[1] if len(rest) > 1 else len(group or everything)
        crosses = crosses_nodes(group or everything, hardware.devices_per_node)
        a = count * latency(kind, size, crosses, hardware)
        alpha += a
        if kind == "collective-permute":
            stage_crosses = stage_crosses or crosses
        if crosses:
            inter += wire / hardware.inter_node_bandwidth + a
        else:
            intra += wire / hardware.intra_node_bandwidth + a
    hops = 0.0
    if stages > 1:
        n_ticks = ticks(stages, microbatches or stages, schedule, virtual)
        hops = n_ticks * latency("collective-permute", 2, stage_crosses, hardware)
    compute += hops
    total = max(compute, intra + inter)
    mfu = useful_flops / (total * peak) if total else 0.0
    return Estimate(total, compute, intra, inter, mfu, alpha, hops)
