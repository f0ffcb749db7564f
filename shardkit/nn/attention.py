"""Causal attention over a sequence sharded across devices (context parallelism).

``causal_attention(q, k, v)`` computes the same causal softmax attention under
three strategies, chosen with ``use_attention`` (a recipe's ``attention`` names one):

- ``"dense"``: one einsum over the whole sequence; GSPMD shards it as it sees fit.
  The reference, and the right choice when the sequence is not sharded.
- ``"allgather"``: each device all-gathers K and V along the sequence axis and
  attends its local queries to them. Simple and fast for moderate sequences.
  Per device, forward: an all-gather of K/V moving 2·b·s·h·d·bytes·(N−1)/N;
  scores [b, h, s/N, s]; the backward reduce-scatters dK/dV (same volume).
- ``"ring"``: ring attention. Each device keeps its query block while K/V blocks
  travel around the ring, combined by an online softmax (f32 running max and
  sum). Per device, forward: (N−1) collective-permutes of the local K/V block,
  2·b·(s/N)·h·d·bytes each; scores of one block at a time: [b, h, s/N, s/N] for
  the device's own block, [b, h, s/N, s/(2N)] for the others, never [s/N, s].
  Use it when the sequence is too long for allgather. Under grouped-query attention
  (K/V with fewer heads than q) h is the K/V heads: blocks travel with their own heads
  and are repeated to the query heads on arrival.
- ``"ulysses"``: all-to-all from a sequence split to a head split and back
  (:mod:`shardkit.nn.ulysses`); each device attends the whole sequence for h/N heads.
- ``"usp"``: Ulysses × ring (Fang & Zhao 2024) over a pair of axes
  ``(ulysses_axis, ring_axis)`` of sizes U × R, the sequence split over both
  (ring-major): an all-to-all over the Ulysses axis gives each device its ring rank's
  s/R tokens of h/U heads, ring attention over the ring axis attends them, an
  all-to-all brings the output back. Per device and pass: the all-to-alls move
  (U−1)/U·b·(s/(U·R))·(2h + 2h_kv)·bytes, the ring (R−1)/R·2·b·s·(h_kv/U)·bytes.
  Heads ∤ U or a sequence that is not a multiple of lcm(U·R, 2R) is a
  ``ShardingError`` naming the nearest valid setting
  (:func:`shardkit.nn.ulysses.check_usp`). An axis of size 1 leaves the other's
  strategy alone (ring or Ulysses).

Ring load balancing (zigzag): the sequence is cut into 2N chunks and device i
attends for chunks i and 2N−1−i, so under causal masking every device does the
same work, and each off-diagonal step computes only the unmasked half of a block
(selected with ``lax.cond``; both branches are half a block), the own block its 3
unmasked chunk pairs of 4: 3 + 2(N−1) chunk pairs against a full ring's 4N, in the
compiled program (its static FLOPs fall by the masked blocks). Callers pass the
ordinary contiguous layout: ``causal_attention`` moves q, k, v into zigzag order
inside the ``shard_map`` and the output back, with 4 partial collective-permutes
each way that send at most one local block per device (b·(s/N)·h·d·bytes for each
of q, k, v and the output), i.e. 4/(2(N−1)) of the ring's own traffic, paid on
every call. Rows placed in the zigzag order already, one causal document each
(``Plan.shard_batch``'s placement: segments, and ``zigzag_ranks`` = N in the
context, which ``Model.loss`` sets from ``batch["zigzag"]``), run the same static
ring without the reorder (alone, or USP's over its ring axis).

Packed rows (segments without that promise: real documents, or any order) take the
packed ring instead: each K/V block travels with its segment ids and positions and
each fully masked chunk pair is skipped at run time (``lax.cond``). The time falls;
the compiled FLOPs (a conditional counts as its costliest branch) count every pair.

Memory of the backward pass: the ring's gradient is JAX's autodiff of the
forward. Each step is rematerialized (``jax.checkpoint``), so no score block is
kept, but the scan saves the K/V block of every step: ≈ the full K/V per device,
as for allgather. A hand-written ring backward would avoid that.

Without an active mesh (``jax.set_mesh``; the deprecated ``with mesh:`` is not
seen), or when the mesh lacks the sequence axis or it has size 1, every strategy
falls back to ``"dense"``.
Batch and head dimensions are sharded as the active ``activation_rules`` map
``("batch", "length", "heads", "kv")``; the length dimension always goes on the
sequence axis and ``kv`` (head_dim) is never sharded inside attention.

References:
  Liu, Zaharia, Abbeel (2023), Ring Attention with Blockwise Transformers for
  Near-Infinite Context. Brandon et al. (2023), Striped Attention: Faster Ring
  Attention for Causal Transformers (load balancing; the zigzag layout is the one
  used for context parallelism in e.g. Llama 3).

Example:
  >>> import jax.numpy as jnp
  >>> from shardkit.nn.attention import causal_attention
  >>> q = jnp.ones((1, 4, 2, 8))
  >>> causal_attention(q, q, q).shape   # no mesh: dense
  (1, 4, 2, 8)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import constrain, current_activation_rules, is_explicit
from shardkit.context import AttentionStrategy, context_axes
from shardkit.errors import ShardingError
from shardkit.nn.segments import Segments, check_segments, segment_mask
from shardkit.nn.ulysses import check_heads, check_usp, ulysses_attention
from shardkit.rules import Rules
from shardkit.scopes import block

__all__ = [
    "AttentionStrategy",
    "Segments",
    "causal_attention",
    "current_attention",
    "masked_softmax",
    "use_attention",
]

_LOGICAL = ("batch", "length", "heads", "kv")
_NEG = float(jnp.finfo(jnp.float32).min)


def use_attention(strategy: AttentionStrategy, *, axis: str | tuple[str, str] = "sequence"):
    """Make ``causal_attention`` use ``strategy`` over mesh axis ``axis``, restoring on exit.

    ``"usp"`` takes a pair ``axis=(ulysses_axis, ring_axis)``.

    The strategy is read when ``causal_attention`` is traced, and ``jax.jit``
    caches traces by function and arguments, not by this context: jit a fresh
    function (or clear its cache) to trace the same step under another strategy.
    """
    axis = axis if isinstance(axis, str) else tuple(axis)
    # an unknown strategy, or a strategy on the wrong number of axes, fails here, not later
    context.ShardingContext(attention=strategy, attention_axis=axis)
    return context.using(attention=strategy, attention_axis=axis)


def current_attention() -> tuple[AttentionStrategy, str | tuple[str, str]]:
    """``(strategy, axis)`` of the active context; ``("dense", "sequence")`` by default."""
    ctx = context.current()
    return ctx.attention, ctx.attention_axis


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    return s * (1.0 / math.sqrt(q.shape[-1]))


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """GQA: K/V heads repeated to the query heads (head i reads K/V head i // (h/g)).

    Inside ring and all-gather attention this runs after the exchange, on the block a
    device uses, so the K/V cross the wire with their own heads.
    """
    return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, qpos: jax.Array, kpos: jax.Array, pin=None):
    """Softmax attention of ``q`` to ``k``/``v``, masked to ``kpos <= qpos``, f32 [b,q,h,d].

    ``pin`` constrains the [b, h, q, k] scores (outside ``shard_map`` only).
    """
    k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    scores = _scores(q, k) if pin is None else pin(_scores(q, k))
    keep = qpos[:, None] >= kpos[None, :]
    if v.dtype == jnp.float32:
        p = jax.nn.softmax(jnp.where(keep, scores, _NEG), axis=-1)
    else:  # mixed precision: keep the probabilities for the backward in v's dtype only
        p = masked_softmax(scores, keep, v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def masked_softmax(scores: jax.Array, keep: jax.Array, dtype: Any) -> jax.Array:
    """``softmax(where(keep, scores, -inf))`` over the last axis, computed in f32 and
    returned in ``dtype``, whose backward keeps only that output.

    JAX's own softmax keeps f32 copies of the masked scores and their exponentials
    (and ``where`` its mask) for the backward: 9 bytes per score where bf16 mixed
    precision wants 2. The gradient needs the probabilities alone,
    ``ds = p·(g − Σ p·g)`` (zero where masked, since ``p`` is), so this keeps ``p`` in
    ``dtype``, as Megatron's fused softmax keeps its fp16 output (Shoeybi et al. 2019).

    Example:
      >>> import jax.numpy as jnp
      >>> s = jnp.array([[0.0, 1.0, 2.0]])
      >>> masked_softmax(s, jnp.array([True, True, False]), jnp.bfloat16).dtype
      dtype(bfloat16)
    """
    return jax.nn.softmax(jnp.where(keep, scores, _NEG), axis=-1).astype(dtype)


def _masked_softmax_fwd(scores, keep, dtype):
    p = masked_softmax(scores, keep, dtype)
    return p, (p, keep.shape)


def _masked_softmax_bwd(dtype, res, g):
    p, keep_shape = res  # the mask's shape is static: nothing of it is kept
    p, g = p.astype(jnp.float32), g.astype(jnp.float32)
    ds = p * (g - jnp.sum(p * g, axis=-1, keepdims=True))
    return ds, np.zeros(keep_shape, dtype=jax.dtypes.float0)


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def _dense(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The reference; K/V sharded on length by an Explicit mesh are gathered first.

    GQA's K/V are repeated to the query heads here (GSPMD lays out the dense einsum).
    """
    if k.shape != q.shape:
        k, v = (_repeat_heads(x, q.shape[2]) for x in (k, v))
    k, v = (_unshard_length(x) for x in (k, v))
    pos = jnp.arange(q.shape[1])
    # Scores keep the heads' layout; left free, XLA may reshard them between the forward
    # and backward passes (all-to-alls under tensor + sequence parallelism).
    pin = functools.partial(constrain, logical=("batch", "heads", "length", None))
    return _attend(q, k, v, pos, pos, pin).astype(q.dtype)


def _repeat_heads(x: jax.Array, heads: int) -> jax.Array:
    return constrain(_heads(x, heads), _LOGICAL)


def _unshard_length(x: jax.Array) -> jax.Array:
    sharding = jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()))
    if len(spec) < 2 or spec[1] is None:
        return x
    return jax.sharding.reshard(x, sharding.update(spec=PartitionSpec(spec[0], None, *spec[2:])))


