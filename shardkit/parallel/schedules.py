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
- ``zb1`` (ZB-H1, Qi et al. 2023): 1f1b's forwards and input-gradient backwards ``B``,
  each backward's weight gradient ``W`` deferred to the tick where the first stage runs
  that micro-batch's ``B``: every stage computes the same micro-batch's ``W`` in the same
  tick, so the ``W`` work is ``m`` ticks, not ``m + p − 1``. Needs ``m ≥ p``.
- ``zbv`` (ZB-V, Qi et al. 2024): two chunks per stage in a V, chunk ``s`` going down
  the stages and chunk ``2p − 1 − s`` coming back up (the first stage runs the
  embedding and the loss), micro-batches two ticks apart; ``B`` and ``W`` split as in
  ``zb1``. Residuals held: ``4p − 1`` chunk ticks, ``1/2`` a stage each, against 1f1b's
  ``2p − 1`` stage ticks.

The engine's ticks are lock-step (every stage runs a tick's program, so a tick costs
every stage its forward if any stage runs one, its ``B`` if any does, its ``W`` if any
does). With ``F``, ``B`` and ``W`` of equal cost (a matmul layer: ``x·w``, ``dy·wᵀ``,
``xᵀ·dy``), the idle share of a stage's time is ``(p − 1)/(m + p − 1)`` for gpipe and
1f1b, ``(p − 1)/(v·m + p − 1)`` interleaved, and ``2(p − 1)/(3m + 2(p − 1))`` for zb1
and zbv (the forwards and ``B`` pay the pipeline's fill, ``W`` does not). Qi et al.'s
``(p − 1)/(3m)`` assumes stages that run asynchronously, where a ``W`` fills a tick
whose other stages do ``F``; in lock-step every tick holding an ``F`` costs an ``F``.
zbv's V does not shorten the fill in lock-step: the last stage starts its ``2m``
chunk forwards ``p − 1`` ticks late and the last micro-batch then climbs ``p − 1``
stages back, so the forwards span ``2m + 2p − 2`` chunk ticks, 1f1b's ``m + p − 1``.

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
  >>> print(make("zb1", stages=2, microbatches=2).timeline())
  tick   stage 0   stage 1
  0      F0        .
  1      F1        F0 B0
  2      B0 W0     F1 B1 W0
  3      B1 W1     W1
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import numpy as np

from shardkit.errors import PipelineError

__all__ = [
    "SCHEDULES",
    "Buffers",
    "Schedule",
    "PipelineError",
    "UnknownScheduleError",
    "MicrobatchError",
    "StageDivisibilityError",
    "PipelineWarning",
    "UnitError",
    "bubble_fraction",
    "make",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")

#: Schedules that split each backward into ``B`` (input gradient) and ``W`` (weights).
SPLIT = ("zb1", "zbv")

Item = tuple[int, int] | None  # (microbatch, virtual round) or idle


class UnknownScheduleError(PipelineError):
    """A schedule name that is not one of :data:`SCHEDULES`."""


class MicrobatchError(PipelineError):
    """The batch does not split into the micro-batches asked for."""


class StageDivisibilityError(PipelineError):
    """The layers do not split into stages × virtual stages."""


class UnitError(PipelineError):
    """A ZeroPP scheduling unit that does not divide the micro-batches."""


class PipelineWarning(UserWarning):
    """A pipeline that runs, with a large bubble."""


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a stage's time: ``(p − 1)/(v·m + p − 1)`` (``v = 1`` unless
    interleaved); ``2(p − 1)/(3m + 2(p − 1))`` for zb1 and zbv (equal ``F``, ``B``, ``W``).

    Example:
      >>> bubble_fraction("gpipe", 4, 16), bubble_fraction("interleaved", 4, 16, 2)
      (0.15789473684210525, 0.08571428571428572)
      >>> bubble_fraction("zb1", 4, 16)
      0.1111111111111111
    """
    if schedule in SPLIT:
        return 2 * (stages - 1) / (3 * microbatches + 2 * (stages - 1))
    v = virtual if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


class Buffers(NamedTuple):
    """How many slots each stage of the rolled pipeline engine keeps of each thing it
    stores between ticks (:attr:`Schedule.buffers`): the one count the engine allocates
    and the estimator (``shardkit.report.estimator``) charges.

    Attributes:
      residuals: of what a forward keeps for its backward (and ``W``).
      own: the residual slots are each stage's own (:meth:`Schedule.own_slots`, sized to
        what a stage holds at once), not a ring indexed by the tick.
      loss_grad: of the last chunk's d loss / d y (1 where its backward runs in the tick
        of its forward).
      w_inputs: zb1 / zbv: of what a ``B`` leaves its ``W``; 0 for the other schedules.
      own_w: the ``W`` inputs' slots are each stage's own, not a ring.
    """

    residuals: int
    own: bool
    loss_grad: int
    w_inputs: int
    own_w: bool


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule's tables for ``stages`` stages and ``microbatches`` micro-batches.

    Attributes:
      forward, backward: per tick, per stage, the item ``(microbatch, virtual)`` or ``None``.
      slot_f, slot_b: per tick, per stage, the activation buffer slot the item writes
        (forward) or reads and frees (backward); ``slots`` (the trash slot) when idle.
      slots: the most micro-batches a stage holds at once (``2p − 1`` at most for 1f1b).
      weight: zb1 / zbv: per tick, per stage, the item whose weight gradient ``W`` the
        stage computes (``backward`` then holds only the input gradients ``B``); ``None``
        for the other schedules (a backward computes both).
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
    weight: tuple[tuple[Item, ...], ...] | None = None

    @property
    def split(self) -> bool:
        """Whether each backward is split into ``B`` and a later ``W`` (zb1, zbv)."""
        return self.weight is not None

    @property
    def ring(self) -> int:
        """Residual slots the engine keeps: a forward at tick ``t`` writes slot ``t mod ring``
        (the same slot on every stage, so the write is static), and every item is read back
        before that slot comes round again: ``ring`` = the longest forward-to-backward wait + 1
        (``2p − 1`` for 1f1b, ``m + 2p − 1`` for gpipe; zb1 / zbv: to the ``W``, which reads
        them last: ``2p − 1`` for zb1, ``4p − 1`` chunks for zbv)."""
        return int(max(self.ages().values())) + 1

    @property
    def w_ring(self) -> int:
        """zb1 / zbv: slots of what a ``B`` leaves for its ``W`` (the longest ``B``-to-``W``
        wait + 1: ``p`` for zb1); 0 for the other schedules."""
        if not self.split:
            return 0
        return int(max(self.ages("b", "w").values())) + 1

    @property
    def buffers(self) -> Buffers:
        """The rolled engine's buffer slots per stage (:class:`Buffers`): each stage's own
        slots where they are fewer than the ring's (gpipe: ``m + 1`` against
        ``m + 2p − 1``; zbv, p = 4: 11 against 15), else the ring by tick.

        Example:
          >>> make("gpipe", 4, 8).buffers
          Buffers(residuals=9, own=True, loss_grad=9, w_inputs=0, own_w=False)
          >>> make("1f1b", 4, 8).buffers.loss_grad, make("zbv", 4, 16).buffers.w_inputs
          (1, 4)
        """
        own = self.slots + 1 < self.ring
        residuals = self.slots + 1 if own else self.ring
        w_inputs, own_w = self.w_ring, False
        if self.split:
            _, size = self.own_slots("b", "w")
            own_w = size < w_inputs
            w_inputs = min(size, w_inputs)
        tables = self.tables()
        last = [a for (t, q), a in self.ages("f", "b").items() if tables["b_last"][t][q]]
        loss_grad = 1 if max(last) == 0 else residuals
        return Buffers(residuals, own, loss_grad, w_inputs, own_w)

    def _ticks_of(self, kind: str) -> dict[tuple[Item, int], int]:
        rows = {"f": self.forward, "b": self.backward, "w": self.weight}[kind]
        return {(item, s): t for t, row in enumerate(rows) for s, item in enumerate(row) if item}

    def ages(self, since: str = "f", until: str | None = None) -> dict[tuple[int, int], int]:
        """``{(tick, stage): ticks since}``: for every item's last read of its residuals (its
        backward; zb1 / zbv: its ``W``), the ticks since its forward; or ``since`` /
        ``until`` one of ``"f"``, ``"b"``, ``"w"``."""
        until = until or ("w" if self.split else "b")
        start = self._ticks_of(since)
        return {(t, s): t - start[item, s] for (item, s), t in self._ticks_of(until).items()}

    def read_slots(self, kind: str = "b", ring: str = "f") -> np.ndarray:
        """``int32[ticks, stages]``: the slot of ``ring`` (``"f"``: the residuals, written
        at slot ``tick mod ring``; ``"b"``: what a ``B`` leaves for its ``W``, slot ``tick
        mod w_ring``) that each ``kind`` item (``"b"``, ``"w"``) reads (0 when idle)."""
        size = self.ring if ring == "f" else self.w_ring
        out = np.zeros((self.ticks, self.stages), np.int32)
        for (t, s), age in self.ages(ring, kind).items():
            out[t, s] = (t - age) % size
        return out

    def own_slots(self, write: str, free: str) -> tuple[dict[str, np.ndarray], int]:
        """Each stage's own buffer slots for what a ``write`` item (``"f"``, ``"b"``)
        leaves until its ``free`` item (``"b"``, ``"w"``) reads it last: a ``write`` item
        takes the stage's lowest free slot (freed after its ``free`` item's tick), and idle
        ticks use one more, a trash slot. Sized to what a stage holds at once, not to the
        longest wait as :meth:`read_slots`' ``tick mod ring`` is (zbv, p = 4: 10 of 15
        residual slots, 3 of 5 for what ``W`` needs).

        Returns:
          ``{kind: int32[ticks, stages]}``, the slot each item of ``write``, ``free`` and
          (zb1 / zbv, for the residuals) ``"b"`` writes or reads (the trash slot when
          idle), and the number of slots, the trash one included.

        Example:
          >>> tables, size = make("zbv", 4, 16).own_slots("b", "w")
          >>> size, make("zbv", 4, 16).w_ring
          (4, 5)
        """
        rows = {"f": self.forward, "b": self.backward, "w": self.weight}
        slot_w, _, most = _allocate(self.stages, rows[write], rows[free])
        slot_of = {
            (item, st): int(slot_w[t, st])
            for t, row in enumerate(rows[write])
            for st, item in enumerate(row)
            if item is not None
        }
        out = {}
        for kind in {write, free, "b"} if self.split else {write, free}:
            table = np.full((self.ticks, self.stages), most, np.int32)
            for t, row in enumerate(rows[kind]):
                for st, item in enumerate(row):
                    if item is not None:
                        table[t, st] = slot_of[item, st]
            out[kind] = table
        return out, most + 1

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

        A tick costs every stage its forward if any stage runs one, and so on; with ``F``,
        ``B`` and ``W`` a third each (a backward without the split is ``B + W``), this is
        the compiled work per device in units of one stage's ``F + B + W`` on one
        micro-batch: ``(v·m + p − 1)/v`` without the split, i.e. ``m / (1 − bubble)``.
        """
        busy = lambda rows: sum(any(x is not None for x in row) for row in rows)  # noqa: E731
        f, b = busy(self.forward), busy(self.backward)
        w = busy(self.weight) if self.split else b
        return (f + b + w) / 3 / self.virtual

    def chunk(self, stage: int, virtual: int) -> int:
        """The model chunk (``0 … p·v − 1``, in layer order) a stage runs in a round
        (zbv: chunk ``s`` in round 0, ``2p − 1 − s`` in round 1)."""
        return chunk_of(self.name, self.stages, stage, virtual)

    def tables(self) -> dict[str, np.ndarray]:
        """``int32[ticks, stages]`` arrays for the engine: mb, virtual, valid, slot, ends."""
        p, v = self.stages, self.virtual
        out = {}
        kinds = [("f", self.forward, self.slot_f), ("b", self.backward, self.slot_b)]
        if self.split:
            kinds.append(("w", self.weight, self.slot_b))
        for kind, rows, slot in kinds:
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
        ``F3.1`` its second virtual round; zb1 / zbv: ``B3`` the input gradient, ``W3`` the
        weight gradient)."""

        def label(kind: str, item: Item) -> str:
            if item is None:
                return ""
            return f"{kind}{item[0]}" + (f".{item[1]}" if self.virtual > 1 else "")

        rows = [("F", self.forward), ("B", self.backward)]
        if self.split:
            rows.append(("W", self.weight))
        text = [
            [
                " ".join(x for x in (label(k, r[t][s]) for k, r in rows) if x) or "."
                for s in range(self.stages)
            ]
            for t in range(self.ticks)
        ]
        width = max(7, *(len(c) for row in text for c in row))
        lines = [
            "tick   " + "  ".join(f"stage {s}".ljust(width) for s in range(self.stages)).rstrip()
        ]
        for t, cells in enumerate(text):
            lines.append(f"{t:<6} " + "  ".join(c.ljust(width) for c in cells).rstrip())
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


def _zb1(p: int, m: int) -> tuple[list, list, list]:
    fwd, bwd = _one_f_one_b(p, m)
    # W of micro-batch j on every stage at the tick of the first stage's B (j + 2p − 2).
    wgt = [
        [(t - 2 * (p - 1), 0) if 0 <= t - 2 * (p - 1) < m else None] * p for t in range(len(fwd))
    ]
    return fwd, bwd, wgt


def _zbv(p: int, m: int) -> tuple[list, list, list]:
    n = 2 * m + 4 * p - 3
    fwd = [[None] * p for _ in range(n)]
    bwd = [[None] * p for _ in range(n)]
    wgt = [[None] * p for _ in range(n)]
    # W rounds: every stage's round-1 chunk (whose B comes first) at one tick, and every
    # stage's round-0 chunk at another, of the other parity (so one W per stage and tick).
    w_up = 3 * p - 2 + (p % 2 == 0)
    for j in range(m):
        for c in range(2 * p):
            s, k = _locate("zbv", p, c)
            fwd[2 * j + c][s] = (j, k)
            bwd[2 * j + 4 * p - 2 - c][s] = (j, k)
        for s in range(p):
            wgt[2 * j + w_up][s] = (j, 1)
            wgt[2 * j + 4 * p - 2][s] = (j, 0)
    return fwd, bwd, wgt


def chunk_of(name: str, stages: int, stage: int, virtual: int) -> int:
    """The model chunk a stage runs in round ``virtual``: ``virtual·p + stage``, or for zbv
    ``stage`` (round 0, down the stages) and ``2p − 1 − stage`` (round 1, back up).

    Example:
      >>> [chunk_of("zbv", 4, s, 1) for s in range(4)], chunk_of("interleaved", 4, 1, 1)
      ([7, 6, 5, 4], 5)
    """
    if name == "zbv":
        return stage if virtual == 0 else 2 * stages - 1 - stage
    return virtual * stages + stage


def _locate(name: str, p: int, chunk: int) -> tuple[int, int]:
    """``(stage, round)`` of a model chunk: the inverse of :func:`chunk_of`."""
    if name == "zbv":
        return (chunk, 0) if chunk < p else (2 * p - 1 - chunk, 1)
    return chunk % p, chunk // p


def make(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``stages`` stages, ``microbatches`` micro-batches.

    Raises:
      UnknownScheduleError: ``name`` is not one of :data:`SCHEDULES`.
      MicrobatchError: ``interleaved`` with micro-batches not a multiple of the stages;
        ``zb1`` / ``zbv`` with fewer micro-batches than stages.
      StageDivisibilityError: ``zbv`` with ``virtual`` other than 2 (its V is two chunks;
        1, the default, is taken as 2).

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
    v = int(virtual) if name == "interleaved" else 2 if name == "zbv" else 1
    if name == "zbv" and int(virtual) not in (1, 2):
        raise StageDivisibilityError(
            f"Schedule 'zbv' runs two chunks per stage (a V: chunk s down the {p} stages, "
            f"chunk {2 * p - 1}-s back up); virtual_stages={virtual} asks for "
            f"{p * int(virtual)} chunks.\nFix: virtual_stages=2 with zbv (2·{p} = {2 * p} "
            f"chunks), or schedule 'interleaved' for {virtual} chunks per stage."
        )
    if name in SPLIT and m < p:
        raise MicrobatchError(
            f"Schedule {name!r}: {m} micro-batches for {p} stages; its warm-up runs {p} "
            f"forwards before the first weight gradient, so it needs micro-batches >= {p}."
            f"\nFix: --microbatches {p} (bubble {bubble_fraction(name, p, p):.0%}) or "
            f"{2 * p} (bubble {bubble_fraction(name, p, 2 * p):.0%}), or schedule '1f1b'."
        )
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
        "zb1": lambda: _zb1(p, m),
        "zbv": lambda: _zbv(p, m),
    }[name]
    fwd, bwd, *wgt = build()
    wgt = wgt[0] if wgt else None
    _check(name, p, v, fwd, bwd, m, wgt)
    slot_f, slot_b, slots = _allocate(p, fwd, wgt or bwd)
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
        None if wgt is None else tuple(tuple(r) for r in wgt),
    )


def _check(name: str, p: int, v: int, fwd: list, bwd: list, m: int, wgt: list | None) -> None:
    """Every item's input arrives from the previous tick; every item runs exactly once; a
    backward follows its forward, a weight gradient its backward, on the same stage."""
    last_chunk = p * v - 1
    for rows, step, kind in ((fwd, -1, "forward"), (bwd, 1, "backward")):
        seen = set()
        for t, row in enumerate(rows):
            for s, item in enumerate(row):
                if item is None:
                    continue
                seen.add((item, s))
                c = chunk_of(name, p, s, item[1])
                end = c == 0 if kind == "forward" else c == last_chunk
                if end:
                    continue
                src, k = _locate(name, p, c + step)
                got = rows[t - 1][src] if t else None
                assert got == (item[0], k), (name, kind, t, s, item, got)
        assert len(seen) == m * v * p, (name, kind, len(seen))
    pairs = [(fwd, bwd, "backward before forward")]
    if wgt is not None:
        assert sum(x is not None for row in wgt for x in row) == m * v * p, (name, "W count")
        pairs.append((bwd, wgt, "weight gradient before backward"))
    for first, then, what in pairs:
        done = {}
        for t, row in enumerate(first):
            for s, item in enumerate(row):
                if item is not None:
                    done[(item, s)] = t
        for t, row in enumerate(then):
            for s, item in enumerate(row):
                if item is not None:
                    assert done[(item, s)] <= t, (name, what, t, s, item)


def _allocate(p: int, fwd: list, bwd: list) -> tuple[np.ndarray, np.ndarray, int]:
    """Buffer slots per stage: a forward takes the lowest free slot, its last reader (the
    backward; zb1 / zbv: the weight gradient, passed as ``bwd``) frees it."""
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
