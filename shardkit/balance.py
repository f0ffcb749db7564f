"""Load balance for context parallelism: the tokens reordered once, where the batch is placed.

Causal attention over a sequence split into N contiguous shards gives the last device
N times the first one's work. The zigzag order (Llama 3's context parallelism; Brandon
et al. 2023) cuts the sequence into 2N chunks and gives device i chunks i and 2N−1−i,
so every device attends as many unmasked pairs. Applied to the inputs and the targets
of a batch on the host, once per step (:meth:`shardkit.Plan.shard_batch` does it when
the recipe's ``balance`` is ``"zigzag"``), with each token's position carried in
``batch["positions"]`` and its document in ``batch["segment_ids"]`` (1: each row one
document), no layer pays a reorder collective: the model reads the positions (GPT's
position table, Llama's rotary angles) and attention masks by them
(:func:`shardkit.nn.segments.segment_mask`), as for packed rows
(:mod:`shardkit.packing`). The mean loss over tokens does not depend on their order.

Any other permutation works the same way (:func:`balance_batch` takes one).

The masks of such rows are known before they arrive: each rank's two chunks see every
other rank's block half masked. :meth:`shardkit.Plan.balance_batch` marks the rows it
placed so (one document per row, in the zigzag order it made) with a
``batch["zigzag"]`` entry (:func:`zigzag_marker`: an empty array whose shape records
the ranks, so placing it costs nothing), and the ring reads that to compute only the
unmasked half of every block, statically (:func:`zigzag_ranks`;
:mod:`shardkit.nn.attention`). Packed rows carry no marker: their masks are read at
run time.

Example:
  >>> import numpy as np
  >>> zigzag_order(8, 2).tolist()   # device 0: chunks 0 and 3, device 1: chunks 1 and 2
  [0, 1, 6, 7, 2, 3, 4, 5]
  >>> b = balance_batch({"inputs": np.arange(8)[None], "targets": np.arange(1, 9)[None]},
  ...                   zigzag_order(8, 2))
  >>> b["inputs"].tolist(), b["positions"].tolist(), b["segment_ids"].tolist()
  ([[0, 1, 6, 7, 2, 3, 4, 5]], [[0, 1, 6, 7, 2, 3, 4, 5]], [[1, 1, 1, 1, 1, 1, 1, 1]])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardkit.errors import ShardingError

__all__ = [
    "POSITIONS",
    "SEGMENT_IDS",
    "ZIGZAG",
    "balance_batch",
    "zigzag_marker",
    "zigzag_order",
    "zigzag_ranks",
]

#: The batch entry holding each token's position, ``int32[rows, seq]``.
POSITIONS = "positions"
#: The batch entry holding each token's document (1, 2, ...; 0: padding).
SEGMENT_IDS = "segment_ids"
#: The batch entry marking rows of one causal document each in the zigzag order
#: (:func:`zigzag_marker`); absent from packed rows.
ZIGZAG = "zigzag"


def zigzag_marker(n: int) -> np.ndarray:
    """The ``batch["zigzag"]`` entry of rows placed in :func:`zigzag_order` over ``n``
    ranks, one causal document per row: an empty ``int32[0, 0, n]`` (batch and length
    empty, so any batch sharding divides it). It holds no data; its static shape tells a
    compiled step (``Model.loss``) the layout, so the ring leaves out the masked half
    blocks at compile time, not at run time.

    Example:
      >>> zigzag_ranks({"zigzag": zigzag_marker(8)}), zigzag_ranks({"inputs": None})
      (8, 0)
    """
    return np.zeros((0, 0, n), np.int32)


def zigzag_ranks(batch: Any) -> int:
    """The ranks of the zigzag order ``batch`` is marked as placed in
    (:func:`zigzag_marker`), or 0 for a batch without the mark (rows in any order,
    packed or not).

    Raises:
      ShardingError: a ``"zigzag"`` entry that is not an empty ``[0, 0, n]`` array.
    """
    if not isinstance(batch, Mapping) or ZIGZAG not in batch:
        return 0
    shape = tuple(np.shape(batch[ZIGZAG]))
    if len(shape) != 3 or shape[:2] != (0, 0) or shape[2] < 1:
        raise ShardingError(
            f"batch['zigzag'] has shape {shape}; it marks rows placed in the zigzag order "
            "over n ranks with an empty [0, 0, n] array.\nFix: "
            "batch['zigzag'] = shardkit.balance.zigzag_marker(n), or drop the entry."
        )
    return shape[2]


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """The token indices in zigzag order for ``n`` context ranks: slot ``j`` holds token
    ``order[j]``, rank ``i`` the slots ``[i·seq/n, (i+1)·seq/n)`` = chunks ``i`` and
    ``2n−1−i`` of ``seq/(2n)`` tokens.

    Raises:
      ShardingError: ``seq`` is not a multiple of ``2·n``.

    Example:
      >>> zigzag_order(4, 1).tolist()
      [0, 1, 2, 3]
    """
    if n < 1 or seq % (2 * n):
        raise ShardingError(
            f"The zigzag order cuts the sequence into 2·{n} = {2 * n} chunks (2 per context "
            f"rank), but it has length {seq}.\nFix: a sequence length that is a multiple of "
            f"{2 * n}, or dataclasses.replace(recipe, balance='none')."
        )
    c = seq // (2 * n)
    chunks = np.arange(seq).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def balance_batch(batch: Mapping[str, Any], order: np.ndarray) -> dict[str, Any]:
    """``batch`` with every ``[rows, seq, ...]`` array reordered along ``seq`` by ``order``,
    ``batch["positions"]`` the tokens' positions in the same order and
    ``batch["segment_ids"]`` their documents (a batch that has them keeps them,
    reordered; one without gets ``order`` itself and one document per row).

    Arrays of another rank or length (per-row weights, a step key) pass unchanged.

    Raises:
      ShardingError: ``order`` is not a permutation of the sequence, or the batch has
        no ``inputs`` of shape ``[rows, seq]``, or its positions have another shape.
    """
    order = np.asarray(order)
    inputs = batch.get("inputs")
    if inputs is None or np.ndim(inputs) != 2:
        raise ShardingError(
            f"balance_batch needs batch['inputs'] of shape [rows, seq], got "
            f"{None if inputs is None else np.shape(inputs)}.\nFix: a token batch "
            "{'inputs': int32[rows, seq], 'targets': ...}."
        )
    rows, seq = np.shape(inputs)
    if order.shape != (seq,) or not np.array_equal(np.sort(order), np.arange(seq)):
        raise ShardingError(
            f"balance_batch: the order must be a permutation of the {seq} positions, got "
            f"shape {order.shape}.\nFix: zigzag_order(seq, n)."
        )
    out = {}
    for name, x in batch.items():
        shaped = np.ndim(x) >= 2 and np.shape(x)[:2] == (rows, seq)
        out[name] = np.asarray(x)[:, order] if shaped else x
    if POSITIONS in batch:
        if np.shape(batch[POSITIONS]) != (rows, seq):
            raise ShardingError(
                f"batch['positions'] has shape {np.shape(batch[POSITIONS])}, the tokens "
                f"{(rows, seq)}.\nFix: one position per token."
            )
    elif SEGMENT_IDS in batch:  # packed rows: positions restart per document, then move
        out[POSITIONS] = _restarting_positions(np.asarray(batch[SEGMENT_IDS]))[:, order]
    else:
        out[POSITIONS] = np.broadcast_to(order.astype(np.int32), (rows, seq)).copy()
    if SEGMENT_IDS not in batch:
        out[SEGMENT_IDS] = np.ones((rows, seq), np.int32)
    return out


def _restarting_positions(ids: np.ndarray) -> np.ndarray:
    """0, 1, ... within every run of equal segment ids along each row (as the models
    derive them for packed rows without positions)."""
    idx = np.arange(ids.shape[-1], dtype=np.int32)
    start = np.ones(ids.shape, bool)
    start[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return (idx - np.maximum.accumulate(np.where(start, idx, 0), axis=-1)).astype(np.int32)
