"""Accelerators the planner's roofline knows: peak FLOP/s, memory, link bandwidths.

Every number cites its source (``Hardware.sources``). The roofline reads a device's
dense matmul peak at the step's precision (TF32 tensor cores for f32 matmuls on
NVIDIA GPUs, which XLA uses at JAX's default precision; bf16 otherwise), and one
bandwidth per link class: ``intra_node`` for collectives whose replica group stays
inside one node (NVLink, TPU ICI), ``inter_node`` for groups that span nodes
(InfiniBand). Bandwidths are one direction per device: a ring collective sends
``wire_bytes`` each way, so its time is ``wire_bytes / bandwidth``.

Latency (the α of an α–β model), NCCL's own model of a ring collective
(``src/graph/tuning.cc``, low-latency protocol): a fixed ``collective_latency`` per
collective plus a per-step latency for each of the ring's steps over the link it
crosses (``intra_node_latency``: NVLink; ``inter_node_latency``: the network).

The ``cpu`` entry is measured on this machine when first used (a matmul and a
memory copy), since a CPU has no datasheet figure that means anything here.

Example:
  >>> from shardkit.autoplanner.hardware import get
  >>> h100 = get("h100")
  >>> h100.memory_bytes // 2**30, h100.devices_per_node
  (80, 8)
  >>> round(h100.peak_flops("bf16") / 1e12)
  989
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from shardkit.errors import ShardingError

__all__ = [
    "GB",
    "GIB",
    "HARDWARE",
    "Hardware",
    "get",
    "names",
]

GB = 10**9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator type in a cluster of identical nodes.

    Attributes:
      name: the ``--hardware`` name.
      bf16_flops, f32_flops: dense matmul peak per device, FLOP/s.
      memory_bytes: device memory.
      intra_node_bandwidth: bytes/s one way per device over the node's fast links.
      inter_node_bandwidth: bytes/s one way per device across nodes.
      devices_per_node: devices that share the fast links (mesh devices are numbered
        so that devices ``k·n .. k·n+n−1`` form node ``k``).
      sources: where each number comes from.
      collective_latency: seconds every collective takes whatever its size (α's base).
      intra_node_latency, inter_node_latency: seconds per ring step over the node's
        fast links and across nodes (a ring all-reduce of ``n`` takes ``2(n − 1)``
        steps, an all-gather or reduce-scatter ``n − 1``, a permute one).
    """

    name: str
    bf16_flops: float
    f32_flops: float
    memory_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    sources: tuple[str, ...] = ()
    collective_latency: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_latency: float = 0.0

    def peak_flops(self, precision: str) -> float:
        """Dense matmul peak for ``precision`` (``"f32"`` or ``"bf16"``)."""
        return self.bf16_flops if precision == "bf16" else self.f32_flops

    def bandwidth(self, crosses_nodes: bool) -> float:
        return self.inter_node_bandwidth if crosses_nodes else self.intra_node_bandwidth

    def step_latency(self, crosses_nodes: bool) -> float:
        """Seconds per ring step over the link (α per link kind)."""
        return self.inter_node_latency if crosses_nodes else self.intra_node_latency

    def with_(self, **changes) -> Hardware:
        """A copy with some numbers changed (``get("h100").with_(inter_node_bandwidth=5e9)``)."""
        return dataclasses.replace(self, **changes)


US = 1e-6
# NCCL's tuning model, src/graph/tuning.cc (NVIDIA/nccl): baseLat of the Ring algorithm
# with the LL protocol 3.6 µs; hwLat of a ring step, LL protocol: NVLink 0.47 µs, NET
# (InfiniBand) 2.7 µs. A ring all-reduce over 8 GPUs of a node: 3.6 + 14 · 0.47 ≈ 10 µs.
_NCCL_LATENCY = {
    "collective_latency": 3.6 * US,
    "intra_node_latency": 0.47 * US,
    "inter_node_latency": 2.7 * US,
}
_NCCL_SOURCE = (
    "NCCL's tuning model (src/graph/tuning.cc): a ring collective's latency is 3.6 µs "
    "plus 0.47 µs per ring step over NVLink, 2.7 µs per step over the network (LL protocol)"
)

