"""TSP's vocabulary rings: the head and its cross-entropy, and the embedding lookup.

Under the ``tsp`` recipe every device holds S/D of each sequence and 1/D of every
vocabulary table, split along the vocabulary (``V/D`` rows of a ``(vocab, embed)``
table or columns of an ``(embed, vocab)`` kernel). Gathering a table would put the
whole ``V × d`` matrix on every device (252 MiB for llama-1b in f32), and its gradient
too. Here both uses run like TSP's projections (:mod:`shardkit.nn.tsp`), over the
same axis:

- the head and loss (:func:`vocab_ring_cross_entropy`): at step t device p scores its
  own tokens against shard ``r = p − t`` (logits ``[b, S/D, V/D]``, one step's worth:
  the ``chunks`` of the chunked loss are not needed) while it passes the shard on to
  p + 1, and folds them into an online log-sum-exp (running max and sum), picking the
  target's logit from the shard that holds it. At most two vocabulary shards are live
  and every token stays home. The backward pass (``jax.custom_vjp``) keeps the tokens,
  their log-partition function and the device's own shard; it sends the shards round
  once more, recomputes each shard's logits and adds that shard's weight gradient into
  an accumulator that travels with it, so every gradient shard arrives at its owner
  complete. Wire per device, Ψ_V = V·d and f = (D − 1)/D: forward f·Ψ_V, backward
  2f·Ψ_V values (XLA shares the first hop between the two: one shard less).
- the lookup (:func:`vocab_ring_lookup`): each device looks its own rows up for every
  device's tokens and the partial embeddings travel a ring reduce-scatter home
  (f·b·S·d values); the gradient comes back as a ring all-gather.

:func:`shardkit.chunked_cross_entropy` calls :func:`vocab_ring_cross_entropy` first:
under ``layer_schedule="tsp"``, with the weight given as an array with its logical
axes and its vocabulary split over the TSP axis, the loss is this ring; otherwise it
returns ``None`` and the chunked loss runs as usual. The reference models call
:func:`vocab_ring_lookup` for their embedding the same way.

Example (outside a TSP context neither applies)::
  >>> import jax.numpy as jnp
  >>> h, w, t = jnp.ones((1, 8, 4)), jnp.zeros((4, 16)), jnp.zeros((1, 8), jnp.int32)
  >>> vocab_ring_cross_entropy(h, t, lambda w, x: x @ w, w, ("embed", "vocab")) is None
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import is_explicit
from shardkit.nn.tsp import active_axis
from shardkit.rules import entry_axes
from shardkit.scopes import block

__all__ = ["vocab_ring_cross_entropy", "vocab_ring_lookup"]


@dataclasses.dataclass(frozen=True)
class _Head:
    """Static description of one vocabulary ring (hashable: a custom_vjp argument)."""

    project: Callable[..., jax.Array]  # (weight shard, hidden) -> logits of that shard
    axis: str
    size: int


def _shift(v: jax.Array, ring: Any) -> jax.Array:
    """Send ``v`` to the next device of the ring (p → p + 1)."""
    n = ring.size
    return lax.ppermute(v, ring.axis, [(j, (j + 1) % n) for j in range(n)])


def _is_target(t: jax.Array, r: Any, width: int) -> jax.Array:
    """``[..., V/D]`` mask of the target among shard ``r``'s vocabulary entries."""
    return jnp.arange(width) == (t - r * width)[..., None]


