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
under remat ``full`` or ``save_dots``: the forward runs again, the dispatch einsums
having batch dimensions that ``save_dots`` does not keep; compiled moe-tiny: 860,160
B = 6·L under both).

Measured corrections (compiled moe-tiny, 8 devices, batch 16, seq 64):

- ``ep_tp``: each device runs its experts' slice of ``mlp``; their partial outputs and
  the gradients of the replicated slots are all-reduced over ``tensor``: ``4`` slot
  buffers ``E·b·C·d`` per layer (1 forward, 3 backward; 5 when the forward runs again)
  and one token buffer ``b·S·d`` (:func:`expert_allreduce_bytes`: 1,376,256 B under
  remat none, 1,703,936 B under full, both as compiled);
- ``fsdp_ep``: the dense weights are gathered once forward and the layer stack's once
  more backward (the tables are not gathered again): ``(N−1)/N·B·(Ψ_d + L·Ψ_l,d)``
  (:func:`gather_bytes`: 467,936 B against 469,056 compiled; the dense model's count,
  ``2·Ψ_d``, gave 582,848).

Example:
  >>> import shardkit as sk
  >>> dims = sk.models.get("moe-tiny").dims
  >>> # 2 layers · 4 all-to-alls · 7/8 · [8 experts, 1 sequence, 5 slots, 64] · 4 bytes
  >>> dispatch_bytes(dims, "ep", {"expert": 8}, batch=8, seq=16)
  71680.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.nn.moe import capacity
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe

__all__ = [
    "dispatch_bytes",
    "expert_allreduce_bytes",
    "expert_split",
    "gather_bytes",
    "mlp_values",
    "state_split",
    "with_experts",
]

_KERNEL = ("expert", "embed", "mlp")


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
      >>> import shardkit as sk
      >>> d = sk.models.get("moe-tiny").dims
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


def _per_device_batch(recipe: Recipe, mesh: Mapping[str, int], batch: int) -> int:
    batch_axes = _axes(recipe.activation_rules.spec(("batch",))[0])
    split = math.prod(int(mesh.get(a, 1)) for a in batch_axes)
    if batch % split:
        raise ShardingError(
            f"dispatch_bytes: batch {batch} does not divide over {batch_axes} ({split} "
            f"devices, mesh {dict(mesh)}).\nFix: use a batch that is a multiple of {split}."
        )
    return batch // split


