"""TSP's layer schedules: projections whose weight shards travel a ring.

TSP (Shyam, Golubeva, Anthony 2026, arXiv:2604.26294) folds tensor and sequence
parallelism onto one mesh axis of size D: device p holds the tokens ``[b, S/D, ...]``
and 1/D of every weight. A projection ``y = x @ W`` then runs as a ring: at step t
device p multiplies its tokens by the shard ``W_r`` it holds (r = p − t mod D) while
it sends that shard on to device p + 1 (``jax.lax.ppermute``), so at most two shards
of a weight are live (the one in use and the one arriving) and the transfer can
overlap the matmul. No activation is ever all-reduced: every token stays home.

Two kinds of projection, by which kernel dimension is split over the axis:

- ``"in"``: the contracting dimension (q/k/v, MLP up and gate: ``(embed, ...)``
  kernels split along ``embed``). Each step adds ``x[..., rows_r] @ W_r``.
- ``"out"``: an output dimension (attention out, MLP down: ``(..., embed)`` kernels).
  Each step writes the columns ``x @ W_r`` into ``y[..., cols_r]``.

The backward pass (a ``jax.custom_vjp``) keeps only the tokens and the device's own
shard from the forward pass. It sends the weight shards around the ring once more
for the input gradient, and a gradient accumulator for shard ``p − t − 1`` travels
the same ring one step behind, gaining each device's contribution, so that after
D − 1 hops every weight gradient arrives at its owner complete. Wire per device and
projection with Ψ_w weights, f = (D − 1)/D: forward f·Ψ_w, backward 2f·Ψ_w.

Attention runs between the projections on the local tokens: q, k, v come out of an
``"in"`` ring for all heads (the head count need not divide D), zigzag ring
attention over the same axis (:func:`shardkit.nn.attention.causal_attention`) moves
K/V blocks, and the output projection is an ``"out"`` ring.

Models opt in per projection with :class:`TspDot` (flax ``dot_general=``) or
:class:`TspEinsum` (``nnx.Einsum(einsum_op=...)``), naming the kernel's logical axes.
Outside a context with ``layer_schedule="tsp"`` (``sk.Plan`` of the ``tsp`` recipe)
both are the ordinary ``lax.dot_general`` / ``jnp.einsum``.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((4,), ("tsp",), devices=jax.devices()[:4],
  ...                      axis_types=(jax.sharding.AxisType.Auto,))
  >>> x = jnp.arange(2 * 8 * 16.0).reshape(2, 8, 16) / 100
  >>> w = jnp.arange(16 * 4.0).reshape(16, 4) / 100
  >>> y = jax.jit(jax.shard_map(lambda x, w: ring_dot(x, w, kind="in", axis="tsp", size=4),
  ...                           mesh=mesh, in_specs=(P(None, "tsp"), P("tsp")),
  ...                           out_specs=P(None, "tsp"), check_vma=False))(x, w)
  >>> bool(np.allclose(y, x @ w))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import is_explicit
from shardkit.errors import ShardingError
from shardkit.nn.attention import causal_attention
from shardkit.nn.rope import apply_rope
from shardkit.rules import entry_axes
from shardkit.scopes import scope

__all__ = [
    "SAVED_NAME",
    "TspDot",
    "TspEinsum",
    "active_axis",
    "attention",
    "gated_mlp",
    "ring_dot",
]

Kind = Literal["in", "out"]

#: The name (``jax.ad_checkpoint.checkpoint_name``) of a TSP projection's result. A remat
#: policy that saves matmul results should save it too, as the reference models'
#: ``save_dots`` does (``jax.checkpoint_policies.save_only_these_names(SAVED_NAME)``): the
#: ring computes a projection as D partial matmuls, and a policy that saves matmuls but
#: not this name keeps all D partial results of every projection (D times the memory of
#: the one result) instead.
SAVED_NAME = "tsp_projection"


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring projection (hashable: a custom_vjp argument)."""

    dims: Any  # lax.dot_general dimension numbers
    kind: Kind
    kdim: int  # kernel dimension split over the axis
    xdim: int  # "in": the x dimension contracted with kdim; "out": the y dimension of kdim
    axis: str
    size: int
    precision: Any = None


