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

from shardkit.errors import ShardingError
from shardkit.mesh import resolve_axis_sizes
from shardkit.rules import Rules

__all__ = ["Parallelism", "Recipe"]

#: Logical names whose weights Megatron splits: a mesh axis that shards them is a
#: tensor-parallel axis.
TENSOR_NAMES = frozenset({"heads", "kv_heads", "mlp"})


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The degree of each kind of parallelism a recipe runs on a mesh.

    Read from the recipe's rules (never from its name), so a custom recipe gets
    the same analysis as a built-in one. A mesh axis that shards

    - heads or MLP units (``heads``, ``kv_heads``, ``mlp``) of the parameters, but not the
      batch, is ``tensor`` (``tensor_kind="tp_sp"`` if it also splits activations'
      ``length``);
    - other parameter dimensions (``embed``, ``vocab``) is ``fsdp``;
    - only the batch is ``data`` (``data_kind="zero1"`` if it shards optimizer state);
    - only the activations' ``length`` is ``sequence``;
    - other parameter dimensions *and* the activations' ``length`` is ``tsp``
      (tensor and sequence parallelism folded onto one axis: each device holds 1/D of
      every weight and S/D of the tokens; ``tsp_kind`` is the recipe's
      ``layer_schedule``, ``"gspmd"`` or ``"tsp"``).

    Axes that shard nothing count as 1.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    data_kind: Literal["dp", "zero1"] = "dp"
    tensor_kind: Literal["tp", "tp_sp"] = "tp"
    tsp: int = 1
    tsp_kind: Literal["gspmd", "tsp"] = "gspmd"
    #: pipeline stages: a mesh axis that shards only the ``layers`` axis of the stack.
    stage: int = 1

    def sizes(self) -> dict[str, int]:
        """``{"data": d, "fsdp": f, "tensor": t, "sequence": c}``."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
                "sequence": self.sequence}  # fmt: skip


def _names_on(rules: Rules | None, axis: str) -> set[str]:
    """Logical names that ``rules`` map (in any rule) onto mesh axis ``axis``."""
    out = set()
    for name, axes in rules or ():
        if axis == axes or (isinstance(axes, tuple) and axis in axes):
            out.add(name)
    return out


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
      attention_axis: the mesh axis ring/allgather attention splits the sequence over.
      layer_schedule: ``"gspmd"`` (XLA places the layers' collectives) or ``"tsp"``
        (the projections circulate weight shards over ``attention_axis``; see
        ``shardkit.parallel.tsp``).
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
    attention_axis: str = "sequence"
    layer_schedule: Literal["gspmd", "tsp"] = "gspmd"

    def axis_sizes(self, device_count: int) -> dict[str, int]:
        """Mesh axis sizes for ``device_count`` devices.

        Raises:
          MeshError: the sizes do not factor ``device_count``.
        """
        return resolve_axis_sizes(dict(self.mesh_axes), device_count)

    def parallelism(self, mesh: Mapping[str, int]) -> Parallelism:
        """The parallelism degrees this recipe runs on mesh axis sizes ``mesh``.

        Raises:
          ShardingError: ``mesh`` sizes an axis (> 1) that the recipe does not declare.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("dp_tp_sp").parallelism({"data": 2, "tensor": 4})
          Parallelism(data=2, fsdp=1, tensor=4, sequence=1, data_kind='dp', tensor_kind='tp_sp', tsp=1, tsp_kind='gspmd', stage=1)
          >>> recipes.get("zero1").parallelism({"data": 8}).data_kind
          'zero1'
        """
        declared = dict(self.mesh_axes)
        extra = {a: v for a, v in mesh.items() if declared and a not in declared and v != 1}
        if extra:
            raise ShardingError(
                f"Recipe {self.name!r} uses mesh axes {tuple(declared)}; mesh {dict(mesh)} also "
                f"sizes {extra}.\nFix: drop those axes or set them to 1."
            )
        degrees = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "tsp": 1, "stage": 1}
        kinds = {"data_kind": "dp", "tensor_kind": "tp", "tsp_kind": self.layer_schedule}
        for axis, size in mesh.items():
            params = _names_on(self.rules, axis)
            acts = _names_on(self.activation_rules, axis)
            if params & TENSOR_NAMES and "batch" not in acts:  # an axis splitting the batch
                role = "tensor"  # and heads/MLP units is FSDP that also shards those
                if "length" in acts:
                    kinds["tensor_kind"] = "tp_sp"
            elif params == {"layers"}:
                role = "stage"
            elif params and "length" in acts:
                role = "tsp"
            elif params:
                role = "fsdp"
            elif "batch" in acts:
                role = "data"
                if _names_on(self.optimizer_rules, axis):
                    kinds["data_kind"] = "zero1"
            elif "length" in acts:
                role = "sequence"
            else:
                continue
            degrees[role] *= int(size)
        return Parallelism(**degrees, **kinds)

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