_NV_DGX_H100 = (
    "NVIDIA DGX H100 user guide: 8 GPUs per node, 8x ConnectX-7 400 Gb/s InfiniBand "
    "(one per GPU): 50 GB/s one way"
)

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        bf16_flops=989.4e12,
        f32_flops=494.7e12,
        memory_bytes=80 * GIB,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        devices_per_node=8,
        sources=(
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOP/s and TF32 "
            "989 TFLOP/s with sparsity, half that dense; 80 GB HBM3",
            "same datasheet: NVLink 900 GB/s per GPU (both directions): 450 GB/s one way",
            _NV_DGX_H100,
            _NCCL_SOURCE,
        ),
        **_NCCL_LATENCY,
    ),
    "h200": Hardware(
        "h200",
        bf16_flops=989.4e12,
        f32_flops=494.7e12,
        memory_bytes=141 * GB,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        devices_per_node=8,
        sources=(
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOP/s and TF32 "
            "989 TFLOP/s with sparsity, half that dense; 141 GB HBM3e",
            "same datasheet: NVLink 900 GB/s per GPU (both directions): 450 GB/s one way",
            "NVIDIA DGX H200 datasheet: 8 GPUs, 8x ConnectX-7 400 Gb/s: 50 GB/s one way",
            _NCCL_SOURCE,
        ),
        **_NCCL_LATENCY,
    ),
    "a100": Hardware(
        "a100",
        bf16_flops=312e12,
        f32_flops=156e12,
        memory_bytes=80 * GIB,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        devices_per_node=8,
        sources=(
            "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): BF16 312 TFLOP/s and TF32 "
            "156 TFLOP/s dense; 80 GB HBM2e",
            "same datasheet: NVLink 600 GB/s per GPU (both directions): 300 GB/s one way",
            "NVIDIA DGX A100 user guide: 8 GPUs, 8x ConnectX-6 200 Gb/s HDR: 25 GB/s one way",
            _NCCL_SOURCE,
        ),
        **_NCCL_LATENCY,
    ),
    "tpu-v5p": Hardware(
        "tpu-v5p",
        bf16_flops=459e12,
        f32_flops=459e12,
        memory_bytes=95 * GB,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=300 * GB,
        devices_per_node=8960,
        sources=(
            "Google Cloud TPU v5p documentation: 459 TFLOP/s bf16 per chip, 95 GB HBM2e",
            "same page: 4,800 Gbps inter-chip interconnect per chip; taken as half each way "
            "(300 GB/s)",
            "same page: a slice of up to 8,960 chips is one ICI 3D torus (no slower tier "
            "inside a slice; DCN between slices is not modelled)",
            "f32 matmuls at JAX's default precision run as one bf16 pass on TPU",
            "no published per-collective latency for ICI: latency left at 0 (bandwidth only)",
        ),
    ),
}


@functools.cache
def _measured_cpu() -> Hardware:
    a = np.ones((512, 512), np.float32)
    a @ a
    start, reps = time.perf_counter(), 8
    for _ in range(reps):
        a @ a
    flops = reps * 2 * 512**3 / (time.perf_counter() - start)
    src, dst = np.ones(16 * 2**20, np.uint8), np.empty(16 * 2**20, np.uint8)
    start = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    copy = reps * src.nbytes / (time.perf_counter() - start)
    return Hardware(
        "cpu",
        bf16_flops=flops,
        f32_flops=flops,
        memory_bytes=16 * GIB,
        intra_node_bandwidth=copy,
        inter_node_bandwidth=copy,
        devices_per_node=1 << 30,
        sources=(
            f"measured on this machine: a 512x512 f32 matmul ran at {flops / 1e9:.0f} GFLOP/s",
            f"measured: a 16 MiB memory copy ran at {copy / GB:.1f} GB/s (emulated devices "
            "share one host: every collective is a copy)",
            "16 GiB per emulated device is a nominal budget (pass --memory-gb)",
            "latency not measured (emulated devices' collectives are copies in one process): 0",
        ),
    )


def names() -> list[str]:
    """``--hardware`` names."""
    return [*HARDWARE, "cpu"]


def get(name: str | Hardware) -> Hardware:
    """The hardware called ``name`` (a ``Hardware`` is returned as is).

    Raises:
      ShardingError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, Hardware):
        return name
    if name == "cpu":
        return _measured_cpu()
    try:
        return HARDWARE[name]
    except (KeyError, TypeError):
        raise ShardingError(
            f"Unknown hardware {name!r}.\nFix: use one of {', '.join(names())}, or pass a "
            "shardkit.autoplanner.Hardware(...) with your own numbers."
        ) from None
