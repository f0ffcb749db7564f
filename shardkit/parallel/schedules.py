"""Pipeline schedules as plain tables: which stage does what at each tick.

A schedule lists, for each tick and each stage (device along the ``stage`` mesh axis),
the forward and the backward work item it runs: ``(microbatch, virtual)`` where
``virtual`` is the round ``k`` of interleaving (model chunk ``k·p + s`` on stage ``s``),
or ``None`` (idle). The pipeline engine (:mod:`shardkit.parallel.pipeline`) runs the
ticks in lock-step: in a tick every stage first runs its forward item, sends the output
to the next stage, then runs its backward item and sends the input gradient to the
previous stage. A value sent at tick ``t`` is used at tick ``t + 1``; :func:`make`
checks that every schedule obeys this, and assigns each in-flight item a buffer slot.

- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards. ``m + p − 1`` forward
  ticks and as many backward ticks; every stage holds all ``m`` micro-batches' activations.
- ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): the last stage runs a micro-batch's
  backward in the tick of its forward, and every stage runs one forward and one backward
  per tick in the steady state. ``m + 2p − 2`` ticks, of which ``p − 1`` are forward-only
  and ``p − 1`` backward-only, so the work is ``(m + p − 1)·(F + B)``, as GPipe's. Stage
  ``s`` holds ``2(p − 1 − s) + 1`` micro-batches: at most ``2p − 1`` (the first stage),
  whatever ``m``. (An asynchronous 1F1B holds ``p − s``: its forward and backward take
  half a tick each; in lock-step SPMD a hop takes a whole tick, so the round trip doubles.)
- ``interleaved`` (Narayanan et al. 2021, circular as in GSPMD/Praxis): ``v`` model
  chunks per stage, chunk ``k·p + s`` on stage ``s``; micro-batches go round the ring
  ``v`` times in groups of ``p``. ``v·m + p − 1`` ticks of a chunk (``1/v`` of a stage)
  each way; needs ``m`` a multiple of ``p``.

Bubble fraction (idle share of a stage's time): ``(p − 1)/(m + p − 1)`` for gpipe and
1f1b, ``(p − 1)/(v·m + p − 1)`` interleaved.

Example:
  >>> s = make("1f1b", stages=2, microbatches=4)
  >>> s.ticks, s.slots, s.bubble
  (6, 3, 0.2)
  >>> print(s.timeline())
  tick   stage 0  stage 1
  0      F0       .
  1      F1       F0 B0
  2      F2 B0    F1 B1
  3      F3 B1    F2 B2
  4      B2       F3 B3
  5      B3       .
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from shardkit.errors import PipelineError

__all__ = [
    "SCHEDULES",
    "Schedule",
    "PipelineError",
    "UnknownScheduleError",
    "MicrobatchError",
    "StageDivisibilityError",
    "PipelineWarning",
    "bubble_fraction",
    "make",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

Item = tuple[int, int] | None  # (microbatch, virtual round) or idle


class UnknownScheduleError(PipelineError):
    """A schedule name that is not one of :data:`SCHEDULES`."""


class MicrobatchError(PipelineError):
    """The batch does not split into the micro-batches asked for."""


class StageDivisibilityError(PipelineError):
    """The layers do not split into stages × virtual stages."""


class PipelineWarning(UserWarning):
    """A pipeline that runs, with a large bubble."""


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a stage's time: ``(p − 1)/(v·m + p − 1)`` (``v = 1`` unless interleaved).

    Example:
      >>> bubble_fraction("gpipe", 4, 16), bubble_fraction("interleaved", 4, 16, 2)
      (0.15789473684210525, 0.08571428571428572)
    """
    v = virtual if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule's tables for ``stages`` stages and ``microbatches`` micro-batches.

    Attributes:
      forward, backward: per tick, per stage, the item ``(microbatch, virtual)`` or ``None``.
      slot_f, slot_b: per tick, per stage, the activation buffer slot the item writes
        (forward) or reads and frees (backward); ``slots`` (the trash slot) when idle.
      slots: the most micro-batches a stage holds at once (``2p − 1`` at most for 1f1b).
    """

    name: str
    stages: int
    microbatches: int
    virtual: int
    forward: tuple[tuple[Item, ...], ...]
    backward: tuple[tuple[Item, ...], ...]
    slot_f: np.ndarray
    slot_b: np.ndarray
    slots: int

    @property
    def ring(self) -> int:
        """Residual slots the engine keeps: a forward at tick ``t`` writes slot ``t mod ring``
        (the same slot on every stage, so the write is static), and every item is read back
        before that slot comes round again: ``ring`` = the longest forward-to-backward wait + 1
        (``2p − 1`` for 1f1b, ``m + 2p − 1`` for gpipe)."""
        return int(max(self.ages().values())) + 1

    def ages(self) -> dict[tuple[int, int], int]:
        """``{(tick of the backward, stage): ticks since its forward}`` for every item."""
        f_tick = {}
        for t, row in enumerate(self.forward):
            for s, item in enumerate(row):
                if item is not None:
                    f_tick[item, s] = t
        return {
            (t, s): t - f_tick[item, s]
            for t, row in enumerate(self.backward)
            for s, item in enumerate(row)
            if item is not None
        }

    def read_slots(self) -> np.ndarray:
        """``int32[ticks, stages]``: the ring slot each backward reads (0 when idle)."""
        out = np.zeros((self.ticks, self.stages), np.int32)
        for (t, s), age in self.ages().items():
            out[t, s] = (t - age) % self.ring
        return out

    @property
    def ticks(self) -> int:
        return len(self.forward)

    @property
    def bubble(self) -> float:
        """Analytic idle share: see :func:`bubble_fraction`."""
        return bubble_fraction(self.name, self.stages, self.microbatches, self.virtual)

    @property
    def work_ticks(self) -> float:
        """Ticks of one full stage (``v`` chunks) forward + backward each stage computes.

        Forward-only and backward-only ticks count by halves in proportion; the
        engine computes every stage's slot in a tick where any stage has work, so
        this is the compiled work per device in units of one stage's F + B on
        one micro-batch: ``(v·m + p − 1)/v``, i.e. ``m / (1 − bubble)``.
        """
        f = sum(any(x is not None for x in row) for row in self.forward)
        b = sum(any(x is not None for x in row) for row in self.backward)
        return (f + b) / 2 / self.virtual

    def chunk(self, stage: int, virtual: int) -> int:
        """The model chunk (``0 … p·v − 1``, in layer order) a stage runs in a round."""
        return virtual * self.stages + stage

    def tables(self) -> dict[str, np.ndarray]:
        """``int32[ticks, stages]`` arrays for the engine: mb, virtual, valid, slot, ends."""
        p, v = self.stages, self.virtual
        out = {}
        for kind, rows, slot in (
            ("f", self.forward, self.slot_f),
            ("b", self.backward, self.slot_b),
        ):
            mb = np.zeros((self.ticks, p), np.int32)
            k = np.zeros((self.ticks, p), np.int32)
            valid = np.zeros((self.ticks, p), bool)
            first = np.zeros((self.ticks, p), bool)
            last = np.zeros((self.ticks, p), bool)
            for t, row in enumerate(rows):
                for s, item in enumerate(row):
                    if item is None:
                        continue
                    mb[t, s], k[t, s] = item
                    valid[t, s] = True
                    c = self.chunk(s, item[1])
                    first[t, s] = c == 0
                    last[t, s] = c == p * v - 1
            out.update(
                {
                    f"{kind}_mb": mb,
                    f"{kind}_k": k,
                    f"{kind}_valid": valid,
                    f"{kind}_first": first,
                    f"{kind}_last": last,
                    f"{kind}_slot": slot,
                }
            )
        return out

    def timeline(self) -> str:
        """A text table of the schedule (``F3`` forward of micro-batch 3, ``B3`` backward;
        ``F3.1`` its second virtual round)."""

        def label(kind: str, item: Item) -> str:
            if item is None:
                return ""
            return f"{kind}{item[0]}" + (f".{item[1]}" if self.virtual > 1 else "")

        lines = ["tick   " + "  ".join(f"stage {s}" for s in range(self.stages))]
        for t in range(self.ticks):
            cells = []
            for s in range(self.stages):
                text = " ".join(
                    x
                    for x in (label("F", self.forward[t][s]), label("B", self.backward[t][s]))
                    if x
                )
                cells.append((text or ".").ljust(7))
            lines.append(f"{t:<6} " + "  ".join(cells).rstrip())
        return "\n".join(lines)


def _gpipe(p: int, m: int) -> tuple[list, list]:
    n = m + p - 1
    fwd = [[(t - s, 0) if 0 <= t - s < m else None for s in range(p)] for t in range(n)]
    bwd = [
        [(t - (p - 1 - s), 0) if 0 <= t - (p - 1 - s) < m else None for s in range(p)]
        for t in range(n)
    ]
    idle = [[None] * p for _ in range(n)]
    return fwd + idle, idle + bwd


def _one_f_one_b(p: int, m: int) -> tuple[list, list]:
    n = m + 2 * p - 2
    fwd = [[(t - s, 0) if 0 <= t - s < m else None for s in range(p)] for t in range(n)]
    bwd = []
    for t in range(n):
        row = []
        for s in range(p):
            j = t - 2 * (p - 1) + s
            row.append((j, 0) if 0 <= j < m else None)
        bwd.append(row)
    return fwd, bwd


def _interleaved(p: int, m: int, v: int) -> tuple[list, list]:
    n = m * v + p - 1

    def item(u: int) -> Item:
        if not 0 <= u < m * v:
            return None
        g, r = divmod(u, p * v)
        return (g * p + r % p, r // p)

    fwd = [[item(t - s) for s in range(p)] for t in range(n)]
    bwd = [
        [
            item(m * v - 1 - (t - (p - 1 - s))) if 0 <= t - (p - 1 - s) < m * v else None
            for s in range(p)
        ]
        for t in range(n)
    ]
    idle = [[None] * p for _ in range(n)]
    return fwd + idle, idle + bwd


def make(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``stages`` stages, ``microbatches`` micro-batches.

    Raises:
      UnknownScheduleError: ``name`` is not one of :data:`SCHEDULES`.
      MicrobatchError: ``interleaved`` with micro-batches not a multiple of the stages.

    Warns:
      PipelineWarning: fewer micro-batches than stages (the bubble fraction is stated).
    """
    if name not in SCHEDULES:
        raise UnknownScheduleError(
            f"Unknown pipeline schedule {name!r}.\nFix: use one of {', '.join(SCHEDULES)}."
        )
    p, m = int(stages), int(microbatches)
    if m < 1 or p < 1:
        raise MicrobatchError(f"A pipeline needs stages >= 1 and micro-batches >= 1, got {p}, {m}.")
    v = int(virtual) if name == "interleaved" else 1
    if name == "interleaved" and m % p:
        raise MicrobatchError(
            f"Schedule 'interleaved' sends micro-batches round the {p} stages in groups of {p}; "
            f"{m} micro-batches is not a multiple of {p}.\nFix: --microbatches "
            f"{max(p, m // p * p)} or {(m // p + 1) * p}, or schedule '1f1b'."
        )
    if m < p:
        warnings.warn(
            f"{m} micro-batches for {p} pipeline stages: the bubble is "
            f"{bubble_fraction(name, p, m, v):.0%} of each stage's time.\n"
            f"Fix: micro-batches >= {p} (e.g. {4 * p}: bubble "
            f"{bubble_fraction(name, p, 4 * p, v):.0%}).",
            PipelineWarning,
            stacklevel=2,
        )
    build = {
        "gpipe": lambda: _gpipe(p, m),
        "1f1b": lambda: _one_f_one_b(p, m),
        "interleaved": lambda: _interleaved(p, m, v),
    }[name]
    fwd, bwd = build()
    _check(name, p, v, fwd, bwd, m)
    slot_f, slot_b, slots = _allocate(p, fwd, bwd)
    return Schedule(
        name,
        p,
        m,
        v,
        tuple(tuple(r) for r in fwd),
        tuple(tuple(r) for r in bwd),
        slot_f,
        slot_b,
        slots,
    )


