"""DeepSpeed-Ulysses attention: all-to-all from a sequence split to a head split and back.

Jacobs et al. (2023), DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models. Inside ``shard_map`` over the sequence axis
(size N) each device holds ``s/N`` tokens of every head; one all-to-all per tensor
turns q, k, v into all ``s`` tokens of ``h/N`` heads (K/V at their own count
``h_kv/N``: grouped-query heads stay grouped, query head group r reads K/V group r),
attention runs locally on whole sequences, and one all-to-all turns the output back.

Wire per device and layer, forward: each all-to-all keeps 1/N of its tensor and sends the
rest, ``b·(s/N)·(2h + 2h_kv)·B·(N−1)/N`` for q, k, v and the output (h, h_kv the widths
``heads·head_dim``, ``kv_heads·head_dim``); the backward moves as much (the transposed
all-to-alls), full remat once more. A batch placed out of order or packed carries its
segment ids and positions, all-gathered beside (``2·b·s·4·(N−1)/N``). The heads per device (after any tensor split) must divide by N.

USP (Fang & Zhao 2024, A Unified Sequence Parallelism Approach for Long Context
Generative AI) runs this over one axis of size U around ring attention over another of
size R (``causal_attention`` under ``use_attention("usp", axis=(ulysses, ring))``):
:func:`check_usp` says whether a model and a sequence fit such a mesh.

Example:
  >>> check_heads(12, 4, 4)
  >>> check_heads(12, 4, 8)
  Traceback (most recent call last):
  ...
  shardkit.errors.ShardingError: Ulysses attention over 'sequence' (size 8) splits each device's heads 8 ways, but it has 12 query heads and 4 K/V heads.
  Fix: a 'sequence' axis of 4 (the nearest size dividing both: 1, 2, 4), another attention strategy (ring, allgather), or a ring × Ulysses mesh (recipes.get('cp_usp')).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from shardkit.errors import ShardingError
from shardkit.scopes import block

__all__ = ["check_heads", "check_usp", "ulysses_attention", "ulysses_wire_bytes"]


def check_heads(
    heads: int,
    kv_heads: int,
    n: int,
    axis: str = "sequence",
    *,
    ring: tuple[str, int] | None = None,
) -> None:
    """Raise ``ShardingError`` unless ``n`` divides ``heads`` and ``kv_heads`` (per device),
    naming the valid axis sizes nearest ``n``.

    ``ring``: the ring axis and its size beside a Ulysses axis (USP,
    :func:`check_usp`): the fix then keeps the context devices ``n × ring size`` and
    moves the rest to the ring.

    Example:
      >>> check_heads(8, 2, 4, "ulysses", ring=("sequence", 2))
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: Ulysses attention over 'ulysses' (size 4) splits each device's heads 4 ways, but it has 8 query heads and 2 K/V heads.
      Fix: 'ulysses' = 2 and 'sequence' = 4 (the same 8 context devices; Ulysses sizes dividing both head counts: 1, 2).
    """
    if heads % n == 0 and kv_heads % n == 0:
        return
    common = math.gcd(heads, kv_heads)
    valid = [m for m in range(1, common + 1) if common % m == 0]
    head = (
        f"Ulysses attention over {axis!r} (size {n}) splits each device's heads {n} ways, "
        f"but it has {heads} query heads and {kv_heads} K/V heads.\nFix: "
    )
    if ring is not None:
        ring_axis, r = ring
        total = n * r
        fits = [m for m in valid if total % m == 0]
        nearest = min(fits, key=lambda m: (abs(m - n), -m))
        raise ShardingError(
            f"{head}{axis!r} = {nearest} and {ring_axis!r} = {total // nearest} (the same "
            f"{total} context devices; Ulysses sizes dividing both head counts: "
            f"{', '.join(map(str, fits))})."
        )
    nearest = min(valid, key=lambda m: (abs(m - n), -m))
    raise ShardingError(
        f"{head}a {axis!r} axis of {nearest} (the nearest size dividing both: "
        f"{', '.join(map(str, valid))}), another attention strategy (ring, allgather), or a "
        "ring × Ulysses mesh (recipes.get('cp_usp'))."
    )


def check_usp(
    seq: int,
    heads: int | None,
    kv_heads: int | None,
    axes: tuple[str, str],
    sizes: tuple[int, int],
) -> None:
    """Raise ``ShardingError`` unless USP over ``axes`` = ``(ulysses_axis, ring_axis)`` of
    ``sizes`` = ``(U, R)`` can run: ``U`` divides the heads and the K/V heads (per device),
    and the sequence splits into the ``U·R`` shards and the ring's ``2R`` zigzag chunks
    (a multiple of ``lcm(U·R, 2R)``); the message names the nearest valid setting.
    ``heads=None`` checks the sequence only.

    Example:
      >>> check_usp(64, 8, 8, ("ulysses", "sequence"), (2, 4))
      >>> check_usp(36, 8, 8, ("ulysses", "sequence"), (2, 4))
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: USP attention over 'ulysses' (2) × 'sequence' (4) splits the sequence into 2·4 = 8 shards and the ring's 2·4 = 8 zigzag chunks, but it has length 36.
      Fix: a sequence of 32 or 40 (a multiple of 8).
    """
    (ua, ra), (u, r) = axes, sizes
    if heads is not None:
        check_heads(heads, kv_heads, u, ua, ring=(ra, r))
    step = math.lcm(u * r, 2 * r)
    if seq % step:
        lo, hi = seq // step * step, -(-seq // step) * step
        near = f"{lo} or {hi}" if lo else f"{hi}"
        raise ShardingError(
            f"USP attention over {ua!r} ({u}) × {ra!r} ({r}) splits the sequence into "
            f"{u}·{r} = {u * r} shards and the ring's 2·{r} = {2 * r} zigzag chunks, but it "
            f"has length {seq}.\nFix: a sequence of {near} (a multiple of {step})."
        )


def _to_heads(x: jax.Array, axis: str) -> jax.Array:
    """``[b, s/N, h, d]`` (a sequence shard, all heads) to ``[b, s, h/N, d]``."""
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x: jax.Array, axis: str) -> jax.Array:
    """``[b, s, h/N, d]`` back to ``[b, s/N, h, d]``."""
    return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


@block("attention.ulysses")
def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    aux: Any = None,
    *,
    axis: str,
    n: int,
    attend: Callable[..., jax.Array],
) -> jax.Array:
    """Per-device body (inside ``shard_map``): q ``[b, s/N, h, d]``, k/v ``[b, s/N, h_kv, d]``.

    ``aux``: per-token integer arrays ``[b, s/N]`` (packed rows' segment ids and
    positions), all-gathered along the sequence; ``None`` for tokens in order.
    ``attend(q, k, v, aux)`` is the local masked attention over whole sequences
    (f32 out).
    """
    q, k, v = (_to_heads(x, axis) for x in (q, k, v))
    if aux is not None:
        aux = jax.tree.map(lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True), aux)
    out = attend(q, k, v, aux).astype(q.dtype)
    return _to_sequence(out, axis)


def ulysses_wire_bytes(
    *, layers: int, b: float, s: float, h: float, h_kv: float, n: int, nbytes: float, passes: int
) -> float:
    """All-to-all bytes per device and step: ``passes × L·b·(s/N)·(2h + 2h_kv)·B·(N−1)/N``.

    ``b`` the sequences one context group holds, ``s`` the whole sequence, ``passes`` 2
    (forward, backward) or 3 under full remat.

    Example:
      >>> ulysses_wire_bytes(layers=1, b=1, s=8, h=4, h_kv=4, n=2, nbytes=1, passes=2)
      64.0
    """
    if n <= 1:
        return 0.0
    return passes * layers * b * (s / n) * (2 * h + 2 * h_kv) * nbytes * (n - 1) / n