def _expert_axis(recipe: Recipe, mesh: Mapping[str, int]) -> int:
    """The size of the mesh axes the all-to-all dispatch runs over (1: no dispatch)."""
    if recipe.expert_dispatch != "alltoall":
        return 1
    spec = recipe.rules.spec(_KERNEL)
    return math.prod(int(mesh.get(a, 1)) for a in _axes(spec[0]))


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
    forward and backward; 6 under ``remat="full"`` or ``"save_dots"``), ``N`` the expert
    axis, ``b`` the sequences a device holds. 0 without experts, without an expert
    axis, or under a recipe whose dispatch XLA places (``ep_gspmd``).

    Raises:
      ShardingError: the batch does not divide over the mesh axes that split it.
    """
    recipe = get_recipe(recipe)
    n = _expert_axis(recipe, mesh)
    if not dims.n_experts or n == 1:
        return 0.0
    b = _per_device_batch(recipe, mesh, batch)
    buffer = dims.n_experts * b * capacity(dims, seq) * dims.d_model
    passes = 4 if remat == "none" else 6
    return float(dims.layers * passes * (n - 1) / n * buffer * bytes_per_value)


def expert_allreduce_bytes(
    dims: ModelDims,
    recipe: str | Recipe,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    bytes_per_value: int = 4,
    remat: str = "none",
) -> float:
    """All-reduce wire bytes of the experts split over a tensor axis inside the dispatch
    (``ep_tp``): ``2(t−1)/t · B · (L · r · E·b·C·d + b·S·d)``, ``r`` = 4 slot
    buffers per layer (5 when the forward runs again), as compiled (module docstring).

    Example:
      >>> import shardkit as sk
      >>> d = sk.models.get("moe-tiny").dims   # batch 8, seq 16: b = 2 sequences, C = 5
      >>> expert_allreduce_bytes(d, "ep_tp", {"expert": 4, "tensor": 2}, batch=8, seq=16)
      172032.0
      >>> expert_allreduce_bytes(d, "ep", {"expert": 8}, batch=8, seq=16)
      0.0
    """
    recipe = get_recipe(recipe)
    if not dims.n_experts or _expert_axis(recipe, mesh) == 1:
        return 0.0
    spec = recipe.rules.spec(_KERNEL)
    batch_axes = _axes(recipe.activation_rules.spec(("batch",))[0])
    t = math.prod(
        int(mesh.get(a, 1))
        for a in _axes(spec[2] if len(spec) > 2 else None)
        if a not in batch_axes
    )
    if t == 1:
        return 0.0
    b = _per_device_batch(recipe, mesh, batch)
    slots = dims.n_experts * b * capacity(dims, seq) * dims.d_model
    r = 4 if remat == "none" else 5
    values = dims.layers * r * slots + b * seq * dims.d_model
    return float(2 * (t - 1) / t * values * bytes_per_value)


def gather_bytes(
    dims: ModelDims, recipe: str | Recipe, mesh: Mapping[str, int], *, bytes_per_value: int = 4
) -> float:
    """All-gather wire bytes of the dense weights under FSDP next to the experts
    (``fsdp_ep``): ``(N−1)/N · B · (Ψ_d + L·Ψ_l,d) / t``: every dense weight once
    forward, the layer stack's once more backward (module docstring).

    Example:
      >>> import shardkit as sk
      >>> d = sk.models.get("moe-tiny").dims    # 83,264 dense parameters, 25,216 a layer
      >>> gather_bytes(d, "fsdp_ep", {"expert": 8})
      467936.0
    """
    par = get_recipe(recipe).parallelism(mesh)
    if par.fsdp == 1 or not dims.n_experts:
        return 0.0
    dense_layer = dims.layer_params - dims.expert_params
    dense = dims.param_count - dims.layers * dims.expert_params
    n = par.fsdp
    return float((n - 1) / n * bytes_per_value * (dense + dims.layers * dense_layer) / par.tensor)


def mlp_values(dims: ModelDims, remat: str, *, seq: int, t: int = 1) -> float:
    """Values per token an MoE MLP keeps for its backward pass, per remat policy (what
    :func:`shardkit.report.estimator.saved_values` counts for a dense MLP).

    With ``u = E·C/S`` expert slots per token (≈ cf·k), ``f`` an expert's width, ``f_s``
    the shared experts': ``none``: the router's logits, scores and choice mask
    (``2E + kE``), the dispatch and combine tables (``2·E·C``), the slots in and out of
    both all-to-alls and the SwiGLU's values (``u·(4d + 4f/t)``), the shared experts'
    six MLP-width values (``6·f_s/t``); ``save_dots``: the router's logits (``E``; the
    expert matmuls have a batch dimension, the expert axis); ``full``: nothing (the
    layer input is the layer's).

    Example:
      >>> import shardkit as sk
      >>> d = sk.models.get("moe-tiny").dims   # E=8, k=2, C=20 at seq 64: u = 2.5
      >>> mlp_values(d, "none", seq=64), mlp_values(d, "save_dots", seq=64)
      (2016.0, 8.0)
    """
    if not dims.n_experts or remat == "full":
        return 0.0
    e = dims.n_experts
    if remat == "save_dots":
        return float(e)
    slots = e * capacity(dims, seq)
    u = slots / seq
    f, fs = dims.expert_d_ff, dims.n_shared_experts * dims.expert_d_ff
    router = 2 * e + dims.top_k * e
    return float(router + 2 * slots + u * (4 * dims.d_model + 4 * f / t) + 6 * fs / t)


def with_experts(
    analytic: Any,
    dims: ModelDims,
    recipe: str | Recipe,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    remat: str = "none",
    param_bytes: float,
    optimizer_bytes: float,
    bytes_per_value: int = 4,
) -> Any:
    """``analytic`` (an :class:`~shardkit.report.analytic.AnalyticModel`) with an MoE
    model's state split as the rules split the experts (:func:`state_split`), the
    weight and gradient terms on the dense share, and the expert dispatch's all-to-alls
    (and in-expert all-reduces, dense weight gathers: the module's corrections).

    ``param_bytes`` / ``optimizer_bytes``: the whole model's, unsharded.
    """
    recipe = get_recipe(recipe)
    split = state_split(dims, recipe, mesh)
    per_device = split["expert"] + split["dense"]
    memory = dataclasses.replace(
        analytic.memory,
        params=param_bytes / dims.param_count * per_device,
        grads=param_bytes / dims.param_count * per_device,
        optimizer=optimizer_bytes / dims.param_count * per_device,
    )
    nb = bytes_per_value
    kw = dict(batch=batch, seq=seq, bytes_per_value=nb, remat=remat)
    moved = dispatch_bytes(dims, recipe, mesh, **kw)
    reduced = expert_allreduce_bytes(dims, recipe, mesh, **kw)
    wire, terms = dict(analytic.wire_bytes_by_kind), dict(analytic.wire_terms)
    par = recipe.parallelism(mesh)
    if par.expert > 1:
        # Experts split over an axis that splits the batch too are never gathered nor
        # reduced over it (their tokens travel instead): the weight and gradient terms
        # of the dense model apply to the dense share of the parameters only.
        share = 1 - dims.layers * dims.expert_params / dims.param_count
        for term, kind in (
            ("weight all-gathers", "all-gather"),
            ("gradient reductions", "reduce-scatter" if par.fsdp > 1 else "all-reduce"),
        ):
            if term in terms:
                delta = terms[term] * (1 - share)
                if term == "weight all-gathers" and par.fsdp > 1:
                    delta = terms[term] - gather_bytes(dims, recipe, mesh, bytes_per_value=nb)
                terms[term] -= delta
                wire[kind] = max(0.0, wire.get(kind, 0.0) - delta)
        # ...but batch axes the experts are not split over (a `data` axis beside
        # `expert`) hold replicas of them: their gradients are all-reduced over those.
        kernel_axes = {a for e in recipe.rules.spec(_KERNEL) for a in _axes(e)}
        batch_axes = _axes(recipe.activation_rules.spec(("batch",))[0])
        replicas = math.prod(int(mesh.get(a, 1)) for a in batch_axes if a not in kernel_axes)
        if replicas > 1:
            expert_grads = dims.layers * dims.expert_params * nb / expert_split(recipe, mesh)
            back = 2 * (replicas - 1) / replicas * expert_grads
            terms["gradient reductions"] = terms.get("gradient reductions", 0.0) + back
            wire["all-reduce"] = wire.get("all-reduce", 0.0) + back
    notes = [
        f"experts: {dims.layers}·{dims.expert_params:,} parameters split over "
        f"{expert_split(recipe, mesh)} devices, the dense "
        f"{dims.param_count - dims.layers * dims.expert_params:,} as the dense model"
    ]
    if moved:
        wire["all-to-all"] = wire.get("all-to-all", 0.0) + moved
        wire["all-reduce"] = wire.get("all-reduce", 0.0) + reduced
        terms["expert dispatch"] = moved + reduced
        notes.append(
            f"expert dispatch: {dims.layers} layers × 4 all-to-alls (6 when the forward "
            f"runs again) of E·b·C·d·{nb} bytes, C = {capacity(dims, seq)}"
            + (f"; in-expert all-reduces over tensor {reduced:,.0f} B" if reduced else "")
        )
    return dataclasses.replace(
        analytic,
        memory=memory,
        wire_bytes_by_kind=wire,
        wire_terms=terms,
        notes=(*analytic.notes, *notes),
    )
