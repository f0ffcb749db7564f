"""Packed rows: documents of variable length in fixed-size rows, and their balance.

Real training data is documents of very different lengths. Packing puts several in
one row of ``seq`` tokens, each with a **segment id** (1, 2, ... within the row; 0 is
padding) and **positions** restarting at 0 per document, so attention stays inside
a document (:mod:`shardkit.nn.segments`) and the loss skips padding
(:func:`shardkit.nn.loss.masked_mean`). A document of ``n`` tokens gives ``n − 1``
(input, target) pairs; no target crosses a document boundary.

Under context parallelism the row is split over ``n`` ranks. Attention work is the
unmasked query-key pairs, ``position + 1`` per token, so a contiguous split of a
packed row is unbalanced (the rank holding a long document's end does most of it).
:func:`balance_permutation` reorders each row's tokens so every rank does the same
work; the segment ids and positions travel with the tokens, so the mask stays right
and the loss is unchanged.

Example:
  >>> import numpy as np
  >>> docs = [np.arange(4), np.arange(10, 13), np.arange(20, 26)]
  >>> b = pack_documents(docs, rows=1, seq=12)
  >>> b["segment_ids"][0].tolist()
  [1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 0, 0]
  >>> b["positions"][0].tolist()
  [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 0]
  >>> b["targets"][0, :3].tolist()   # within the first document
  [1, 2, 3]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from shardkit.data import MarkovSource
from shardkit.errors import ShardingError

__all__ = [
    "LogNormal",
    "attention_work",
    "balance_permutation",
    "imbalance",
    "pack_documents",
    "packed_batch",
    "permute_rows",
    "ring_blocks",
]

Overflow = Literal["split", "error"]
_KEYS = ("inputs", "targets", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """Document lengths (tokens) ``round(exp(N(mu, sigma²)))``, at least ``min_length``.

    The median length is ``exp(mu)``; ``sigma`` sets the spread (1.0: a tenth of the
    documents are over 3.6 × the median).

    Example:
      >>> rng = np.random.default_rng(0)
      >>> n = LogNormal(mu=3.0, sigma=0.5).sample(rng, 1000)
      >>> int(n.min()) >= 2, 15 < float(np.median(n)) < 25
      (True, True)
    """

    mu: float
    sigma: float
    min_length: int = 2

    def __post_init__(self) -> None:
        if not (np.isfinite(self.mu) and np.isfinite(self.sigma) and self.sigma >= 0):
            raise ShardingError(
                f"LogNormal(mu={self.mu}, sigma={self.sigma}): need finite mu and sigma >= 0."
                "\nFix: e.g. LogNormal(mu=4.0, sigma=1.0) (median exp(4) = 55 tokens)."
            )
        if not isinstance(self.min_length, int) or self.min_length < 2:
            raise ShardingError(
                f"LogNormal(min_length={self.min_length!r}): a document needs at least 2 "
                "tokens (one input, one target).\nFix: min_length=2."
            )

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` lengths, int64."""
        n = np.rint(np.exp(rng.normal(self.mu, self.sigma, size=count)))
        return np.maximum(n, self.min_length).astype(np.int64)


def _fill(
    docs: Sequence[np.ndarray], rows: int, seq: int, overflow: Overflow
) -> tuple[dict[str, np.ndarray], int]:
    """Documents placed in order, a new row when the next does not fit; ``(batch, used)``."""
    out = {k: np.zeros((rows, seq), np.int32) for k in _KEYS}
    r = col = 0
    sid = 1
    for used, doc in enumerate(docs):
        doc = np.asarray(doc)
        pairs = doc.size - 1
        if doc.ndim != 1 or pairs < 1:
            raise ShardingError(
                f"pack_documents: document {used} has shape {doc.shape}; a document is a 1-D "
                "array of at least 2 tokens.\nFix: drop empty and one-token documents."
            )
        if pairs > seq and overflow == "error":
            raise ShardingError(
                f"pack_documents: document {used} has {doc.size} tokens ({pairs} pairs), more "
                f"than a row of seq={seq}.\nFix: overflow='split' (pieces of at most {seq} "
                f"pairs, each its own segment), seq >= {pairs}, or shorter documents."
            )
        for lo in range(0, pairs, seq):  # pieces of a document longer than a row
            n = min(seq, pairs - lo)
            if col + n > seq:
                r, col, sid = r + 1, 0, 1
            if r == rows:
                return out, used
            piece = doc[lo : lo + n + 1]
            sl = (r, slice(col, col + n))
            out["inputs"][sl], out["targets"][sl] = piece[:-1], piece[1:]
            out["segment_ids"][sl], out["positions"][sl] = sid, np.arange(n)
            col, sid = col + n, sid + 1
    return out, len(docs)


