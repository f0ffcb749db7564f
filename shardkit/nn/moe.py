"""A mixture-of-experts MLP: top-k router, capacity, auxiliary losses, expert parallelism.

Each token's router scores (softmax or sigmoid over ``n_experts`` logits) pick its
``top_k`` experts; the chosen scores, renormalised, weigh the experts' outputs. Each
expert takes at most ``capacity`` tokens of a sequence (``capacity_factor · S · k / E``,
rounded up; choice-major priority: every token's first choice before any second
choice, as GShard); the rest are dropped (their expert adds nothing, the residual
carries them). ``capacity_factor=None`` is dropless: the capacity is the whole sequence
(padded: XLA:CPU has no ``ragged-all-to-all``, so no sorted-segment dispatch here).
The capacity is per sequence, so a layout that splits the batch drops exactly the
tokens one device drops.

Experts are SwiGLU MLPs stored as ``[expert, embed, mlp]`` / ``[expert, mlp, embed]``
kernels; optional shared experts (DeepSeek) are one SwiGLU of ``n_shared · d_ff`` every
token passes through. The load-balancing loss (Switch Transformer: ``E · Σ_e f_e P_e``)
and the router z-loss (ST-MoE: mean ``logsumexp(logits)²``), weighted, come back with
the tokens routed and dropped per expert.

Dispatch and combine are one-hot einsums. When the active context asks for
``expert_dispatch="alltoall"`` (the ``ep`` recipes) and its parameter rules put
``expert`` on a mesh axis, the expert computation runs inside ``jax.shard_map``: each
device dispatches its own sequences into ``[expert, capacity]`` slots, an all-to-all
over the expert axis brings every device the slots of its own experts, they run, and a
second all-to-all brings the outputs home. Otherwise (``ep_gspmd``) XLA places the
einsums' collectives.

Example:
  >>> import jax, jax.numpy as jnp
  >>> spec = MoeSpec(n_experts=4, top_k=2, d_ff=8)
  >>> w = init_weights(jax.random.key(0), spec, d_model=6)
  >>> y, stats = moe_mlp(jnp.ones((2, 5, 6)), w, spec)
  >>> y.shape, stats["load"].shape, int(stats["load"].sum())
  ((2, 5, 6), (4,), 20)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate import axes, constrain
from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.scopes import scope

__all__ = [
    "EXPERT_AXES",
    "INIT_STD",
    "LinenMoe",
    "MoeSpec",
    "NnxMoe",
    "Routing",
    "capacity",
    "dispatch_axis",
    "init_weights",
    "moe_mlp",
    "route",
]

#: Logical axes of the weights: the router, the experts' SwiGLU, the shared experts'.
EXPERT_AXES: dict[str, tuple[str | None, ...]] = {
    "router": ("embed", None),
    "gate": ("expert", "embed", "mlp"),
    "up": ("expert", "embed", "mlp"),
    "down": ("expert", "mlp", "embed"),
    "shared_gate": ("embed", "mlp"),
    "shared_up": ("embed", "mlp"),
    "shared_down": ("mlp", "embed"),
}
_TOKENS = ("batch", "length", "embed")
INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The shape and routing of a mixture-of-experts MLP.

    Attributes:
      n_experts: routed experts ``E``.
      top_k: experts each token is sent to (``1 ≤ k ≤ E``).
      d_ff: hidden width of one expert.
      n_shared: shared experts every token passes through (0: none).
      capacity_factor: slots per expert per sequence, ``⌈cf · S · k / E⌉`` (``> 0``);
        ``None``: dropless (the capacity is the sequence).
      router: ``"softmax"`` or ``"sigmoid"`` scores.
      aux_weight: weight of the load-balancing loss; ``z_weight``: of the router z-loss.

    Raises:
      ShardingError: a size that is not a positive int, ``top_k > n_experts``, a
        capacity factor ``≤ 0``, or an unknown router.

    Example:
      >>> MoeSpec(n_experts=8, top_k=2, d_ff=64).capacity_of(16)
      5
      >>> MoeSpec(n_experts=8, top_k=9, d_ff=64)
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: MoeSpec: top_k 9 > n_experts 8: a token picks distinct experts.
      Fix: pick top_k between 1 and 8.
    """

    n_experts: int
    top_k: int
    d_ff: int
    n_shared: int = 0
    capacity_factor: float | None = 1.25
    router: Literal["softmax", "sigmoid"] = "softmax"
    aux_weight: float = 0.01
    z_weight: float = 0.001

    def __post_init__(self) -> None:
        for field in ("n_experts", "top_k", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ShardingError(
                    f"MoeSpec({field}={value!r}): {field} must be a positive int.\n"
                    f"Fix: pass {field} as a positive integer."
                )
        if not isinstance(self.n_shared, int) or self.n_shared < 0:
            raise ShardingError(
                f"MoeSpec(n_shared={self.n_shared!r}): shared experts are an int ≥ 0.\n"
                "Fix: pass n_shared=0 for none."
            )
        if self.top_k > self.n_experts:
            raise ShardingError(
                f"MoeSpec: top_k {self.top_k} > n_experts {self.n_experts}: a token picks "
                f"distinct experts.\nFix: pick top_k between 1 and {self.n_experts}."
            )
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool) or not isinstance(cf, int | float) or not cf > 0
        ):
            raise ShardingError(
                f"MoeSpec(capacity_factor={cf!r}): the capacity factor must be > 0 (each "
                "expert takes ⌈cf·S·k/E⌉ tokens of a sequence).\nFix: pass e.g. "
                "capacity_factor=1.25, or capacity_factor=None for dropless routing."
            )
        if self.router not in ("softmax", "sigmoid"):
            raise ShardingError(
                f"MoeSpec(router={self.router!r}): router is 'softmax' or 'sigmoid'.\n"
                "Fix: pass router='softmax' (Mixtral) or router='sigmoid' (DeepSeek-V3)."
            )
        for field in ("aux_weight", "z_weight"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ShardingError(
                    f"MoeSpec({field}={value!r}): a loss weight is a number ≥ 0.\n"
                    f"Fix: pass {field}=0 to leave that loss out."
                )

    def capacity_of(self, seq: int) -> int:
        """Slots per expert for a sequence of ``seq`` tokens (:func:`capacity`)."""
        return capacity(self, seq)


def capacity(spec: MoeSpec | ModelDims, seq: int) -> int:
    """``min(S, ⌈cf · S · k / E⌉)`` slots per expert per sequence; ``S`` when dropless.

    ``spec`` is the layer's :class:`MoeSpec` or a model's
    :class:`~shardkit.dims.ModelDims` (the analytic model's count is this one).

    Example:
      >>> capacity(MoeSpec(8, 2, 16, capacity_factor=None), 16)
      16
      >>> capacity(ModelDims(layers=1, d_model=8, n_heads=1, n_kv_heads=1, d_ff=8, vocab=8,
      ...                    n_experts=8, top_k=2, expert_d_ff=8, capacity_factor=1.25), 256)
      80
    """
    if spec.capacity_factor is None:
        return seq
    return max(1, min(seq, math.ceil(spec.capacity_factor * seq * spec.top_k / spec.n_experts)))


@dataclasses.dataclass(frozen=True)
class Routing:
    """What the router decided: ``combine`` ``[B, S, E, C]`` (the gate weight of each
    token in each expert slot), ``dispatch`` (the same, as 0/1), ``aux`` (the weighted
    auxiliary losses), ``load`` and ``dropped`` ``[E]`` (tokens sent to / dropped by each
    expert), ``balance`` and ``z`` (the unweighted losses)."""

    combine: jax.Array
    dispatch: jax.Array
    aux: jax.Array
    load: jax.Array
    dropped: jax.Array
    balance: jax.Array
    z: jax.Array


def _top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` over the last axis as ``k`` argmaxes: XLA partitions an argmax along
    the batch, while its sort-based top-k gathers the whole batch to every device."""
    values, indices, left = [], [], probs
    for _ in range(k):
        index = jnp.argmax(left, -1)
        values.append(jnp.take_along_axis(probs, index[..., None], -1)[..., 0])
        indices.append(index)
        left = jnp.where(jax.nn.one_hot(index, probs.shape[-1], dtype=bool), -jnp.inf, left)
    return jnp.stack(values, -1), jnp.stack(indices, -1)


def route(logits: jax.Array, spec: MoeSpec, slots: int, valid: jax.Array | None = None) -> Routing:
    """Top-k routing of ``logits`` ``[B, S, E]`` into ``slots`` slots per expert.

    ``valid`` ``[B, S]`` (optional; packed rows: ``segment_ids != 0``) marks the real
    tokens: padding takes no slot, counts in no load, and stays out of the losses' means.

    Example:
      >>> spec = MoeSpec(n_experts=2, top_k=1, d_ff=4, capacity_factor=0.5)
      >>> logits = jnp.array([[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]])
      >>> r = route(logits, spec, capacity(spec, 4))   # 1 slot each: expert 0 keeps token 0
      >>> r.load.tolist(), r.dropped.tolist()
      ([3.0, 1.0], [2.0, 0.0])
    """
    logits = logits.astype(jnp.float32)
    b, s, e = logits.shape
    k = spec.top_k
    real = jnp.ones((b, s), jnp.float32) if valid is None else valid.astype(jnp.float32)
    probs = jax.nn.softmax(logits, -1) if spec.router == "softmax" else jax.nn.sigmoid(logits)
    top, chosen = _top_k(probs, k)  # [B, S, k]
    gates = top / jnp.sum(top, -1, keepdims=True)
    mask = jax.nn.one_hot(chosen, e, dtype=jnp.float32) * real[:, :, None, None]  # [B,S,k,E]
    # Slot of each choice in its expert: choice-major order (all first choices first).
    order = jnp.swapaxes(mask, 1, 2).reshape(b, k * s, e)
    position = (jnp.cumsum(order, axis=1) - 1.0).reshape(b, k, s, e)
    position = jnp.sum(jnp.swapaxes(position, 1, 2) * mask, -1)  # [B, S, k]
    keep = (position < slots).astype(jnp.float32)
    slot = jax.nn.one_hot(position.astype(jnp.int32), slots, dtype=jnp.float32) * keep[..., None]
    dispatch = jnp.einsum("bske,bskc->bsec", mask, slot)
    combine = jnp.einsum("bske,bskc,bsk->bsec", mask, slot, gates)
    load = jnp.sum(mask, (0, 1, 2))
    dropped = jnp.sum(mask * (1.0 - keep)[..., None], (0, 1, 2))
    # Switch Transformer's balance loss: E · Σ_e (share of choices) · (mean score share).
    share = probs / jnp.sum(probs, -1, keepdims=True)
    n = jnp.maximum(jnp.sum(real), 1.0)  # the real tokens
    balance = e * jnp.sum(load / (n * k) * jnp.sum(share * real[..., None], (0, 1)) / n)
    z = jnp.sum(jax.nn.logsumexp(logits, -1) ** 2 * real) / n
    aux = spec.aux_weight * balance + spec.z_weight * z
    return Routing(combine, dispatch, aux, load, dropped, balance, z)


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, lead: str) -> Any:
    h = jax.nn.silu(jnp.einsum(f"{lead}cd,edf->{lead}cf", x, gate))
    h = h * jnp.einsum(f"{lead}cd,edf->{lead}cf", x, up)
    return jnp.einsum(f"{lead}cf,efd->{lead}cd", h, down)


def _entry(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def dispatch_axis(spec: MoeSpec, batch: int, seq: int) -> dict[str, Any] | None:
    """The layout of the all-to-all dispatch in the active context, or ``None`` (GSPMD).

    ``{"axis": the expert mesh axis, "batch": the batch's mesh axes, "tensor": the mesh
    axes splitting each expert's ``mlp``}``; ``None`` outside a context with
    ``expert_dispatch="alltoall"`` or where ``expert`` is on no mesh axis of size > 1.

    Raises:
      ShardingError: the experts are not divisible by the expert axis, the expert axis
        is not one mesh axis, the activation rules do not split the batch over it (or
        split the sequence), or the batch is not divisible by its mesh axes.
    """
    ctx, mesh = context.current(), context.active_mesh()
    if ctx.expert_dispatch != "alltoall" or mesh is None or ctx.param_rules is None:
        return None
    wspec = tuple(ctx.param_rules.spec(EXPERT_AXES["gate"], mesh=mesh))
    wspec = wspec + (None,) * (3 - len(wspec))
    expert = [a for a in _entry(wspec[0]) if mesh.shape[a] > 1]
    if not expert:
        return None
    sizes = {a: int(mesh.shape[a]) for a in mesh.axis_names}
    if len(expert) > 1:
        raise ShardingError(
            f"MoE dispatch: the rules put 'expert' on mesh axes {expert} "
            f"({ {a: sizes[a] for a in expert} }); the all-to-all runs over one axis.\n"
            "Fix: map 'expert' to one mesh axis (('expert', 'expert'))."
        )
    axis, n = expert[0], sizes[expert[0]]
    if spec.n_experts % n:
        raise ShardingError(
            f"MoE dispatch: {spec.n_experts} experts do not divide over {axis}={n} "
            f"(mesh {sizes}); each device holds E/{n} whole experts.\nFix: pick an "
            f"{axis!r} axis size dividing {spec.n_experts}, or {spec.n_experts // math.gcd(spec.n_experts, n) * n} experts."
        )
    rules = ctx.activation_rules
    act = tuple(rules.spec(("batch", "length"), mesh=mesh)) if rules is not None else ()
    act = act + (None,) * (2 - len(act))
    batch_axes = tuple(a for a in _entry(act[0]) if sizes[a] > 1)
    length_axes = [a for a in _entry(act[1]) if sizes[a] > 1]
    if axis not in batch_axes or length_axes:
        raise ShardingError(
            f"MoE dispatch over {axis}={n}: the activation rules split the batch over "
            f"{list(batch_axes)} and the sequence over {length_axes} (mesh {sizes}). The "
            f"all-to-all sends each device's whole sequences to the experts, so the batch "
            f"must be split over {axis!r} and the sequence not at all.\nFix: add "
            f"('batch', {axis!r}) to the activation rules and drop any 'length' rule (the "
            "ep recipes do), or use expert_dispatch='gspmd' (ep_gspmd)."
        )
    split = math.prod(sizes[a] for a in batch_axes)
    if batch % split:
        raise ShardingError(
            f"MoE dispatch: batch {batch} is not divisible by its mesh axes {batch_axes} "
            f"({split} devices; mesh {sizes}); each device dispatches whole sequences.\n"
            f"Fix: use a batch that is a multiple of {split}."
        )
    tensor = tuple(a for a in _entry(wspec[2]) if sizes[a] > 1 and a not in batch_axes)
    return {"axis": axis, "batch": batch_axes, "tensor": tensor, "size": n}


def _experts_alltoall(x, routing, weights, layout):
    """The experts inside ``jax.shard_map``: dispatch, all-to-all, SwiGLU, all-to-all back."""
    mesh = context.active_mesh()
    axis, tensor = layout["axis"], layout["tensor"]
    batch = layout["batch"] or None
    tok = PartitionSpec(batch, None, None)
    slots = PartitionSpec(batch, None, None, None)
    t = tensor or None
    w_in, w_out = PartitionSpec(axis, None, t), PartitionSpec(axis, t, None)

    def body(x, dispatch, combine, gate, up, down):
        xe = jnp.einsum("bsd,bsec->ebcd", x, dispatch.astype(x.dtype))
        xe = jax.lax.all_to_all(xe, axis, 0, 1, tiled=True)  # [E/n, n·b, C, d]
        ye = _swiglu(xe, gate, up, down, "eb")
        if tensor:
            ye = jax.lax.psum(ye, tensor)
        ye = jax.lax.all_to_all(ye, axis, 1, 0, tiled=True)  # [E, b, C, d]
        return jnp.einsum("ebcd,bsec->bsd", ye, combine.astype(ye.dtype))

    with scope("moe.alltoall"):
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(tok, slots, slots, w_in, w_in, w_out),
            out_specs=tok,
        )(x, routing.dispatch, routing.combine, weights["gate"], weights["up"], weights["down"])


def moe_mlp(
    x: jax.Array, weights: Mapping[str, jax.Array], spec: MoeSpec, valid: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE MLP of ``x`` ``[B, S, d]``: ``(y, {"aux", "load", "dropped", "balance", "z"})``.

    ``valid`` ``[B, S]``: the real tokens of packed rows (``segment_ids != 0``; see
    :func:`route`); padding gets no expert's output (the shared experts' only).

    ``weights``: ``router [d, E]``, ``gate``/``up`` ``[E, d, f]``, ``down`` ``[E, f, d]``
    (and ``shared_gate``/``shared_up`` ``[d, n_shared·f]``, ``shared_down`` with
    ``n_shared``), as :func:`init_weights` makes them. ``aux`` is the weighted sum of the
    balance and z losses, to be added to the model's loss.

    Example:
      >>> spec = MoeSpec(n_experts=2, top_k=2, d_ff=4, capacity_factor=None)
      >>> w = init_weights(jax.random.key(1), spec, d_model=3)
      >>> _, stats = moe_mlp(jnp.ones((1, 4, 3)), w, spec)
      >>> stats["dropped"].tolist()   # dropless
      [0.0, 0.0]
    """
    b, s, _ = x.shape
    x = constrain(x, _TOKENS)
    logits = jnp.einsum("bsd,de->bse", x, weights["router"].astype(x.dtype))
    routing = route(logits, spec, capacity(spec, s), valid)
    layout = dispatch_axis(spec, b, s)
    gate, up, down = (weights[k].astype(x.dtype) for k in ("gate", "up", "down"))
    if layout is None:
        with scope("moe.dispatch"):
            xe = jnp.einsum("bsd,bsec->becd", x, routing.dispatch.astype(x.dtype))
            ye = _swiglu(xe, gate, up, down, "be")
            y = jnp.einsum("becd,bsec->bsd", ye, routing.combine.astype(x.dtype))
    else:
        y = _experts_alltoall(x, routing, {"gate": gate, "up": up, "down": down}, layout)
    if spec.n_shared:
        shared = [weights[k].astype(x.dtype)[None] for k in ("shared_gate", "shared_up")]
        h = x[:, None]
        y = y + _swiglu(h, *shared, weights["shared_down"].astype(x.dtype)[None], "be")[:, 0]
    stats = {
        "aux": routing.aux,
        "load": routing.load,
        "dropped": routing.dropped,
        "balance": routing.balance,
        "z": routing.z,
    }
    return constrain(y, _TOKENS), stats


def _shapes(spec: MoeSpec, d: int) -> dict[str, tuple[int, ...]]:
    e, f, fs = spec.n_experts, spec.d_ff, spec.n_shared * spec.d_ff
    out = {"router": (d, e), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}
    if spec.n_shared:
        out.update({"shared_gate": (d, fs), "shared_up": (d, fs), "shared_down": (fs, d)})
    return out


def init_weights(rng: jax.Array, spec: MoeSpec, d_model: int, dtype: Any = jnp.float32) -> dict:
    """Plain (unannotated) weights for :func:`moe_mlp`, normal(0.02).

    Example:
      >>> w = init_weights(jax.random.key(0), MoeSpec(4, 1, 8, n_shared=1), d_model=2)
      >>> sorted(w), w["gate"].shape
      (['down', 'gate', 'router', 'shared_down', 'shared_gate', 'shared_up', 'up'], (4, 2, 8))
    """
    shapes = _shapes(spec, d_model)
    keys = jax.random.split(rng, len(shapes))
    return {
        name: INIT_STD * jax.random.normal(key, shape, dtype)
        for key, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


class LinenMoe(nn.Module):
    """The MoE MLP as a linen module: ``(y, stats) = LinenMoe(spec)(x)``.

    Example:
      >>> import shardkit as sk
      >>> m = LinenMoe(MoeSpec(4, 2, 8))
      >>> params = m.init(jax.random.key(0), jnp.ones((1, 4, 6)))["params"]
      >>> sk.logical_axes(params)["gate"]
      ('expert', 'embed', 'mlp')
    """

    spec: MoeSpec
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, valid: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        init = nn.initializers.normal(INIT_STD)
        weights = {
            name: self.param(
                name, nn.with_logical_partitioning(init, EXPERT_AXES[name]), shape, self.param_dtype
            )
            for name, shape in _shapes(self.spec, x.shape[-1]).items()
        }
        dtype = self.dtype or context.compute_dtype()
        return moe_mlp(x.astype(dtype), weights, self.spec, valid)


@axes({rf"^{name}$": names for name, names in EXPERT_AXES.items()})
class NnxMoe(nnx.Module):
    """The MoE MLP as an NNX module: ``(y, stats) = NnxMoe(spec, d_model, rngs=...)(x)``.

    Example:
      >>> with nnx.use_eager_sharding(False):
      ...     m = nnx.eval_shape(lambda: NnxMoe(MoeSpec(4, 2, 8), 6, rngs=nnx.Rngs(0)))
      >>> m.down.shape, m.down.out_sharding
      ((4, 8, 6), ('expert', 'mlp', 'embed'))
    """

    def __init__(
        self,
        spec: MoeSpec,
        d_model: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.spec, self.dtype = spec, dtype
        init = nnx.initializers.normal(INIT_STD)
        for name, shape in _shapes(spec, d_model).items():
            setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))

    def __call__(
        self, x: jax.Array, valid: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        names = _shapes(self.spec, x.shape[-1])
        weights = {name: getattr(self, name)[...] for name in names}
        dtype = self.dtype or context.compute_dtype()
        return moe_mlp(x.astype(dtype), weights, self.spec, valid)
