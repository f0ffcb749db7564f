"""The analytic model of a mixture-of-experts layer's state and its expert dispatch.

State: a layer's routed experts hold ``Ψ_e = E · 3 · d · f_e`` parameters
(:attr:`shardkit.dims.ModelDims.expert_params`); a layout's parameter rules split them
over the mesh axes they put the expert kernel ``(expert, embed, mlp)`` on, so each
device holds ``L · Ψ_e / (product of those axes)`` of them, with the same share of
their gradients and Adam moments. The rest (Ψ − L·Ψ_e, the dense part) is split as the
dense analytic model says (tensor and FSDP degrees).

Dispatch (``expert_dispatch="alltoall"``, :mod:`shardkit.nn.moe`): each device holds
``b`` sequences (the batch over the mesh axes that split it) and sends, per layer, an
``[E, b, C, d]`` buffer of expert slots (``C = ⌈cf · S · k / E⌉``, ``S`` when
dropless) through an all-to-all over the expert axis of size ``N``, and brings as many
back: ``(N − 1)/N · E · b · C · d · B`` bytes each way. The backward pass sends the
gradients of both the same way, so a step moves ``4 · L`` such all-to-alls (``6 · L``
under full remat: the forward runs again).

Example:
  >>> from shardkit.models import get
  >>> dims = get("moe-tiny").dims
  >>> # 2 layers · 4 all-to-alls · 7/8 · [8 experts, 1 sequence, 5 slots, 64] · 4 bytes
  >>> dispatch_bytes(dims, "ep", {"expert": 8}, batch=8, seq=16)
  71680.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe

__all__ = ["capacity", "dispatch_bytes", "expert_split", "state_split"]

_KERNEL = ("expert", "embed", "mlp")


def capacity(dims: ModelDims, seq: int) -> int:
    """Slots per expert and sequence: ``min(S, ⌈cf · S · k / E⌉)``, ``S`` when dropless.

    Example:
      >>> from shardkit.models import get
      >>> capacity(get("moe-small").dims, 256)
      80
    """
    if dims.capacity_factor is None:
        return seq
    return max(1, min(seq, math.ceil(dims.capacity_factor * seq * dims.top_k / dims.n_experts)))


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def expert_split(recipe: str | Recipe, mesh: Mapping[str, int]) -> int:
    """Devices one expert kernel ``(expert, embed, mlp)`` is split over under ``recipe``.

    Example:
      >>> expert_split("ep", {"expert": 8}), expert_split("ep_tp", {"expert": 4, "tensor": 2})
      (8, 8)
    """
    spec = get_recipe(recipe).rules.spec(_KERNEL)
    return math.prod(int(mesh.get(a, 1)) for e in spec for a in _axes(e))


def state_split(dims: ModelDims, recipe: str | Recipe, mesh: Mapping[str, int]) -> dict[str, float]:
    """Parameters per device: ``{"expert": L·Ψ_e / split, "dense": (Ψ − L·Ψ_e) / (t·f)}``.

    Gradients and each Adam moment have the same shares (f32 Adam: 16 bytes a
    parameter in all).

    Example:
      >>> from shardkit.models import get
      >>> d = get("moe-tiny").dims
      >>> s = state_split(d, "ep", {"expert": 8})
      >>> s["expert"] == 2 * d.expert_params / 8, s["dense"] == d.param_count - 2 * d.expert_params
      (True, True)
    """
    recipe = get_recipe(recipe)
    par = recipe.parallelism(mesh)
    experts = dims.layers * dims.expert_params
    return {
        "expert": experts / expert_split(recipe, mesh),
        "dense": (dims.param_count - experts) / (par.tensor * par.fsdp),
    }


def dispatch_bytes(
    dims: ModelDims,
    recipe: str | Recipe,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    bytes_per_value: int = 4,
    remat: str = "none",
) -> float:
    """All-to-all wire bytes per device per step of the expert dispatch and combine.

    ``L · passes · (N − 1)/N · E · b · C · d · B``: ``passes`` 4 (dispatch and combine,
    forward and backward; 6 under ``remat="full"``), ``N`` the expert axis, ``b`` the
    sequences a device holds. 0 without experts, without an expert axis, or under a
    recipe whose dispatch XLA places (``ep_gspmd``).

    Raises:
      ShardingError: the batch does not divide over the mesh axes that split it.
    """
    recipe = get_recipe(recipe)
    if not dims.n_experts or recipe.expert_dispatch != "alltoall":
        return 0.0
    spec = recipe.rules.spec(_KERNEL)
    expert_axes = [a for a in _axes(spec[0]) if int(mesh.get(a, 1)) > 1]
    if not expert_axes:
        return 0.0
    n = math.prod(int(mesh[a]) for a in expert_axes)
    batch_axes = _axes(recipe.activation_rules.spec(("batch",))[0])
    split = math.prod(int(mesh.get(a, 1)) for a in batch_axes)
    if batch % split:
        raise ShardingError(
            f"dispatch_bytes: batch {batch} does not divide over {batch_axes} ({split} "
            f"devices, mesh {dict(mesh)}).\nFix: use a batch that is a multiple of {split}."
        )
    buffer = dims.n_experts * (batch // split) * capacity(dims, seq) * dims.d_model
    passes = 6 if remat == "full" else 4
    return float(dims.layers * passes * (n - 1) / n * buffer * bytes_per_value)