def _forward(h: jax.Array, t: jax.Array, w: jax.Array, head: _Head) -> tuple:
    p, n = lax.axis_index(head.axis), head.size

    def fold(carry: tuple | None, wc: jax.Array, r: Any) -> tuple:
        logits = head.project(wc, h).astype(jnp.float32)
        picked = jnp.sum(jnp.where(_is_target(t, r, logits.shape[-1]), logits, 0.0), -1)
        top = logits.max(-1)
        if carry is None:
            return top, jnp.exp(logits - top[..., None]).sum(-1), picked
        m, s, target = carry
        m_new = jnp.maximum(m, top)
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(-1)
        return m_new, s, target + picked

    def step(i: jax.Array, state: tuple) -> tuple:
        carry, wc = state
        nxt = _shift(wc, head)  # independent of this step's scores: the two can overlap
        return fold(carry, wc, (p - i) % n), nxt

    carry = fold(None, w, p)
    carry, wc = lax.fori_loop(1, n - 1, step, (carry, _shift(w, head)))
    m, s, target = fold(carry, wc, (p - n + 1) % n)
    lse = m + jnp.log(s)
    return lse - target, lse


def _backward(head: _Head, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    h, t, w, lse = res
    p, n = lax.axis_index(head.axis), head.size

    def grads(wc: jax.Array, r: Any) -> tuple[jax.Array, jax.Array]:
        logits, pull = jax.vjp(head.project, wc, h)
        x = logits.astype(jnp.float32)
        prob = jnp.exp(x - lse[..., None])
        dlogits = (prob - _is_target(t, r, x.shape[-1])) * g[..., None]
        dw, dh = pull(dlogits.astype(logits.dtype))
        return dh, dw

    dh, mine = grads(w, p)  # step 0: own shard; its gradient waits for the others'
    wc = _shift(w, head)  # shard p − 1
    if n == 2:
        d, acc = grads(wc, (p - 1) % n)
        return (dh + d).astype(h.dtype), (_shift(acc, head) + mine).astype(w.dtype)
    nxt = _shift(wc, head)
    d, acc = grads(wc, (p - 1) % n)  # the accumulator of shard p − 1 starts here
    dh = dh + d

    def step(i: jax.Array, state: tuple) -> tuple:
        dh, acc, wc = state
        nxt = _shift(wc, head)
        d, a = grads(wc, (p - i) % n)
        return dh + d, _shift(acc, head) + a, nxt

    dh, acc, wc = lax.fori_loop(2, n - 1, step, (dh, acc, nxt))
    d, a = grads(wc, (p - n + 1) % n)
    dh, acc = dh + d, _shift(acc, head) + a
    return dh.astype(h.dtype), (_shift(acc, head) + mine).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_loss(h: jax.Array, t: jax.Array, w: jax.Array, head: _Head) -> jax.Array:
    return _forward(h, t, w, head)[0]


def _ring_loss_fwd(h, t, w, head):
    loss, lse = _forward(h, t, w, head)
    return loss, (h, t, w, lse)


def _ring_loss_bwd(head, res, g):
    dh, dw = _backward(head, res, g)
    return dh, None, dw  # no cotangent for the integer targets


_ring_loss.defvjp(_ring_loss_fwd, _ring_loss_bwd)


def _layout(
    weight: jax.Array,
    weight_axes: Sequence[str | None],
    vocab: str | None,
    token_axes: Sequence[str | None],
    token_shape: tuple[int, ...],
) -> tuple | None:
    """``(mesh, axis, D, vocab dim, token spec)`` when the TSP vocabulary rings apply.

    They do under ``layer_schedule="tsp"`` when the rules split the weight's ``vocab``
    dimension, and no other, over the TSP axis, and the tokens over it too.
    """
    axis = active_axis()
    if axis is None:
        return None
    ctx, mesh = context.current(), context.active_mesh()
    weight_axes = tuple(weight_axes)
    if vocab not in weight_axes or ctx.activation_rules is None:
        return None
    wspec = tuple(ctx.param_rules.spec(weight_axes, shape=weight.shape, mesh=mesh))
    wspec += (None,) * (weight.ndim - len(wspec))
    vdim = weight_axes.index(vocab)
    split = [(i, a) for i, e in enumerate(wspec) for a in entry_axes(e) if mesh.shape[a] > 1]
    if split != [(vdim, axis)]:
        return None
    tspec = tuple(
        ctx.activation_rules.spec(
            tuple(token_axes), shape=tuple(token_shape), mesh=mesh, path="tokens"
        )
    )
    tspec += (None,) * (len(token_shape) - len(tspec))
    if axis not in {a for e in tspec for a in entry_axes(e)}:
        return None
    return mesh, axis, mesh.shape[axis], vdim, PartitionSpec(*tspec)


@block("tsp.head")
def vocab_ring_cross_entropy(
    hidden: jax.Array,
    targets: jax.Array,
    project: Callable[..., jax.Array],
    weight: jax.Array,
    weight_axes: Sequence[str | None],
    logits_axes: Sequence[str | None] = ("batch", "length", "vocab"),
) -> jax.Array | None:
    """Per-token cross-entropy of ``project(weight, hidden)`` as a TSP vocabulary ring.

    Args:
      hidden: ``[*tokens, d]`` hidden states; targets: ``int[*tokens]``.
      project: ``(weight, hidden) -> logits``; applied to one vocabulary shard of the
        weight at a time, it must give that shard's logits (a matmul does).
      weight, weight_axes: the head's weight and its logical axes (one of them the
        logits' last name, ``"vocab"``).
      logits_axes: logical axes of the logits.

    Returns:
      ``f32[*tokens]``, or ``None`` where the ring does not apply (no TSP schedule
      active, or the rules do not split the weight's vocabulary, and only it, over the
      TSP axis, or the tokens over it).
    """
    layout = _layout(weight, weight_axes, logits_axes[-1], logits_axes[:-1], targets.shape)
    if layout is None:
        return None
    mesh, axis, n, vdim, tspec = layout
    head = _Head(project, axis, n)
    hspec = PartitionSpec(*tspec, None)
    wspec = PartitionSpec(*(axis if i == vdim else None for i in range(weight.ndim)))
    if is_explicit(mesh):
        hidden, targets = jax.sharding.reshard(hidden, hspec), jax.sharding.reshard(targets, tspec)
        weight = jax.sharding.reshard(weight, wspec)
    return jax.shard_map(
        lambda h, t, w: _ring_loss(h, t, w, head),
        mesh=mesh,
        in_specs=(hspec, tspec, wspec),
        out_specs=tspec,
        check_vma=False,
    )(hidden, targets, weight)


# ------------------------------------------------------------------ the lookup


@dataclasses.dataclass(frozen=True)
class _Lookup:
    axis: str
    size: int
    dims: tuple[int, ...]  # the token dimensions split over the axis
    shard: tuple[int, int]  # this device's rows of the table: (V/D, d)
    dtype: Any


def _block(ids: jax.Array, j: Any, lookup: _Lookup, local: tuple[int, ...]) -> jax.Array:
    """Device ``j``'s tokens out of all of them (``ids`` gathered over the axis)."""
    for dim in lookup.dims:
        ids = lax.dynamic_slice_in_dim(ids, j * local[dim], local[dim], axis=dim)
    return ids


def _rows(table: jax.Array, ids: jax.Array, p: Any) -> jax.Array:
    """Embeddings of ``ids`` from this device's rows of the table (zero elsewhere)."""
    rows = table.shape[0]
    local = ids - p * rows
    inside = (local >= 0) & (local < rows)
    x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
    return jnp.where(inside[..., None], x, jnp.zeros((), table.dtype))


def _gather_ids(ids: jax.Array, lookup: _Lookup) -> jax.Array:
    for dim in lookup.dims:
        ids = lax.all_gather(ids, lookup.axis, axis=dim, tiled=True)
    return ids


def _lookup_forward(table: jax.Array, ids: jax.Array, lookup: _Lookup) -> jax.Array:
    p, n = lax.axis_index(lookup.axis), lookup.size
    every = _gather_ids(ids, lookup)  # token ids: 4 bytes a token

    def rows_for(j: Any) -> jax.Array:
        return _rows(table, _block(every, j, lookup, ids.shape), p)

    # A ring reduce-scatter: the sum for device j's tokens starts at j + 1 and gains
    # each device's rows on its way round to j.
    def step(t: jax.Array, acc: jax.Array) -> jax.Array:
        return _shift(acc, lookup) + rows_for((p - t - 1) % n)

    acc = lax.fori_loop(1, n - 1, step, rows_for((p - 1) % n))
    return _shift(acc, lookup) + rows_for(p)


def _lookup_backward(lookup: _Lookup, res: tuple, g: jax.Array) -> tuple:
    (every,) = res
    p, n = lax.axis_index(lookup.axis), lookup.size
    rows = lookup.shard[0]

    def scatter(grad: jax.Array, gc: jax.Array, j: Any) -> jax.Array:
        local = _block(every, j, lookup, gc.shape[:-1]) - p * rows
        inside = (local >= 0) & (local < rows)
        vals = jnp.where(inside[..., None], gc, jnp.zeros((), gc.dtype)).reshape(-1, gc.shape[-1])
        return grad.at[jnp.clip(local, 0, rows - 1).reshape(-1)].add(vals.astype(grad.dtype))

    # A ring all-gather of the embeddings' gradient: each device adds the rows it owns.
    def step(t: jax.Array, state: tuple) -> tuple:
        grad, gc = state
        gc = _shift(gc, lookup)
        return scatter(grad, gc, (p - t) % n), gc

    grad = scatter(jnp.zeros(lookup.shard, jnp.float32), g, p)
    grad, _ = lax.fori_loop(1, n, step, (grad, g))
    return grad.astype(lookup.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_lookup(table: jax.Array, ids: jax.Array, lookup: _Lookup) -> jax.Array:
    return _lookup_forward(table, ids, lookup)


def _ring_lookup_fwd(table, ids, lookup):
    every = _gather_ids(ids, lookup)
    return _lookup_forward(table, ids, lookup), (every,)


_ring_lookup.defvjp(_ring_lookup_fwd, _lookup_backward)


@block("tsp.lookup")
def vocab_ring_lookup(
    table: jax.Array,
    tokens: jax.Array,
    table_axes: Sequence[str | None],
    token_axes: Sequence[str | None] = ("batch", "length"),
) -> jax.Array | None:
    """``table[tokens]`` as a TSP ring over the vocabulary shards of a ``(vocab, d)`` table.

    Each device looks up, in its own rows, the tokens of every device (the token ids
    are all-gathered: 4 bytes a token), and the partial embeddings travel a ring
    reduce-scatter, block by block, to the device that holds those tokens: f·b·S·d
    values per device, and never a ``[b, S, d]`` buffer (XLA's lookup builds one).
    Backward, the embeddings' gradient travels a ring all-gather and each device adds
    the rows it owns into its shard of the table's gradient.

    Returns:
      ``[*tokens.shape, d]``, or ``None`` where the ring does not apply (as for
      :func:`vocab_ring_cross_entropy`; the table's first axis must be the vocabulary).

    Example:
      >>> import jax.numpy as jnp
      >>> vocab_ring_lookup(jnp.ones((16, 4)), jnp.zeros((1, 8), jnp.int32),
      ...                   ("vocab", "embed")) is None   # no TSP context
      True
    """
    layout = _layout(table, table_axes, "vocab", token_axes, tokens.shape)
    if layout is None or layout[3] != 0 or table.ndim != 2:
        return None
    mesh, axis, n, _, tspec = layout
    dims = tuple(i for i, e in enumerate(tspec) if axis in entry_axes(e))
    lookup = _Lookup(axis, n, dims, (table.shape[0] // n, table.shape[1]), table.dtype)
    wspec = PartitionSpec(axis, None)
    if is_explicit(mesh):
        tokens, table = jax.sharding.reshard(tokens, tspec), jax.sharding.reshard(table, wspec)
    return jax.shard_map(
        lambda w, t: _ring_lookup(w, t, lookup),
        mesh=mesh,
        in_specs=(wspec, tspec),
        out_specs=PartitionSpec(*tspec, None),
        check_vma=False,
    )(table, tokens)