def pack_documents(
    documents: Sequence[np.ndarray], *, rows: int, seq: int, overflow: Overflow = "split"
) -> dict[str, np.ndarray]:
    """Pack documents, in order, into ``rows`` rows of ``seq`` (input, target) pairs.

    Args:
      documents: 1-D token arrays of at least 2 tokens each.
      rows, seq: the batch's shape.
      overflow: a document of more than ``seq`` pairs is cut into pieces of ``seq``,
        each its own segment with positions restarting (``"split"``, the default), or
        refused (``"error"``).

    Returns:
      int32 ``[rows, seq]`` arrays ``inputs``, ``targets``, ``segment_ids`` (0: padding)
      and ``positions``.

    Raises:
      ShardingError: a document that is not 1-D of 2+ tokens; one longer than a row
        under ``overflow="error"``; more documents than the rows hold.
    """
    if overflow not in ("split", "error"):
        raise ShardingError(f"pack_documents(overflow={overflow!r}): 'split' or 'error'.")
    if rows < 1 or seq < 1:
        raise ShardingError(f"pack_documents(rows={rows}, seq={seq}): need both >= 1.")
    out, used = _fill(documents, rows, seq, overflow)
    if used < len(documents):
        total = sum(max(np.asarray(d).size - 1, 0) for d in documents)
        raise ShardingError(
            f"pack_documents: {len(documents)} documents ({total} pairs) do not fit {rows} "
            f"rows of {seq}; {used} did.\nFix: more rows, longer rows, or fewer documents "
            "(packed_batch draws as many as fit)."
        )
    return out


def packed_batch(
    source: MarkovSource,
    batch: int,
    seq: int,
    step: int,
    *,
    lengths: LogNormal,
    overflow: Overflow = "split",
    process_index: int = 0,
    process_count: int = 1,
) -> dict[str, np.ndarray]:
    """Rows of documents drawn from ``source`` with ``lengths``, a function of (seed, step).

    Documents are drawn until the ``batch`` rows are full (the one that no longer fits
    is dropped). With ``process_count > 1`` only this process's contiguous block of rows
    is returned (stacked in order, the blocks are the single-process batch).

    Example:
      >>> b = packed_batch(MarkovSource(vocab=32), 2, 64, 0, lengths=LogNormal(3.0, 0.5))
      >>> b["inputs"].shape, int(b["segment_ids"].max()) > 1
      ((2, 64), True)
    """
    if process_count < 1 or not 0 <= process_index < process_count or batch % process_count:
        raise ShardingError(
            f"packed_batch: batch {batch} over process {process_index} of {process_count}."
            f"\nFix: a batch divisible by process_count, 0 <= process_index < process_count."
        )
    rng = np.random.default_rng(np.random.SeedSequence(source.seed, spawn_key=(3, int(step))))
    n = np.empty(0, np.int64)
    while n.sum() - n.size < batch * seq + seq:  # enough pairs to fill every row
        n = np.concatenate([n, np.minimum(lengths.sample(rng, batch + 8), batch * seq + 1)])
    out, _ = _fill(source.documents(n, step), batch, seq, overflow)
    per = batch // process_count
    return {k: v[process_index * per : (process_index + 1) * per] for k, v in out.items()}


def attention_work(segment_ids: np.ndarray, positions: np.ndarray, ranks: int) -> np.ndarray:
    """Unmasked query-key pairs of each of ``ranks`` contiguous slices of the rows, float64.

    A token of a document attends ``position + 1`` keys (itself and the earlier ones);
    padding none. Rank ``r`` holds columns ``[r·S/ranks, (r+1)·S/ranks)`` of every row.

    Example:
      >>> ids, pos = np.ones((1, 8), int), np.arange(8)[None]   # one causal document
      >>> attention_work(ids, pos, 2).tolist()   # 1+2+3+4, 5+6+7+8
      [10.0, 26.0]
    """
    ids, pos = np.asarray(segment_ids), np.asarray(positions)
    if ids.ndim != 2 or ids.shape != pos.shape or ids.shape[1] % ranks:
        raise ShardingError(
            f"attention_work: segment ids {ids.shape} and positions {pos.shape} must be one "
            f"[batch, seq] shape with seq divisible by {ranks} ranks.\nFix: seq a multiple of "
            f"{ranks}."
        )
    w = np.where(ids != 0, pos + 1, 0).astype(np.float64)
    return w.reshape(ids.shape[0], ranks, -1).sum(axis=(0, 2))


def imbalance(work: np.ndarray) -> float:
    """``max / mean`` of per-rank work: 1.0 is perfect balance.

    Example:
      >>> imbalance(np.array([10.0, 26.0]))
      1.4444444444444444
    """
    mean = float(np.mean(work))
    return float(np.max(work)) / mean if mean > 0 else 1.0


