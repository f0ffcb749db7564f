"""The report's records: the data a :class:`~shardkit.report.report.Report` is made of.

Plain frozen dataclasses, each with its ``to_json``: a state leaf (:class:`ParamRow`),
a group of collectives with one cause (:class:`CollectiveGroup`), a term of the wire
bytes (:class:`WireTerm`) or of the temp memory (:class:`MemoryTerm`) against its
analytic value, and why one is off by more than :data:`TOLERANCE`
(:class:`Explanation`); and how their bytes read (:func:`human_bytes`).

Example:
  >>> t = WireTerm("weight all-gathers", 1050.0, 1000.0)
  >>> t.ratio, abs(t.ratio - 1) > TOLERANCE, human_bytes(1536)
  (1.05, False, '1.5 KiB')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardkit.report.hlo import Collective

__all__ = [
    "TOLERANCE",
    "CollectiveGroup",
    "Explanation",
    "MemoryTerm",
    "ParamRow",
    "WireTerm",
    "human_bytes",
]

#: A measured term within this fraction of its analytic value needs no explanation.
TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One state leaf: where it lives and what it costs each device."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: str
    bytes_per_device: int
    replicated: bool
    kind: str  # "param", "optimizer" or "scalar"
    shard_shape: tuple[int, ...] = ()
    #: per dimension, the mesh axes that split it (``()`` for a whole dimension)
    mesh_axes: tuple[tuple[str, ...], ...] = ()
    #: its annotation named fewer dimensions than it has (Flax's prefix rule): ``logical``
    #: ends in ``None`` for the rest, which are replicated
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {
            "path": self.path,
            "shape": list(self.shape),
            "logical": list(self.logical),
            "spec": self.spec,
            "bytes_per_device": self.bytes_per_device,
        }
        return {**out, "logical_prefix": True} if self.prefix else out


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """Collectives with one cause: kind, pass, model path, source line and block.

    ``kind`` ends in ``*`` for a reduce-scatter the CPU pipeline left as an all-reduce
    plus a dynamic-slice; ``executions`` counts every run per step (ops × loop trips).
    ``source`` is the model's line, ``block`` the shardkit building block that made the
    collectives there (``attention.ring``; ``""`` for the model's own ops).
    """

    kind: str
    pass_: str
    where: str
    source: str
    ops: int
    executions: int
    wire_bytes: float
    block: str = ""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Why one measured term differs from its analytic value by more than :data:`TOLERANCE`."""

    term: str
    measured_bytes: float
    analytic_bytes: float
    why: str

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.analytic_bytes if self.analytic_bytes else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "measured_bytes": self.measured_bytes,
            "analytic_bytes": self.analytic_bytes,
            "ratio": self.ratio,
            "why": self.why,
        }


@dataclasses.dataclass(frozen=True)
class WireTerm:
    """One term of the step's wire bytes per device: measured, analytic, its collectives."""

    term: str
    bytes: float
    analytic_bytes: float | None = None
    collectives: tuple[Collective, ...] = ()

    @property
    def ratio(self) -> float | None:
        return self.bytes / self.analytic_bytes if self.analytic_bytes else None

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "bytes": self.bytes,
            "analytic_bytes": self.analytic_bytes,
            "ratio": self.ratio,
            "ops": len(self.collectives),
            "runs": sum(c.count for c in self.collectives),
        }


@dataclasses.dataclass(frozen=True)
class MemoryTerm:
    """One term of the temp memory at its peak: bytes, analytic value, largest buffers."""

    term: str
    bytes: int
    analytic_bytes: float | None = None
    top: tuple[str, ...] = ()  # "f32[64,256] layers/mlp/up (remat all-gather)", largest first
    count: int = 0

    @property
    def ratio(self) -> float | None:
        if not self.analytic_bytes:
            return None
        return self.bytes / self.analytic_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "bytes": self.bytes,
            "analytic_bytes": self.analytic_bytes,
            "ratio": self.ratio,
            "buffers": self.count,
            "top": list(self.top),
        }


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
