"""``Recipe``: a sharding layout as plain data.

A recipe owns the *logical → mesh* half of the flow: which mesh axes exist and
how to size them from a device count, the rules for parameters (and, where
they differ, for optimizer state), the rules for activations and the batch,
and the attention strategy. It never names a parameter path.

Example:
  >>> import shardkit as sk
  >>> r = sk.recipes.get("fsdp")
  >>> r.axis_sizes(8)
  {'fsdp': 8}
  >>> r.rules.spec(("embed", "mlp"))
  P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from shardkit.mesh import resolve_axis_sizes
from shardkit.rules import Rules

__all__ = ["Recipe"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named sharding layout.

    Attributes:
      name: short name used on the command line (``dp``, ``fsdp``, ...).
      summary: one line for ``shardkit recipes``.
      mesh_axes: ordered ``(axis, size)`` pairs; one size may be ``-1`` (the rest
        of the devices).
      rules: logical → mesh rules for parameters (and gradients).
      activation_rules: logical → mesh rules for activations and the batch.
      optimizer_rules: rules for optimizer state; ``None`` means "as ``rules``"
        (ZeRO-1 shards only the optimizer state).
      attention: how attention handles a sharded sequence.
      collectives: the collective kinds the layout is meant to emit (its golden
        inventory); the report flags any other kind that moves real bytes.
      optional_names: logical names the rules cover that a model may not have (the
        built-in recipes serve GPT and Llama, so ``kv_heads`` may match nothing); the
        report does not flag their rules as unused.
    """

    name: str
    summary: str
    mesh_axes: tuple[tuple[str, int], ...]
    rules: Rules
    activation_rules: Rules
    optimizer_rules: Rules | None = None
    attention: Literal["dense", "ring", "allgather"] = "dense"
    collectives: frozenset[str] = frozenset({"all-reduce"})
    optional_names: frozenset[str] = frozenset()

    def axis_sizes(self, device_count: int) -> dict[str, int]:
        """Mesh axis sizes for ``device_count`` devices.

        Raises:
          MeshError: the sizes do not factor ``device_count``.
        """
        return resolve_axis_sizes(dict(self.mesh_axes), device_count)

    def with_mesh(self, axes: Mapping[str, int]) -> Recipe:
        """The same recipe on other mesh sizes (new axes go last).

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("fsdp_tp").with_mesh({"tensor": 2}).axis_sizes(8)
          {'fsdp': 4, 'tensor': 2}
          >>> recipes.get("tp").with_mesh({"data": -1, "tensor": 4}).axis_sizes(8)
          {'tensor': 4, 'data': 2}
        """
        merged = dict(self.mesh_axes)
        merged.update(axes)
        return dataclasses.replace(self, mesh_axes=tuple(merged.items()))
