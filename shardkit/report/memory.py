"""Per-device memory of a compiled program (docs/explain/measurement.md).

``total = arguments + output + temp − alias`` from ``compiled.memory_analysis()``
(``peak_memory_in_bytes`` is not reliable on CPU: it reports arguments only).

Example:
  >>> import jax, jax.numpy as jnp
  >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((4, 4))).compile()
  >>> memory_per_device(compiled).arguments
  64
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MemoryStats", "memory_per_device"]


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Bytes per device of one compiled program."""

    arguments: int
    output: int
    temp: int
    alias: int

    @property
    def total(self) -> int:
        return self.arguments + self.output + self.temp - self.alias

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def memory_per_device(compiled: Any) -> MemoryStats:
    """``MemoryStats`` of a ``jax.stages.Compiled`` (one device's share)."""
    m = compiled.memory_analysis()
    return MemoryStats(
        arguments=int(m.argument_size_in_bytes),
        output=int(m.output_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        alias=int(m.alias_size_in_bytes),
    )
