"""TSP's vocabulary head and cross-entropy: the head's vocabulary shards travel a ring.

Under the ``tsp`` recipe every device holds S/D of each sequence and 1/D of the head's
weight, split along the vocabulary (``V/D`` rows of a ``(vocab, embed)`` table or
columns of an ``(embed, vocab)`` kernel). Gathering the weight for the logits would put
the whole ``V × d`` matrix on every device (252 MiB for llama-1b in f32), and its
gradient too. Here the head runs like TSP's projections (:mod:`shardkit.parallel.tsp`):
at step t device p scores its own tokens against shard ``r = p − t`` (logits
``[b, S/D, V/D]``) while it passes the shard on to p + 1, and folds them into an online
log-sum-exp (running max and sum), picking the target's logit from the shard that holds
it. No device ever holds more than two vocabulary shards, and every token stays home.

The backward pass (``jax.custom_vjp``) keeps the tokens, their log-partition function
and the device's own shard. It sends the shards round once more, recomputes each
shard's logits, and adds that shard's weight gradient into an accumulator that travels
with it, so every gradient shard arrives at its owner complete. Wire per device, with
Ψ_V = V·d head weights and f = (D − 1)/D: forward f·Ψ_V, backward 2f·Ψ_V values.

:func:`shardkit.chunked_cross_entropy` calls :func:`vocab_ring_cross_entropy` first:
under ``layer_schedule="tsp"``, with the weight given as an array with its logical
axes and its vocabulary split over the TSP axis, the loss is this ring; otherwise it
returns ``None`` and the chunked loss runs as usual.

Example:
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
from shardkit.parallel.tsp import active_axis

__all__ = ["vocab_ring_cross_entropy"]


@dataclasses.dataclass(frozen=True)
class _Head:
    """Static description of one vocabulary ring (hashable: a custom_vjp argument)."""

    project: Callable[..., jax.Array]  # (weight shard, hidden) -> logits of that shard
    axis: str
    size: int


def _shift(v: jax.Array, head: _Head) -> jax.Array:
    n = head.size
    return lax.ppermute(v, head.axis, [(j, (j + 1) % n) for j in range(n)])


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


def _names(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def vocab_ring_cross_entropy(hidden: jax.Array, targets: jax.Array,
                             project: Callable[..., jax.Array], weight: jax.Array,
                             weight_axes: Sequence[str | None],
                             logits_axes: Sequence[str | None] = ("batch", "length", "vocab"),
                             ) -> jax.Array | None:  # fmt: skip
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
    axis = active_axis()
    if axis is None:
        return None
    ctx, mesh = context.current(), context.active_mesh()
    n, weight_axes, vocab = mesh.shape[axis], tuple(weight_axes), logits_axes[-1]
    if vocab not in weight_axes or ctx.activation_rules is None:
        return None
    wspec = tuple(ctx.param_rules.spec(weight_axes, shape=weight.shape, mesh=mesh))
    wspec += (None,) * (weight.ndim - len(wspec))
    vdim = weight_axes.index(vocab)
    split = [(i, a) for i, e in enumerate(wspec) for a in _names(e) if mesh.shape[a] > 1]
    if split != [(vdim, axis)]:
        return None
    token_axes = tuple(logits_axes[:-1])
    tspec = tuple(ctx.activation_rules.spec(token_axes, shape=targets.shape, mesh=mesh,
                                            path="targets"))  # fmt: skip
    tspec += (None,) * (targets.ndim - len(tspec))
    if axis not in {a for e in tspec for a in _names(e)}:
        return None
    head = _Head(project, axis, n)
    tspec = PartitionSpec(*tspec)
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