def _online(carry: tuple, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any = None) -> tuple:
    """Fold one K/V block into the running (max, sum, acc) of an online softmax."""
    m, denom, acc = carry
    k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    s = _scores(q, k)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv


@block("attention.zigzag")
def _zigzag(x: jax.Array, axis: str, n: int, *, inverse: bool = False) -> jax.Array:
    """Move 2n sequence chunks (2 per device, on dim 2) from contiguous to zigzag order.

    Contiguous: chunk g is slot g % 2 of device g // 2. Zigzag: device i holds
    chunks i (slot 0) and 2n-1-i (slot 1). One partial collective-permute per
    (source slot, destination slot) pair; devices that receive nothing from one
    get zeros, so the sum over source slots is exact.
    """
    src = [(g // 2, g % 2) for g in range(2 * n)]
    dst = [(g, 0) if g < n else (2 * n - 1 - g, 1) for g in range(2 * n)]
    if inverse:
        src, dst = dst, src
    c = x.shape[2] // 2
    slots = (x[:, :, :c], x[:, :, c:])
    out = []
    for b in (0, 1):
        parts = []
        for a in (0, 1):
            perm = [(s[0], d[0]) for s, d in zip(src, dst, strict=True) if (s[1], d[1]) == (a, b)]
            if perm:
                parts.append(jax.lax.ppermute(slots[a], axis, perm))
        out.append(sum(parts[1:], parts[0]))
    return jnp.concatenate(out, axis=2)


@block("attention.ring")
def _ring(
    q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, n: int, placed: bool = False
) -> jax.Array:
    """Per-device body of zigzag load-balanced ring attention.

    ``placed``: q/k/v arrive in the zigzag order already (the batch was placed so,
    :mod:`shardkit.balance`) and the output leaves in it; else they arrive contiguous
    and are moved into the zigzag order and back here (:func:`_zigzag`).

    The masks are static: of the own block the 3 unmasked (query chunk, key chunk)
    pairs run (the first chunk's rows never see the second chunk's keys), and of every
    other rank's block the 2 unmasked ones (``lower``/``upper``), so a device computes
    3 + 2·(n − 1) chunk pairs against the 4·n of a ring computing every block.
    """
    if not placed and q.shape == k.shape:
        q, k, v = _zigzag(jnp.stack([q, k, v]), axis, n)
    elif not placed:  # GQA: K/V travel with their own (fewer) heads
        q, (k, v) = _zigzag(q[None], axis, n)[0], _zigzag(jnp.stack([k, v]), axis, n)
    b, s, h, d = q.shape
    c = s // 2
    r = jax.lax.axis_index(axis)
    pos = jnp.concatenate([r * c + jnp.arange(c), (2 * n - 1 - r) * c + jnp.arange(c)])
    causal = pos[:, None] >= pos[None, :]

    def init(rows: int) -> tuple:
        return jnp.full((b, h, rows), _NEG), jnp.zeros((b, h, rows)), jnp.zeros((b, h, rows, d))

    # own block: chunk i's rows see chunk i's keys (causal); chunk 2n−1−i's rows all keys
    lo = _online(init(c), q[:, :c], k[:, :c], v[:, :c], causal[:c, :c])
    hi = _online(init(c), q[:, c:], k, v, causal[c:])
    carry = tuple(jnp.concatenate(xy, axis=2) for xy in zip(lo, hi, strict=True))

    def lower(carry: tuple, kv: jax.Array) -> tuple:  # source r' < r: all rows, first chunk
        return _online(carry, q, kv[0, :, :c], kv[1, :, :c])

    def upper(carry: tuple, kv: jax.Array) -> tuple:  # source r' > r: second chunk rows only
        hi = _online(tuple(x[:, :, c:] for x in carry), q[:, c:], kv[0], kv[1])
        return tuple(
            jnp.concatenate([x[:, :, :c], y], axis=2) for x, y in zip(carry, hi, strict=True)
        )

    @jax.checkpoint
    def fold(carry: tuple, kv: jax.Array, below: jax.Array) -> tuple:
        return jax.lax.cond(below, lower, upper, carry, kv)

    def step(t: jax.Array, state: tuple) -> tuple:
        kv, carry = state
        kv = jax.lax.ppermute(kv, axis, [(j, (j + 1) % n) for j in range(n)])
        return kv, fold(carry, kv, (r - t) % n < r)

    _, (_, denom, acc) = jax.lax.fori_loop(1, n, step, (jnp.stack([k, v]), carry))
    out = (acc / denom[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)
    return out if placed else _zigzag(out[None], axis, n, inverse=True)[0]


@block("attention.all_gather_kv")
def _allgather(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, n: int) -> jax.Array:
    """Per-device body of all-gather attention: local queries against the full K/V."""
    k, v = jax.lax.all_gather(jnp.stack([k, v]), axis, axis=2, tiled=True)
    s = q.shape[1]
    qpos = jax.lax.axis_index(axis) * s + jnp.arange(s)
    return _attend(q, k, v, qpos, jnp.arange(n * s)).astype(q.dtype)


# -- packed rows: segment ids and positions (shardkit.nn.segments) ----------------------
def _softmax_pv(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, pin=None):
    """Softmax attention of ``q`` to ``k``/``v`` where ``keep`` [b, q, k] holds, f32 [b,q,h,d].

    A query with no key at all (padding) gets 0, as in the ring.
    """
    k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    scores = _scores(q, k) if pin is None else pin(_scores(q, k))
    keep = keep[:, None]
    if v.dtype == jnp.float32:
        p = jax.nn.softmax(jnp.where(keep, scores, _NEG), axis=-1)
    else:
        p = masked_softmax(scores, jnp.broadcast_to(keep, scores.shape), v.dtype)
    p = p * keep.any(-1, keepdims=True).astype(p.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _dense_packed(q: jax.Array, k: jax.Array, v: jax.Array, seg: Segments) -> jax.Array:
    """The reference for packed rows: the block-diagonal causal mask over the whole row."""
    if k.shape != q.shape:
        k, v = (_repeat_heads(x, q.shape[2]) for x in (k, v))
    k, v = (_unshard_length(x) for x in (k, v))
    kseg = Segments(*(_unshard_length(x) for x in seg))
    pin = functools.partial(constrain, logical=("batch", "heads", "length", None))
    return _softmax_pv(q, k, v, segment_mask(seg, kseg), pin).astype(q.dtype)


@block("attention.all_gather_kv")
def _allgather_packed(q, k, v, seg: Segments, *, axis: str, n: int) -> jax.Array:
    """All-gather attention of packed rows: K/V gathered with their segment ids and positions."""
    k, v = jax.lax.all_gather(jnp.stack([k, v]), axis, axis=2, tiled=True)
    kseg = Segments(*jax.lax.all_gather(jnp.stack(seg), axis, axis=2, tiled=True))
    return _softmax_pv(q, k, v, segment_mask(seg, kseg)).astype(q.dtype)


@block("attention.ring")
def _ring_packed(q, k, v, seg: Segments, *, axis: str, n: int) -> jax.Array:
    """Ring attention of packed rows, in the layout the batch was placed in (no reorder).

    Each K/V block travels with its segment ids and positions. Every local block is cut
    in two chunks, and each pair of a query chunk and a K/V chunk in which no query may
    attend any key (other documents, or only later positions) is skipped (``lax.cond``):
    nothing of it is computed at run time, but the compiled program holds every pair
    (its static FLOPs count them all). The batch's placement decides the balance: under
    the zigzag order (:mod:`shardkit.balance`) 2 of the 4 pairs of every other rank's
    block run, and 3 of the own block's, the static zigzag ring's work; packed rows
    balanced by :func:`shardkit.packing.balance_permutation`, or contiguous. Rows marked
    as one document each in the zigzag order (``zigzag_ranks``) run :func:`_ring`
    instead, whose compiled program holds only those pairs.
    """
    b, s, h, d = q.shape
    c = s // 2
    qs = (q[:, :c], q[:, c:])
    qseg = tuple(Segments(seg.ids[:, p], seg.positions[:, p]) for p in (slice(0, c), slice(c, s)))
    zero = jnp.zeros_like(q[:, :c], jnp.float32).transpose(0, 2, 1, 3)  # varies as q does
    init = (zero[..., 0] + _NEG, zero[..., 0], zero)

    def pair(carry: tuple, a: int, kv: jax.Array, kseg: jax.Array, j: int) -> tuple:
        part = slice(j * c, (j + 1) * c)
        keep = segment_mask(qseg[a], Segments(kseg[0, :, part], kseg[1, :, part]))
        return jax.lax.cond(
            keep.any(),
            lambda x: _online(x, qs[a], kv[0, :, part], kv[1, :, part], keep[:, None]),
            lambda x: x,
            carry,
        )

    @functools.partial(jax.checkpoint, static_argnums=(3,))
    def fold(carries: tuple, kv: jax.Array, kseg: jax.Array, own: bool) -> tuple:
        out = []
        for a in (0, 1):  # own block: the diagonal chunk first, so every row has a maximum
            carry = carries[a]
            for j in (a, 1 - a) if own else (0, 1):
                carry = pair(carry, a, kv, kseg, j)
            out.append(carry)
        return tuple(out)

    kv, kseg = jnp.stack([k, v]), jnp.stack(seg)
    carries = fold((init, init), kv, kseg, True)

    def step(t: jax.Array, state: tuple) -> tuple:
        kv, kseg, carries = state
        kv, kseg = jax.lax.ppermute((kv, kseg), axis, [(j, (j + 1) % n) for j in range(n)])
        return kv, kseg, fold(carries, kv, kseg, False)

    _, _, carries = jax.lax.fori_loop(1, n, step, (kv, kseg, carries))
    # A query that no key may be attended by (padding) has kept the initial maximum: 0.
    out = jnp.concatenate(
        [
            jnp.where((m > _NEG)[..., None], acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0)
            for m, denom, acc in carries
        ],
        axis=2,
    )
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def _ulysses_plain(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, n: int) -> jax.Array:
    """Ulysses (:mod:`shardkit.nn.ulysses`) over tokens in order: the causal mask."""

    def attend(q, k, v, _):
        pos = jnp.arange(q.shape[1])
        return _attend(q, k, v, pos, pos)

    return ulysses_attention(q, k, v, axis=axis, n=n, attend=attend)


def _ulysses_packed(q, k, v, seg: Segments, *, axis: str, n: int) -> jax.Array:
    """Ulysses over packed (or reordered) rows: the segment ids and positions gathered."""

    def attend(q, k, v, seg):
        whole = Segments(*seg)
        return _softmax_pv(q, k, v, segment_mask(whole, whole))

    return ulysses_attention(q, k, v, tuple(seg), axis=axis, n=n, attend=attend)


def _usp_plain(
    q, k, v, *, axis: tuple[str, str], n: tuple[int, int], placed: bool = False
) -> jax.Array:
    """USP over tokens in order: Ulysses over ``axis[0]`` around the zigzag ring over
    ``axis[1]`` (the all-to-all gives each device its ring rank's contiguous block).
    ``placed``: the rows are in the zigzag order over the ring's ranks already, one
    document each (the all-to-all gives each device its ring rank's zigzag block)."""
    (ulysses, ring), (u, r) = axis, n

    def attend(q, k, v, _):
        return _ring(q, k, v, axis=ring, n=r, placed=placed)

    return ulysses_attention(q, k, v, axis=ulysses, n=u, attend=attend)


def _usp_packed(q, k, v, seg: Segments, *, axis: tuple[str, str], n: tuple[int, int]):
    """USP over packed (or balanced) rows: the segments gathered over the Ulysses axis,
    then the packed ring over the ring axis in the layout the batch was placed in."""
    (ulysses, ring), (u, r) = axis, n

    def attend(q, k, v, seg):
        return _ring_packed(q, k, v, Segments(*seg), axis=ring, n=r)

    return ulysses_attention(q, k, v, tuple(seg), axis=ulysses, n=u, attend=attend)


def _spec(shape: tuple[int, ...], mesh: Any, axis: str | tuple[str, ...]) -> PartitionSpec:
    """q/k/v spec: batch and heads per the activation rules, length on ``axis`` (one
    axis, or several in order), kv whole."""
    rules = current_activation_rules()
    spec = [*(rules.spec(_LOGICAL, mesh=mesh) if rules else ()), None, None, None, None]

    def without_axis(e: Any) -> Any:
        drop = context_axes(axis)
        return tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in drop) or None

    fixed = Rules(
        [("batch", without_axis(spec[0])), ("length", axis), ("heads", without_axis(spec[2]))]
    )
    return fixed.spec(_LOGICAL, shape=shape, mesh=mesh, path="attention")  # divisibility


@block("attention")
def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, segments: Segments | None = None
) -> jax.Array:
    """Causal softmax attention with the strategy of the active ``use_attention``.

    Args:
      q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``
        with ``kv_heads`` dividing ``heads`` (grouped-query attention: query head i
        reads K/V head ``i // (heads / kv_heads)``). Ring and all-gather attention move
        K/V with their own heads and repeat them on arrival, so GQA sends
        ``kv_heads / heads`` of the bytes; dense attention repeats them first.
      segments: packed rows: ``Segments(ids, positions)``, integer ``[batch, seq]``
        (:mod:`shardkit.nn.segments`): each token attends the earlier tokens of its own
        document only (the block-diagonal causal mask). Every strategy honours it; the
        ring then runs in the layout the batch was placed in (no zigzag reorder) and
        skips the blocks with no unmasked pair at run time. Under ``zigzag_ranks`` = N
        in the context (rows of one causal document each in the zigzag order over the
        ring's N ranks, ``Plan.shard_batch``'s placement) the ring instead computes only
        the unmasked half blocks, statically, and reads no segments. ``None``: one causal
        document per row, in order.

    Returns:
      ``[batch, seq, heads, head_dim]`` in ``q.dtype``; scores scaled by
      1/sqrt(head_dim), softmax in f32.

    Raises:
      ShardingError: mismatched shapes, or a sequence the strategy cannot split
        (ring needs a multiple of 2N, allgather of N, N = size of the axis), or a ring
        over N ranks under ``zigzag_ranks`` of another count.
    """
    grouped = (
        q.ndim == 4
        and k.shape == v.shape
        and k.ndim == 4
        and k.shape[2] > 0
        and k.shape[:2] + k.shape[3:] == q.shape[:2] + q.shape[3:]
        and q.shape[2] % k.shape[2] == 0
    )
    if not grouped:
        raise ShardingError(
            f"causal_attention needs q [batch, seq, heads, head_dim] and k, v of one shape "
            f"[batch, seq, kv_heads, head_dim] with kv_heads dividing heads, got {q.shape}, "
            f"{k.shape}, {v.shape}.\nFix: give k and v the same shape, and as many heads as "
            "q or a divisor of that."
        )
    if segments is not None:
        segments = check_segments(segments, q.shape, "causal_attention")
    strategy, axis = _effective(*current_attention(), context.active_mesh())
    mesh = context.active_mesh()
    if strategy == "dense":
        return _dense(q, k, v) if segments is None else _dense_packed(q, k, v, segments)
    if strategy == "usp":  # the sequence ring-major over (ring, ulysses), checked below
        sizes = (mesh.shape[axis[0]], mesh.shape[axis[1]])
        length_axes, n = (axis[1], axis[0]), sizes
    else:
        length_axes, n = axis, mesh.shape[axis]
        chunks = 2 * n if strategy == "ring" else n
        if q.shape[1] % chunks:
            raise ShardingError(
                f"{strategy} attention over {axis!r} (size {n}) splits the sequence into "
                f"{chunks} chunks, but it has length {q.shape[1]}.\nFix: make the sequence a "
                f"multiple of {chunks}, or use another attention strategy."
            )
    if strategy == "usp":  # before the specs: their divisibility error names no fix
        check_usp(q.shape[1], None, None, axis, sizes)
    spec = _spec(q.shape, mesh, length_axes)
    kv_spec = spec
    if k.shape != q.shape:
        heads = spec[2] if len(spec) > 2 else None
        split = math.prod(
            mesh.shape[a] for a in ((heads,) if isinstance(heads, str) else heads or ())
        )
        if k.shape[2] % split:  # the heads' devices do not divide K/V's: repeat them
            k, v = (_repeat_heads(x, q.shape[2]) for x in (k, v))
        else:
            kv_spec = _spec(k.shape, mesh, length_axes)
    if strategy == "ulysses":
        check_heads(q.shape[2] // _split(spec, mesh), k.shape[2] // _split(kv_spec, mesh), n, axis)
    if strategy == "usp":  # the heads left per device after a tensor split
        heads = (q.shape[2] // _split(spec, mesh), k.shape[2] // _split(kv_spec, mesh))
        check_usp(q.shape[1], *heads, axis, sizes)
    if is_explicit(mesh):
        q = jax.sharding.reshard(q, spec)
        k, v = (jax.sharding.reshard(x, kv_spec) for x in (k, v))
    placed = segments is not None and _zigzag_placed(strategy, axis, n)
    if segments is not None and not placed:
        return _packed_shard_map(q, k, v, segments, strategy, mesh, axis, n, spec, kv_spec)
    body = {
        "ring": functools.partial(_ring, placed=placed),
        "allgather": _allgather,
        "ulysses": _ulysses_plain,
        "usp": functools.partial(_usp_plain, placed=placed),
    }
    return jax.shard_map(
        lambda q, k, v: body[strategy](q, k, v, axis=axis, n=n),
        mesh=mesh,
        in_specs=(spec, kv_spec, kv_spec),
        out_specs=spec,
    )(q, k, v)


def _zigzag_placed(strategy: str, axis: Any, n: Any) -> bool:
    """Whether the ring (alone or USP's) runs its static half blocks on rows given with
    segments: the context promises one causal document per row in the zigzag order over
    the ring's ranks (``zigzag_ranks``, set by ``Model.loss`` from ``batch["zigzag"]``)."""
    ranks = context.current().zigzag_ranks
    if not ranks or strategy not in ("ring", "usp"):
        return False
    ring, size = (axis[1], n[1]) if strategy == "usp" else (axis, n)
    if ranks != size:
        raise ShardingError(
            f"The rows were placed in the zigzag order over {ranks} ranks (batch['zigzag'] "
            f"or zigzag_ranks={ranks}), but the ring runs over {ring!r} of size {size}.\nFix: "
            "place the batch with the plan that runs the step (plan.shard_batch), or drop "
            "batch['zigzag'] (zigzag_ranks=0) to read the masks at run time."
        )
    return True


def _effective(strategy: str, axis: Any, mesh: Any) -> tuple[str, Any]:
    """The strategy and axis that run on ``mesh``: ``"dense"`` without a mesh or a
    context axis of size > 1; USP with one of its two axes of size 1 the other's own
    strategy (ring, or Ulysses)."""
    if mesh is None or strategy == "dense":
        return "dense", axis
    size = {a: mesh.shape[a] if a in mesh.axis_names else 1 for a in context_axes(axis)}
    if strategy == "usp":
        ulysses, ring = axis
        if size[ulysses] > 1 and size[ring] > 1:
            return "usp", tuple(axis)
        strategy, axis = ("ulysses", ulysses) if size[ulysses] > 1 else ("ring", ring)
    return ("dense", axis) if size[axis] == 1 else (strategy, axis)


def _split(spec: PartitionSpec, mesh: Any, dim: int = 2) -> int:
    """Devices that split dimension ``dim`` (the heads) under ``spec``."""
    entry = tuple(spec)[dim] if len(spec) > dim else None
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))


def _packed_shard_map(q, k, v, segments, strategy, mesh, axis, n, spec, kv_spec) -> jax.Array:
    """Attention of packed rows under ``shard_map``: the segments split as the tokens."""
    seg_spec = PartitionSpec(*tuple(spec)[:2])
    if is_explicit(mesh):
        segments = Segments(*(jax.sharding.reshard(x, seg_spec) for x in segments))
    body = {
        "ring": _ring_packed,
        "allgather": _allgather_packed,
        "ulysses": _ulysses_packed,
        "usp": _usp_packed,
    }[strategy]
    return jax.shard_map(
        lambda q, k, v, seg: body(q, k, v, Segments(*seg), axis=axis, n=n),
        mesh=mesh,
        in_specs=(spec, kv_spec, kv_spec, (seg_spec, seg_spec)),
        out_specs=spec,
    )(q, k, v, tuple(segments))
