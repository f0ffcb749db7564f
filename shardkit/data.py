"""Synthetic token streams whose best achievable loss is known in closed form.

A :class:`MarkovSource` is a random sparse Markov chain over the vocabulary. A model
trained on its samples can at best reach the chain's entropy rate (in nats/token),
so a training run has a known target loss.

Example:
  >>> from shardkit.data import MarkovSource
  >>> src = MarkovSource(vocab=16, branching=4, seed=0)
  >>> b = src.batch(8, 32, step=0)
  >>> b["inputs"].shape, b["targets"].dtype
  ((8, 32), dtype('int32'))
  >>> bool((b["inputs"][:, 1:] == b["targets"][:, :-1]).all())
  True
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from shardkit.errors import ShardingError

__all__ = ["MarkovSource"]

_DENSE_LIMIT = 4096  # transition_matrix() refuses larger vocabularies


def _rng(seed: int, *key: int) -> np.random.Generator:
    """An independent generator for stream ``key`` of ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


@dataclasses.dataclass(frozen=True)
class MarkovSource:
    """A deterministic random sparse Markov chain over ``vocab`` tokens.

    Each state ``i`` has ``min(branching, vocab)`` distinct successors, one of which is
    always ``(i + 1) % vocab`` (so the chain is irreducible); state 0 also has a
    self-loop (so it is aperiodic). Transition probabilities are Dirichlet(1) per
    state. Everything is a function of ``seed`` (the chain) and ``step`` (the sample).

    Example:
      >>> src = MarkovSource(vocab=8, branching=2, seed=1)
      >>> src.successors.shape, src.probs.shape
      ((8, 2), (8, 2))
      >>> 0.0 < src.entropy_rate() <= float(np.log(2))
      True
      >>> bool((src.sample(2, 5, step=3) == src.sample(2, 5, step=3)).all())
      True
    """

    vocab: int
    branching: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "branching", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ShardingError(f"MarkovSource({name}={v!r}): expected an integer.")
        if self.vocab < 1:
            raise ShardingError(f"MarkovSource(vocab={self.vocab}): need vocab >= 1.")
        if self.seed < 0:
            raise ShardingError(f"MarkovSource(seed={self.seed}): need seed >= 0.")
        if self.branching < 2 and self.vocab > 1:
            raise ShardingError(
                f"MarkovSource(branching={self.branching}): need branching >= 2 "
                "(one successor per state makes a periodic cycle)."
            )

    # ---------------------------------------------------------------- the chain
    @functools.cached_property
    def _sparse(self) -> tuple[np.ndarray, np.ndarray]:
        v, k = self.vocab, min(self.branching, self.vocab)
        rng = _rng(self.seed, 0)
        if v == 1:
            return np.zeros((1, 1), np.int64), np.ones((1, 1), np.float64)
        # k-1 distinct offsets in [1, v-1] per row; successor (i + 1 + o) % v != i + 1.
        if v <= 1024:
            offsets = np.argsort(rng.random((v, v - 1)), axis=1)[:, : k - 1] + 1
        else:
            offsets = rng.integers(1, v, size=(v, k - 1))
            while True:  # resample only the duplicated entries of each row
                offsets.sort(axis=1)
                dup = np.zeros_like(offsets, dtype=bool)
                dup[:, 1:] = offsets[:, 1:] == offsets[:, :-1]
                if not dup.any():
                    break
                offsets[dup] = rng.integers(1, v, size=int(dup.sum()))
        idx = np.arange(v)[:, None]
        succ = np.concatenate([(idx + 1) % v, (idx + 1 + offsets) % v], axis=1)
        if not (succ[0] == 0).any():  # self-loop on state 0: aperiodic
            succ[0, 1] = 0
        succ, probs = succ.astype(np.int64), rng.dirichlet(np.ones(k), size=v)
        succ.setflags(write=False)
        probs.setflags(write=False)
        return succ, probs

    @property
    def successors(self) -> np.ndarray:
        """int64 ``[vocab, k]``: the successor states of each state."""
        return self._sparse[0]

    @property
    def probs(self) -> np.ndarray:
        """float64 ``[vocab, k]``: ``probs[i, j] = P(successors[i, j] | i)``; rows sum to 1."""
        return self._sparse[1]

    def transition_matrix(self) -> np.ndarray:
        """Dense float64 ``[vocab, vocab]`` transition matrix (small vocabularies only).

        Example:
          >>> P = MarkovSource(vocab=5, branching=3).transition_matrix()
          >>> P.shape, bool(np.allclose(P.sum(axis=1), 1.0))
          ((5, 5), True)
        """
        if self.vocab > _DENSE_LIMIT:
            raise ShardingError(
                f"MarkovSource.transition_matrix(): vocab {self.vocab} is too large for a "
                f"dense matrix (limit {_DENSE_LIMIT}).\n"
                "Fix: use the sparse form, `src.successors` and `src.probs`."
            )
        dense = np.zeros((self.vocab, self.vocab))
        np.add.at(dense, (np.arange(self.vocab)[:, None], self.successors), self.probs)
        return dense

    def _step_distribution(self, pi: np.ndarray) -> np.ndarray:
        """``pi @ P`` on the sparse form."""
        return np.bincount(
            self.successors.ravel(),
            weights=(pi[:, None] * self.probs).ravel(),
            minlength=self.vocab,
        )

    @functools.cached_property
    def _stationary(self) -> np.ndarray:
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(100_000):
            # Lazy chain (I + P) / 2: same stationary distribution, never oscillates.
            new = 0.5 * (pi + self._step_distribution(pi))
            new /= new.sum()
            done = np.abs(new - pi).sum() < 1e-14
            pi = new
            if done:
                break
        pi.setflags(write=False)
        return pi

    def stationary(self) -> np.ndarray:
        """The stationary distribution ``pi`` (``pi P = pi``), by power iteration.

        Example:
          >>> src = MarkovSource(vocab=16)
          >>> pi = src.stationary()
          >>> bool(np.isclose(pi.sum(), 1.0)), bool(np.allclose(pi @ src.transition_matrix(), pi))
          (True, True)
        """
        return self._stationary.copy()

    def entropy_rate(self) -> float:
        """Entropy rate in nats/token: ``-sum_i pi_i sum_j P_ij log P_ij``.

        This is the lowest mean next-token cross-entropy any model can reach.

        Example:
          >>> MarkovSource(vocab=1).entropy_rate()  # one token: no uncertainty
          0.0
          >>> MarkovSource(vocab=16, branching=4).entropy_rate() < float(np.log(4))
          True
        """
        p = self.probs
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        return abs(float((self._stationary * plogp.sum(axis=1)).sum()))  # abs: no -0.0

    # ---------------------------------------------------------------- sampling
    def _sample_rows(self, batch: int, length: int, step: int, rows: slice) -> np.ndarray:
        """Rows ``rows`` of the ``[batch, length]`` sample for ``step``.

        The random numbers are drawn for the whole batch, so any row slice equals the
        same rows of the full sample.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ShardingError(f"MarkovSource: step must be a non-negative integer, got {step!r}.")
        if batch < 0 or length < 0:
            raise ShardingError(f"MarkovSource: need batch, length >= 0, got {batch}, {length}.")
        rng = _rng(self.seed, 1, int(step))
        u = rng.random((batch, max(length, 1)))[rows]
        return self._walk(u, length)

    def _walk(self, u: np.ndarray, length: int) -> np.ndarray:
        """Chains of ``length`` states, one per row of the uniforms ``u`` ``[rows, >= length]``."""
        out = np.empty((u.shape[0], length), np.int32)
        if length == 0 or u.shape[0] == 0:
            return out
        cum_pi = np.cumsum(self._stationary)
        state = np.minimum(
            np.searchsorted(cum_pi, u[:, 0] * cum_pi[-1], side="right"), self.vocab - 1
        )
        succ, cum = self.successors, np.cumsum(self.probs, axis=1)
        k = succ.shape[1]
        out[:, 0] = state
        for t in range(1, length):
            choice = (cum[state] <= u[:, t : t + 1]).sum(axis=1)
            state = succ[state, np.minimum(choice, k - 1)]
            out[:, t] = state
        return out

    def documents(self, lengths: np.ndarray, step: int) -> list[np.ndarray]:
        """Independent chains of the given ``lengths`` (int32 each), a function of (seed, step).

        The documents that :mod:`shardkit.packing` packs into rows; a stream of its own,
        independent of :meth:`sample`'s.

        Example:
          >>> docs = MarkovSource(vocab=16).documents(np.array([3, 5]), step=0)
          >>> [d.shape for d in docs]
          [(3,), (5,)]
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ShardingError(f"MarkovSource: step must be a non-negative integer, got {step!r}.")
        lengths = np.asarray(lengths, np.int64)
        if lengths.size == 0:
            return []
        longest = int(lengths.max())
        u = _rng(self.seed, 2, int(step)).random((lengths.size, max(longest, 1)))
        walks = self._walk(u, longest)
        return [walks[i, :n] for i, n in enumerate(lengths.tolist())]

    def sample(self, batch: int, length: int, step: int) -> np.ndarray:
        """int32 ``[batch, length]`` token sequences, a deterministic function of (seed, step).

        The first token of each row is drawn from the stationary distribution, so every
        position has the same marginal distribution.

        Example:
          >>> x = MarkovSource(vocab=50, seed=3).sample(4, 10, step=7)
          >>> x.shape, x.dtype, bool(((0 <= x) & (x < 50)).all())
          ((4, 10), dtype('int32'), True)
        """
        return self._sample_rows(batch, length, step, slice(None))

    def batch(
        self,
        batch: int,
        seq: int,
        step: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> dict[str, np.ndarray]:
        """Next-token batch ``{"inputs", "targets"}``, int32 ``[rows, seq]``.

        ``targets`` is ``inputs`` shifted left by one (``seq + 1`` tokens are sampled).
        With ``process_count > 1`` only this process's contiguous block of
        ``batch // process_count`` rows is returned; stacking the blocks of all
        processes in order gives exactly the single-process batch.

        Example:
          >>> src = MarkovSource(vocab=32)
          >>> full = src.batch(4, 8, step=0)["inputs"]
          >>> half = src.batch(4, 8, step=0, process_index=1, process_count=2)["inputs"]
          >>> bool((half == full[2:]).all())
          True
        """
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ShardingError(
                f"MarkovSource.batch: process_index={process_index} is not in "
                f"[0, process_count={process_count})."
            )
        if batch % process_count:
            raise ShardingError(
                f"MarkovSource.batch: global batch {batch} is not divisible by "
                f"process_count {process_count}.\n"
                f"Fix: use a global batch that is a multiple of {process_count}."
            )
        per = batch // process_count
        rows = slice(process_index * per, (process_index + 1) * per)
        tokens = self._sample_rows(batch, seq + 1, step, rows)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
