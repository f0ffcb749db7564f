"""Step time from a compiled program: a roofline with overlapped communication.

``time = max(compute, Σ_collectives wire_bytes / bandwidth(link))``, where

- ``compute = max(flops, useful · r / (1 − bubble)) / peak``: the model's useful
  FLOPs per device (below), times ``r = 4/3`` under full remat (one more forward,
  ``2Ψ`` of ``6Ψ``), stretched by the pipeline bubble ``(p−1)/(m+p−1)`` (GPipe and
  1F1B), at the precision's dense peak. The compiled program's FLOPs (``flops``, XLA's
  cost analysis with each while loop weighted by its trip count,
  :mod:`shardkit.report.flops`) are a floor: they hold the useful work plus elementwise
  work the formula leaves out (measured: gpt-tiny's 4 scanned layers, 1.10x the formula
  below);
- each collective's link is the node's fast link when its first replica group sits in
  one node (devices ``k·n .. k·n+n−1``), the inter-node link otherwise.

Overlap assumption, stated once: full. XLA's GPU and TPU schedulers run collectives
asynchronously beside independent compute, and the estimate assumes all of it
hides; it is a lower bound (a tensor-parallel all-reduce that the next matmul waits
for does not really hide). ``no_overlap_s`` (compute plus communication) is the
upper bound; both are in the JSON. The same assumption holds for every candidate,
so the ranking compares layouts by their larger side: FLOPs (with remat and the
pipeline bubble) or bytes on the slowest link they use.

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

from shardkit.autoplanner.hardware import Hardware
from shardkit.parallel.schedules import bubble_fraction

__all__ = ["Estimate", "estimate", "crosses_nodes", "model_flops", "bubble"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per step and their parts."""

    step_time_s: float
    compute_s: float
    intra_node_s: float
    inter_node_s: float
    mfu: float

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.intra_node_s + self.inter_node_s

    @property
    def comm_s(self) -> float:
        return self.intra_node_s + self.inter_node_s


def crosses_nodes(group: tuple[int, ...], devices_per_node: int) -> bool:
    """True when the devices of a replica group sit in more than one node."""
    return len({d // devices_per_node for d in group}) > 1


def bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B pipeline (the schedule the planner runs)."""
    return bubble_fraction("1f1b", stages, microbatches) if stages > 1 else 0.0


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
) -> Estimate:
    """The roofline :class:`Estimate` of one device's step.

    Args:
      flops: the compiled step's FLOPs per device, loops weighted by their trip counts.
      collectives: ``(kind, wire_bytes, first_group)`` triples.
      hardware: the accelerator and its links.
      precision: ``"f32"`` or ``"bf16"`` (picks the peak).
      useful_flops: the model's useful FLOPs per device.
      devices: the mesh's device count (a collective with no replica groups spans all).
      stages, microbatches: pipeline shape, for its bubble.
      remat: ``"full"`` recomputes the forward (``4/3`` of the useful FLOPs).
    """
    peak = hardware.peak_flops(precision)
    idle = bubble(stages, microbatches or 1)
    recompute = 4 / 3 if remat == "full" else 1.0
    compute = max(flops, useful_flops * recompute / (1 - idle)) / peak
    intra = inter = 0.0
    everything = tuple(range(devices))
    for _, wire, group in collectives:
        if crosses_nodes(group or everything, hardware.devices_per_node):
            inter += wire / hardware.inter_node_bandwidth
        else:
            intra += wire / hardware.intra_node_bandwidth
    total = max(compute, intra + inter)
    return Estimate(total, compute, intra, inter, useful_flops / (total * peak) if total else 0.0)