def _dot(a: jax.Array, w: jax.Array, ring: _Ring) -> jax.Array:
    return lax.dot_general(a, w, ring.dims, precision=ring.precision)


def _shift(v: jax.Array, ring: _Ring) -> jax.Array:
    """Send ``v`` to the next device of the ring (p → p + 1)."""
    n = ring.size
    return lax.ppermute(v, ring.axis, [(j, (j + 1) % n) for j in range(n)])


def _rows(x: jax.Array, r: jax.Array, width: int, ring: _Ring) -> jax.Array:
    """The part of ``x`` that shard ``r`` of an ``"in"`` kernel contracts with."""
    return lax.dynamic_slice_in_dim(x, r * width, width, axis=ring.xdim)


def _forward(x: jax.Array, w: jax.Array, ring: _Ring) -> jax.Array:
    p, n, width = lax.axis_index(ring.axis), ring.size, w.shape[ring.kdim]

    def add(y: jax.Array | None, wc: jax.Array, t: Any) -> jax.Array:
        r = (p - t) % n
        if ring.kind == "in":
            part = _dot(_rows(x, r, width, ring), wc, ring)
            return part if y is None else y + part
        part = _dot(x, wc, ring)
        if y is None:
            shape = list(part.shape)
            shape[ring.xdim] *= n
            y = jnp.zeros(shape, part.dtype)
        return lax.dynamic_update_slice_in_dim(y, part, r * width, axis=ring.xdim)

    def step(t: jax.Array, carry: tuple) -> tuple:
        y, wc = carry
        nxt = _shift(wc, ring)  # independent of this step's matmul: the two can overlap
        return add(y, wc, t), nxt

    y = add(None, w, 0)
    y, wc = lax.fori_loop(1, n - 1, step, (y, _shift(w, ring)))
    return add(y, wc, n - 1)