def _check(name: str, p: int, v: int, fwd: list, bwd: list, m: int) -> None:
    """Every item's input arrives from the previous tick; every item runs exactly once."""
    last_chunk = p * v - 1
    for rows, step, kind in ((fwd, -1, "forward"), (bwd, 1, "backward")):
        seen = set()
        for t, row in enumerate(rows):
            for s, item in enumerate(row):
                if item is None:
                    continue
                seen.add((item, s))
                c = item[1] * p + s
                end = c == 0 if kind == "forward" else c == last_chunk
                if end:
                    continue
                src = (s + step) % p
                want = (item[0], (c + step) // p)
                got = rows[t - 1][src] if t else None
                assert got == want, (name, kind, t, s, item, got)
        assert len(seen) == m * v * p, (name, kind, len(seen))
    done = {}
    for t, row in enumerate(fwd):
        for s, item in enumerate(row):
            if item is not None:
                done[(item, s)] = t
    for t, row in enumerate(bwd):
        for s, item in enumerate(row):
            if item is not None:
                assert done[(item, s)] <= t, (name, "backward before forward", t, s, item)


def _allocate(p: int, fwd: list, bwd: list) -> tuple[np.ndarray, np.ndarray, int]:
    """Buffer slots per stage: a forward takes the lowest free slot, its backward frees it."""
    n = len(fwd)
    slot_f = np.full((n, p), -1, np.int32)
    slot_b = np.full((n, p), -1, np.int32)
    most = 0
    for s in range(p):
        free: list[int] = []
        used: dict[tuple[int, int], int] = {}
        size = 0
        for t in range(n):
            if fwd[t][s] is not None:
                if free:
                    slot = min(free)
                    free.remove(slot)
                else:
                    slot, size = size, size + 1
                used[fwd[t][s]] = slot
                slot_f[t, s] = slot
            if bwd[t][s] is not None:
                slot = used.pop(bwd[t][s])
                slot_b[t, s] = slot
                free.append(slot)
        most = max(most, size)
    slot_f[slot_f < 0] = most  # idle: the trash slot
    slot_b[slot_b < 0] = most
    return slot_f, slot_b, most
