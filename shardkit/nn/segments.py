"""Packed rows: which tokens may attend to which (the block-diagonal causal mask).

A row that packs several documents carries, per token, a **segment id** (the document
it belongs to, 1, 2, ...; 0 for padding) and a **position** (within its document,
restarting at 0). Query ``i`` attends key ``j`` when both are in the same document
(a non-zero segment) and ``j`` does not come after ``i`` in it::

    keep[i, j] = (seg[i] == seg[j]) & (seg[i] != 0) & (pos[j] <= pos[i])

The mask reads the positions, not where the tokens sit in the row, so it holds for
any order of the tokens: a context-parallel split that permutes them to balance the
work (:func:`shardkit.packing.balance_permutation`) moves the segment ids and
positions along and the mask stays right. Padding attends nothing (its output is
finite and its loss masked).

Example:
  >>> import jax.numpy as jnp
  >>> seg = Segments(jnp.array([[1, 1, 2, 0]]), jnp.array([[0, 1, 0, 0]]))
  >>> segment_mask(seg, seg).astype(int)[0]
  Array([[1, 0, 0, 0],
         [1, 1, 0, 0],
         [0, 0, 1, 0],
         [0, 0, 0, 0]], dtype=int32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.errors import ShardingError

__all__ = ["Segments", "check_segments", "segment_mask", "segments_of"]


class Segments(NamedTuple):
    """Per-token document ids (0: padding) and positions within the document, ``[batch, seq]``."""

    ids: jax.Array
    positions: jax.Array


def segment_mask(q: Segments, k: Segments) -> jax.Array:
    """``bool[batch, q_len, k_len]``: same non-zero segment and key position ≤ query position."""
    same = (q.ids[:, :, None] == k.ids[:, None, :]) & (q.ids[:, :, None] != 0)
    return same & (k.positions[:, None, :] <= q.positions[:, :, None])


def check_segments(segments: Any, shape: tuple[int, ...], where: str) -> Segments:
    """``segments`` as ``Segments`` of integer ``[batch, seq]`` (``shape``'s first two), or an error.

    Raises:
      ShardingError: not a pair of arrays, a shape other than ``shape[:2]``, or a
        non-integer dtype; the message names what was given and the fix.

    Example:
      >>> check_segments((jnp.ones((2, 4), jnp.int32),) * 2, (2, 4, 8), "here").ids.shape
      (2, 4)
      >>> check_segments((jnp.ones((2, 3)),) * 2, (2, 4, 8), "here")
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: here: segment ids (2, 3) float32 and positions (2, 3) float32 must be integer arrays [batch, seq] = (2, 4).
      Fix: pass segment_ids and positions as int32 [batch, seq], as shardkit.packing.pack_documents makes them.
    """
    if not (isinstance(segments, tuple) and len(segments) == 2):
        raise ShardingError(
            f"{where}: segments must be a pair (segment_ids, positions), got "
            f"{type(segments).__name__}.\nFix: pass shardkit.nn.segments.Segments(ids, positions)."
        )
    ids, pos = segments
    want = tuple(shape[:2])

    def ok(x: Any) -> bool:
        dtype = getattr(x, "dtype", None)
        return (
            tuple(getattr(x, "shape", ())) == want
            and dtype is not None
            and jnp.issubdtype(dtype, jnp.integer)
        )

    if not (ok(ids) and ok(pos)):

        def show(x: Any) -> str:
            return f"{tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"

        raise ShardingError(
            f"{where}: segment ids {show(ids)} and positions {show(pos)} must be integer "
            f"arrays [batch, seq] = {want}.\nFix: pass segment_ids and positions as int32 "
            "[batch, seq], as shardkit.packing.pack_documents makes them."
        )
    return Segments(ids, pos)


def segments_of(batch: Any, shape: tuple[int, ...], where: str) -> Segments | None:
    """The ``Segments`` of a batch dict (``"segment_ids"``, ``"positions"``), or ``None``.

    A batch with neither key is an ordinary one (one causal document per row); one with
    only ``segment_ids`` gets positions restarting at every change of segment.

    Example:
      >>> b = {"segment_ids": jnp.array([[1, 1, 2, 2, 2]])}
      >>> segments_of(b, (1, 5), "loss").positions
      Array([[0, 1, 0, 1, 2]], dtype=int32)
    """
    if not isinstance(batch, dict) or "segment_ids" not in batch:
        if isinstance(batch, dict) and "positions" in batch:
            raise ShardingError(
                f"{where}: the batch has 'positions' but no 'segment_ids'.\nFix: pass both "
                "(shardkit.packing.pack_documents), or neither for one document per row."
            )
        return None
    ids = batch["segment_ids"]
    pos = batch.get("positions")
    if pos is None:
        pos = _restarting_positions(jnp.asarray(ids)) if hasattr(ids, "shape") else ids
    return check_segments((ids, pos), shape, where)


def _restarting_positions(ids: jax.Array) -> jax.Array:
    """0, 1, ... within every run of equal segment ids along the last axis."""
    idx = jnp.arange(ids.shape[-1], dtype=jnp.int32)
    start = jnp.concatenate(
        [jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], axis=-1
    )
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=ids.ndim - 1)
    return idx - first