def _backward(ring: _Ring, res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    p, n, width = lax.axis_index(ring.axis), ring.size, w.shape[ring.kdim]
    w_aval = jax.ShapeDtypeStruct(w.shape, w.dtype)

    def dy_of(r: Any) -> jax.Array:  # the part of dy that shard r produced
        if ring.kind == "in":
            return dy
        return lax.dynamic_slice_in_dim(dy, r * width, width, axis=ring.xdim)

    def add_dx(dx: jax.Array | None, wc: jax.Array, r: Any) -> jax.Array:
        if ring.kind == "in":
            xs = _rows(x, r, width, ring)
            (d,) = jax.linear_transpose(
                lambda a: _dot(a, wc, ring), jax.ShapeDtypeStruct(xs.shape, xs.dtype)
            )(dy)
            base = jnp.zeros(x.shape, d.dtype) if dx is None else dx
            return lax.dynamic_update_slice_in_dim(base, d, r * width, axis=ring.xdim)
        (d,) = jax.linear_transpose(
            lambda a: _dot(a, wc, ring), jax.ShapeDtypeStruct(x.shape, x.dtype)
        )(dy_of(r))
        return d if dx is None else dx + d

    def dw_of(r: Any) -> jax.Array:  # this device's share of shard r's gradient
        a = _rows(x, r, width, ring) if ring.kind == "in" else x
        (g,) = jax.linear_transpose(lambda v: _dot(a, v, ring), w_aval)(dy_of(r))
        return g

    # Step t: weights of shard p − t give dx; the accumulator of shard p − t − 1 (which
    # left its first contributor at step 0) gains this device's share and moves on.
    dx, acc, wc = add_dx(None, w, p % n), dw_of((p - 1) % n), _shift(w, ring)

    def step(t: jax.Array, carry: tuple) -> tuple:
        dx, acc, wc = carry
        nxt = _shift(wc, ring)
        dx = add_dx(dx, wc, (p - t) % n)
        acc = _shift(acc, ring) + dw_of((p - t - 1) % n)
        return dx, acc, nxt

    dx, acc, wc = lax.fori_loop(1, n - 1, step, (dx, acc, wc))
    dx = add_dx(dx, wc, (p - n + 1) % n)
    acc = _shift(acc, ring) + dw_of(p % n)  # shard p, complete, at its owner
    return dx.astype(x.dtype), acc.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_dot(x: jax.Array, w: jax.Array, ring: _Ring) -> jax.Array:
    return _forward(x, w, ring)


def _ring_dot_fwd(x: jax.Array, w: jax.Array, ring: _Ring) -> tuple:
    return _forward(x, w, ring), (x, w)


_ring_dot.defvjp(_ring_dot_fwd, _backward)


def _ring(
    dims: Any, x_ndim: int, w_ndim: int, kdim: int, axis: str, size: int, precision: Any
) -> _Ring:
    (xc, wc), (xb, wb) = dims
    if xb or wb:
        raise ShardingError(
            f"TSP projections take no batch dimensions in dot_general, got {dims}.\n"
            "Fix: run this matmul without layer_schedule='tsp'."
        )
    xc, wc = tuple(xc), tuple(wc)
    if kdim in wc:
        return _Ring(((xc, wc), ((), ())), "in", kdim, xc[wc.index(kdim)], axis, size, precision)
    free = [i for i in range(w_ndim) if i not in wc]
    ydim = x_ndim - len(xc) + free.index(kdim)
    return _Ring(((xc, wc), ((), ())), "out", kdim, ydim, axis, size, precision)


def ring_dot(
    x: jax.Array,
    w: jax.Array,
    *,
    kind: Kind,
    axis: str,
    size: int,
    dims: Any = None,
    kdim: int | None = None,
    precision: Any = None,
) -> jax.Array:
    """Per-device body (inside ``jax.shard_map``) of a ring projection ``x @ W``.

    Args:
      x: this device's tokens; for ``"in"`` with every input feature.
      w: this device's shard of the kernel (dimension ``kdim`` divided by ``size``).
      kind: ``"in"`` (the split kernel dimension is contracted) or ``"out"`` (it is an
        output dimension; ``y`` gets all of it).
      axis, size: the mesh axis of the ring and its size.
      dims: ``lax.dot_general`` dimension numbers (default: x's last dimension with
        w's first); kdim: the split kernel dimension (default: 0 for ``"in"``, the last
        for ``"out"``).

    Returns:
      ``x @ W`` for this device's tokens, the whole output width. Differentiable:
      the backward sends the shards around again and each gradient shard home.
    """
    if dims is None:
        dims = (((x.ndim - 1,), (0,)), ((), ()))
    if kdim is None:
        kdim = 0 if kind == "in" else w.ndim - 1
    ring = _ring(dims, x.ndim, w.ndim, kdim, axis, size, precision)
    if ring.kind != kind:
        raise ShardingError(
            f"ring_dot: kernel dimension {kdim} makes a {ring.kind!r} ring, "
            f"not {kind!r}.\nFix: pass kind={ring.kind!r}."
        )
    return _ring_dot(x, w, ring)


def active_axis() -> str | None:
    """The TSP axis of the active context, or ``None`` when projections run as usual.

    Example:
      >>> active_axis() is None
      True
    """
    ctx = context.current()
    mesh = context.active_mesh()
    axis = ctx.attention_axis
    if (
        ctx.layer_schedule != "tsp"
        or mesh is None
        or ctx.param_rules is None
        or axis not in mesh.axis_names
        or mesh.shape[axis] == 1
    ):
        return None
    return axis


def _tsp_dot_general(
    x: jax.Array,
    w: jax.Array,
    dims: Any,
    *,
    kernel_axes: Sequence[str | None],
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general(x, w, dims)`` as a TSP ring over the active context's axis.

    ``x`` is ``[batch, length, ...]`` (length split over the axis, batch as the
    activation rules say); ``w``'s layout comes from the parameter rules and
    ``kernel_axes``. A kernel the rules do not split over the axis runs as an
    ordinary ``dot_general``.

    Raises:
      ShardingError: the sequence is not a multiple of 2·D (zigzag attention over the
        same axis), the kernel dimension is not divisible by D, or the axis shares a
        kernel dimension with another mesh axis (e.g. ``tensor``).
    """
    axis = active_axis()
    if axis is None:
        return lax.dot_general(x, w, dims, precision=precision)
    ctx, mesh = context.current(), context.active_mesh()
    n = mesh.shape[axis]
    where = f"TSP projection of kernel {tuple(kernel_axes)} {tuple(w.shape)}"
    kspec = tuple(ctx.param_rules.spec(tuple(kernel_axes), mesh=mesh)) + (None,) * w.ndim
    kdims = [i for i in range(w.ndim) if axis in entry_axes(kspec[i])]
    others = {
        a for i in range(w.ndim) for a in entry_axes(kspec[i]) if a != axis and mesh.shape[a] > 1
    }
    if others:
        raise ShardingError(
            f"{where}: the rules split it over {axis!r} and also over {sorted(others)} "
            f"(spec {PartitionSpec(*kspec[: w.ndim])}). TSP's ring holds every weight "
            f"1/{n} per device along one dimension, and {sorted(others)} would split the "
            f"same weights again.\nFix: map the kernel's names to {axis!r} only (drop the "
            f"'tensor' rules), or use layer_schedule='gspmd' (a tp_sp-style recipe)."
        )
    if not kdims:
        return lax.dot_general(x, w, dims, precision=precision)
    kdim = kdims[0]
    if w.shape[kdim] % n:
        raise ShardingError(
            f"{where}: dimension {kdim} ({kernel_axes[kdim]!r}) has {w.shape[kdim]} entries, "
            f"not divisible by {axis}={n}.\nFix: pick a model width divisible by {n}, or a "
            f"smaller {axis!r} axis."
        )
    seq = x.shape[1] if x.ndim > 1 else 0
    if seq % (2 * n):
        raise ShardingError(
            f"{where}: sequence length {seq} is not a multiple of 2·{axis} = {2 * n} (each "
            f"device holds two of {2 * n} zigzag chunks of every sequence).\nFix: pad or cut "
            f"sequences to a multiple of {2 * n}, or use a smaller {axis!r} axis."
        )
    ring = _ring(dims, x.ndim, w.ndim, kdim, axis, n, precision)
    rules = ctx.activation_rules
    batch = rules.spec(("batch",), mesh=mesh)[0] if rules is not None else None
    batch = tuple(a for a in entry_axes(batch) if a != axis) or None
    wspec = PartitionSpec(*(axis if i == kdim else None for i in range(w.ndim)))
    y_ndim = x.ndim + w.ndim - 2 * len(dims[0][0])

    def spec(ndim: int) -> PartitionSpec:
        return PartitionSpec(batch, axis, *(None,) * (ndim - 2))

    with scope("tsp.ring"):
        if is_explicit(mesh):
            x, w = jax.sharding.reshard(x, spec(x.ndim)), jax.sharding.reshard(w, wspec)
        return jax.shard_map(
            lambda x, w: checkpoint_name(_ring_dot(x, w, ring), SAVED_NAME),
            mesh=mesh,
            in_specs=(spec(x.ndim), wspec),
            out_specs=spec(y_ndim),
            check_vma=False,
        )(x, w)


@dataclasses.dataclass(frozen=True)
class TspDot:
    """A flax ``dot_general=`` that runs the TSP ring when the context asks for it.

    Args:
      kernel_axes: the logical axes of the kernel it multiplies.

    Example:
      >>> import flax.linen as nn
      >>> dense = nn.Dense(8, dot_general=TspDot(("embed", "mlp")))
      >>> params = dense.init(jax.random.key(0), jnp.ones((1, 4, 16)))
      >>> dense.apply(params, jnp.ones((1, 4, 16))).shape   # no TSP context: plain matmul
      (1, 4, 8)
    """

    kernel_axes: tuple[str | None, ...]

    def __call__(
        self,
        x: jax.Array,
        w: jax.Array,
        dims: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        extra = preferred_element_type is not None or any(v is not None for v in kwargs.values())
        if active_axis() is None or extra:
            return lax.dot_general(
                x,
                w,
                dims,
                precision=precision,
                preferred_element_type=preferred_element_type,
                **kwargs,
            )
        return _tsp_dot_general(x, w, dims, kernel_axes=self.kernel_axes, precision=precision)


@dataclasses.dataclass(frozen=True)
class TspEinsum:
    """An ``nnx.Einsum(einsum_op=...)`` that runs the TSP ring when the context asks.

    Two-operand einsums without batch letters (``"bsd,dhk->bshk"``), as Llama's.

    Example:
      >>> op = TspEinsum(("embed", "heads", "kv"))
      >>> op("bsd,dhk->bshk", jnp.ones((1, 4, 8)), jnp.ones((8, 2, 4))).shape
      (1, 4, 2, 4)
    """

    kernel_axes: tuple[str | None, ...]

    def __call__(
        self, spec: str, x: jax.Array, w: jax.Array, precision: Any = None, **kwargs: Any
    ) -> jax.Array:
        if active_axis() is None or any(v is not None for v in kwargs.values()):
            return jnp.einsum(spec, x, w, precision=precision, **kwargs)
        ins, out = spec.replace(" ", "").split("->")
        a, b = ins.split(",")
        contract = [c for c in a if c in b and c not in out]
        if any(c in b and c in out for c in a):
            return jnp.einsum(spec, x, w, precision=precision, **kwargs)
        dims = (
            (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
            ((), ()),
        )
        natural = "".join(c for c in a if c not in contract) + "".join(
            c for c in b if c not in contract
        )
        y = _tsp_dot_general(x, w, dims, kernel_axes=self.kernel_axes, precision=precision)
        return y if natural == out else jnp.transpose(y, [natural.index(c) for c in out])


_IN = (((2,), (0,)), ((), ()))  # [b, s, d] @ [d, ...]


def gated_mlp(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: Any = jax.nn.silu,
) -> jax.Array:
    """TSP's MLP: ``down(act(gate(x)) * up(x))`` (``w_gate=None``: ``down(act(up(x)))``).

    Kernels ``(embed, mlp)`` and ``(mlp, embed)``, each split along ``embed`` over the
    TSP axis: gate and up are ``"in"`` rings, down an ``"out"`` ring; every device keeps
    its tokens and sums nothing across devices. Outside a TSP context, plain matmuls.

    Example:
      >>> x, w = jnp.ones((1, 4, 8)), jnp.full((8, 16), 0.1)
      >>> gated_mlp(x, w, w, jnp.full((16, 8), 0.1)).shape
      (1, 4, 8)
    """
    mlp = ("embed", "mlp")
    h = _tsp_dot_general(x, w_up, _IN, kernel_axes=mlp)
    if w_gate is None:
        h = activation(h)
    else:
        h = activation(_tsp_dot_general(x, w_gate, _IN, kernel_axes=mlp)) * h
    return _tsp_dot_general(h, w_down, _IN, kernel_axes=("mlp", "embed"))


def attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    wo: jax.Array,
    rope: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """TSP's causal attention block: q/k/v rings, zigzag ring attention, out ring.

    Kernels: ``wq (embed, heads, kv)``, ``wk``/``wv (embed, kv_heads, kv)`` (GQA: the
    ring moves the K/V heads, each read by heads/kv_heads query heads), ``wo (heads, kv, embed)``; ``rope`` the
    ``(cos, sin)`` tables of :func:`shardkit.nn.rope.rope_tables`. Attention uses
    the context's strategy (``ring`` over the TSP axis in the ``tsp`` recipe).

    Example:
      >>> x = jnp.ones((1, 4, 8))
      >>> attention(x, jnp.ones((8, 2, 4)), jnp.ones((8, 1, 4)), jnp.ones((8, 1, 4)),
      ...           jnp.ones((2, 4, 8))).shape
      (1, 4, 8)
    """
    q = _tsp_dot_general(x, wq, _IN, kernel_axes=("embed", "heads", "kv"))
    k = _tsp_dot_general(x, wk, _IN, kernel_axes=("embed", "kv_heads", "kv"))
    v = _tsp_dot_general(x, wv, _IN, kernel_axes=("embed", "kv_heads", "kv"))
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    y = causal_attention(q, k, v)  # GQA: K/V travel with their own heads
    return _tsp_dot_general(
        y, wo, (((2, 3), (0, 1)), ((), ())), kernel_axes=("heads", "kv", "embed")
    )