def balance_permutation(
    segment_ids: np.ndarray, positions: np.ndarray, ranks: int, *, tolerance: float = 1.05
) -> np.ndarray:
    """Per-row token orders ``perm [batch, seq]`` that balance attention work over ``ranks``.

    Each token's work is ``position + 1`` (its unmasked keys; padding 0). Each row is cut
    into ``m`` equal chunks of consecutive tokens; the chunks, heaviest first, are dealt
    to the ranks in a snake (0, 1, ..., n−1, n−1, ..., 0, ...; started one rank later on
    each row), so every rank gets ``seq / ranks`` tokens and, in every round of ``n``
    deals, the lightest rank of the last round gets the heaviest chunk of this one. For
    one causal document and ``m = 2n`` this is the zigzag. ``m`` is the fewest chunks
    (``2n``, ``4n``, ... up to single tokens) that bring the batch's max ÷ mean work to
    ``tolerance`` or below: coarse chunks keep documents on few ranks, so ring attention
    still skips the blocks between them. Within a rank the chunks keep their row order.

    Apply it with :func:`permute_rows`, to the inputs, targets, segment ids and
    positions alike: the model's loss is unchanged (attention reads segment ids and
    positions, not places), and each contiguous slice of the permuted row is one rank's
    balanced share.

    Example:
      >>> ids, pos = np.ones((1, 8), int), np.arange(8)[None]
      >>> perm = balance_permutation(ids, pos, 2)
      >>> perm.tolist()   # chunks 0 and 3 on rank 0, 1 and 2 on rank 1: the zigzag
      [[0, 1, 6, 7, 2, 3, 4, 5]]
      >>> attention_work(ids, np.take_along_axis(pos, perm, 1), 2).tolist()
      [18.0, 18.0]
    """
    ids, pos = np.asarray(segment_ids), np.asarray(positions)
    attention_work(ids, pos, ranks)  # the shapes' checks
    b, s = ids.shape
    w = np.where(ids != 0, pos + 1, 0).astype(np.float64)
    chunks = [m for m in (ranks * 2**i for i in range(1, s.bit_length() + 1)) if s % m == 0]
    chunks = chunks or [ranks]
    if chunks[-1] != s and s % ranks == 0:
        chunks.append(s)  # single tokens: the finest deal
    best = None
    for m in chunks:
        perm = _deal(w, ranks, m)
        work = attention_work(*(np.take_along_axis(x, perm, 1) for x in (ids, pos)), ranks)
        if best is None or imbalance(work) < best[0]:
            best = (imbalance(work), perm)
        if imbalance(work) <= tolerance:
            return perm
    return best[1]


def _deal(w: np.ndarray, ranks: int, m: int) -> np.ndarray:
    """The snake deal of ``m`` chunks per row (see :func:`balance_permutation`)."""
    b, s = w.shape
    size = s // m
    cw = w.reshape(b, m, size).sum(-1)
    order = np.argsort(-cw, axis=1, kind="stable")  # heaviest chunk first
    k = np.arange(m)
    rnd, idx = k // ranks, k % ranks
    snake = np.where(rnd % 2 == 0, idx, ranks - 1 - idx)
    deal = (snake[None, :] + np.arange(b)[:, None]) % ranks  # rows start one rank later
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, deal, axis=1)
    chunk_order = np.argsort(rank, axis=1, kind="stable")  # by rank, then row order
    perm = chunk_order[:, :, None] * size + np.arange(size)
    return perm.reshape(b, s).astype(np.int32)


def permute_rows(batch: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    """Every ``[batch, seq]`` array of ``batch`` reordered along its rows by ``perm``.

    Example:
      >>> permute_rows({"inputs": np.array([[5, 6, 7]])}, np.array([[2, 0, 1]]))["inputs"]
      array([[7, 5, 6]])
    """
    perm = np.asarray(perm)
    return {
        k: np.take_along_axis(np.asarray(v), perm, axis=1)
        if np.ndim(v) == 2 and np.shape(v) == perm.shape
        else v
        for k, v in batch.items()
    }


def ring_blocks(segment_ids: np.ndarray, positions: np.ndarray, ranks: int) -> np.ndarray:
    """Blocks each rank's ring attention computes: of its ``ranks`` (query block, K/V block)
    pairs per row, those with at least one unmasked pair (the others are skipped).

    Example:
      >>> ids = np.array([[1, 1, 2, 2, 3, 3, 4, 4]])   # four documents, one per rank
      >>> pos = np.array([[0, 1] * 4])
      >>> ring_blocks(ids, pos, 4).tolist()   # the own block only
      [1, 1, 1, 1]
      >>> ring_blocks(np.ones((1, 8), int), np.arange(8)[None], 4).tolist()   # causal
      [1, 2, 3, 4]
    """
    ids, pos = np.asarray(segment_ids), np.asarray(positions)
    attention_work(ids, pos, ranks)
    b, s = ids.shape
    i, p = ids.reshape(b, ranks, 1, s // ranks, 1), pos.reshape(b, ranks, 1, s // ranks, 1)
    j, q = ids.reshape(b, 1, ranks, 1, s // ranks), pos.reshape(b, 1, ranks, 1, s // ranks)
    live = ((i == j) & (i != 0) & (q <= p)).any(axis=(3, 4))  # [b, q rank, kv rank]
    return live.any(axis=0).sum(axis=1)  # one batch of rows per block: any row's pair
