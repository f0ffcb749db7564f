"""``sk.autoplan``: choose recipe, mesh, remat, micro-batches and precision from
compiled evidence.

1. Enumerate candidates from the recipe registry × every factorisation of the device
   count into the recipe's mesh axes × remat × micro-batches (pipelines) × precision
   (:mod:`shardkit.autoplanner.candidates`).
2. Prune with the analytic model: dimensions a mesh does not divide, state over the
   budget (:func:`shardkit.autoplanner.evaluate.prune`); each pruned candidate keeps its
   reason.
3. Rank the survivors by the pre-compile estimate (``sk.estimate``: memory per device;
   the analytic memory for a model without dims) and analytic step time, and compile the
   top (abstract state, emulated devices): the best of each recipe (and logits layout),
   then the best overall, up to ``max_compiles`` (``--compile-top K``); each compiled
   candidate's reason says how far its estimate was from the compiled memory. Results are cached on disk (:mod:`shardkit.autoplanner.cache`).
4. Estimate each compiled candidate's step time with a roofline
   (:mod:`shardkit.autoplanner.roofline`) on the chosen hardware
   (:mod:`shardkit.autoplanner.hardware`).
5. Rank what fits the memory budget, fastest first, with one sentence each on why it
   wins or loses.

Example:
  >>> import tempfile, shardkit as sk
  >>> from shardkit.autoplanner.cache import Cache
  >>> result = sk.autoplan("gpt-tiny", batch=8, seq=32, devices=8,
  ...                      memory_per_device=2**30, hardware="h100",
  ...                      recipes=["dp", "fsdp"], remats=["none"], progress=False,
  ...                      cache=Cache(tempfile.mkdtemp()))
  >>> result.best.candidate.recipe
  'dp'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from rich.progress import Progress

from shardkit import recipes as recipe_registry
from shardkit.autoplanner import hardware as hardware_table
from shardkit.autoplanner.cache import Cache, versions
from shardkit.autoplanner.candidates import (
    PRECISIONS,
    REMATS,
    SCHEDULES,
    Candidate,
    enumerate_candidates,
)
from shardkit.autoplanner.evaluate import (
    Analytic,
    Evidence,
    Pruned,
    Subject,
    compile_candidate,
    prune,
)
from shardkit.autoplanner.hardware import GIB
from shardkit.autoplanner.roofline import Estimate, bubble, estimate, model_flops
from shardkit.autoplanner.worker import compile_elsewhere
from shardkit.errors import ShardingError
from shardkit.models import resolve
from shardkit.models.model import Model
from shardkit.models.user import as_user_model
from shardkit.parallel.schedules import SCHEDULES as ALL_SCHEDULES
from shardkit.protocol import Model as ProtocolModel
from shardkit.report.records import human_bytes
from shardkit.report.tables import BYTES, Column, fit_table, short_bytes, short_seconds

__all__ = ["autoplan", "AutoplanResult", "Ranked", "Rejected", "NoLayoutFitsError"]


def _human_seconds(s: float) -> str:
    """``1.2 s``, ``35 ms``, ``4.1 µs``."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


class NoLayoutFitsError(ShardingError):
    """No candidate fits: the message names the smallest memory that would, and the
    device counts that would work."""


@dataclasses.dataclass(frozen=True)
class Ranked:
    """A compiled candidate that fits, with its evidence and estimate."""

    candidate: Candidate
    evidence: Evidence
    analytic: Analytic
    estimate: Estimate
    reason: str = ""

    @property
    def analytic_memory_ratio(self) -> float:
        """The analytic memory per device over the compiled one."""
        return self.analytic.memory / self.evidence.memory["total"]

    def to_json(self) -> dict:
        return {
            **self.candidate.to_json(),
            "memory_per_device_bytes": self.evidence.memory,
            "analytic_memory_per_device_bytes": self.analytic.memory,
            "analytic_over_compiled_memory": self.analytic_memory_ratio,
            "estimated_memory_per_device_bytes": self.analytic.estimated,
            "memory_terms": list(self.evidence.memory_terms),
            "memory_explanations": list(self.evidence.explanations),
            "wire_bytes": self.evidence.wire_bytes,
            "analytic_wire_bytes": self.analytic.wire,
            "flops": self.evidence.flops,
            "step_time_s": self.estimate.step_time_s,
            "step_time_no_overlap_s": self.estimate.no_overlap_s,
            "compute_s": self.estimate.compute_s,
            "intra_node_comm_s": self.estimate.intra_node_s,
            "inter_node_comm_s": self.estimate.inter_node_s,
            "collective_latency_s": self.estimate.latency_s,
            "pipeline_ticks_s": self.estimate.ticks_s,
            "mfu": self.estimate.mfu,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A candidate that was dropped, and why."""

    candidate: Candidate
    reason: str
    stage: str  # "analytic", "compile", "memory" or "not compiled"

    def to_json(self) -> dict:
        return {**self.candidate.to_json(), "stage": self.stage, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class AutoplanResult:
    """The ranked candidates (best first) and the rejected ones."""

    candidates: tuple[Ranked, ...]
    rejected: tuple[Rejected, ...]
    hardware: hardware_table.Hardware
    devices: int
    memory_per_device: float
    model: str
    batch: int
    seq: int

    @property
    def best(self) -> Ranked:
        return self.candidates[0]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "batch": self.batch,
            "seq": self.seq,
            "devices": self.devices,
            "memory_per_device_bytes": self.memory_per_device,
            "hardware": dataclasses.asdict(self.hardware),
            "candidates": [c.to_json() for c in self.candidates],
            "rejected": [r.to_json() for r in self.rejected],
        }

    def table(self, limit: int = 15, *, width: int = 80, wide: bool = False):
        """A rich table of the ranked candidates, one line each, fitted to ``width``
        columns (the layout's names whole; full text in ``to_json``)."""

        def dash(value: Any) -> str:
            return "–" if value is None else str(value)

        shown = self.candidates[:limit]
        # The micro-batch count and the logits' layout tell two rows apart where they vary.
        m_varies = len({r.candidate.microbatches for r in shown}) > 1
        schedule_varies = len({r.candidate.schedule for r in shown}) > 1
        logits_vary = len({r.candidate.logits for r in shown}) > 1
        attention_varies = len({r.candidate.attention for r in shown}) > 1
        columns = [
            Column("#", lambda x: str(x[0]), keep=True, justify="right"),
            Column("recipe", lambda x: x[1].candidate.recipe, keep=True),
            Column("mesh", lambda x: x[1].candidate.mesh_label, keep=True),
            Column("remat", lambda x: dash(x[1].candidate.remat), keep=True),
            Column("prec.", lambda x: x[1].candidate.precision, keep=True),
            Column("m", lambda x: dash(x[1].candidate.microbatches), keep=m_varies, priority=2),
            Column(
                "schedule",
                lambda x: dash(x[1].candidate.schedule_label),
                keep=schedule_varies,
                priority=2,
            ),
            Column("logits", lambda x: dash(x[1].candidate.logits), keep=logits_vary, priority=2),
            Column(
                "attention",
                lambda x: dash(x[1].candidate.attention),
                keep=attention_varies,
                priority=2,
            ),
            Column(
                "memory",
                lambda x: short_bytes(x[1].evidence.memory["total"]),
                keep=True,
                justify="right",
            ),
            Column(
                "step",
                lambda x: short_seconds(x[1].estimate.step_time_s),
                keep=True,
                justify="right",
            ),
            Column("MFU", lambda x: f"{x[1].estimate.mfu:.0%}", priority=1),
            Column("wire", lambda x: short_bytes(x[1].evidence.wire_bytes), priority=1),
        ]
        return fit_table(
            columns,
            enumerate(shown, 1),
            width=width,
            wide=wide,
            title=f"{self.model} on {self.devices} {self.hardware.name} devices, batch "
            f"{self.batch}, seq {self.seq}, {self.memory_per_device / GIB:.0f} GiB each",
            caption=f"bytes per device ({BYTES}); step: the roofline estimate",
        )

    def memory_gap_lines(self, tolerance: float = 0.25) -> list[str]:
        """The best candidate's compiled memory against the analytic model, itemised by term
        when they differ by more than ``tolerance`` (the rest of the ranks: ``--json``)."""
        best = self.best
        ratio = best.analytic_memory_ratio
        if abs(ratio - 1) <= tolerance or not best.evidence.explanations:
            return []
        lines = [f"#1's analytic memory is {ratio:.2f}x its compiled memory; by term:"]
        for e in best.evidence.explanations:
            analytic = human_bytes(e["analytic_bytes"]) if e["analytic_bytes"] else "none"
            lines.append(
                f"  {e['term']}: {human_bytes(e['measured_bytes'])} compiled, "
                f"{analytic} analytic: {e['why']}"
            )
        return lines

    def __rich_console__(self, console: Any, options: Any):
        yield self.table(width=options.max_width)
        yield from self.notes()

    def notes(self) -> list[str]:
        """What the table's rows mean: why the best five rank where they do, the best
        one's memory against the analytic model, and how many were rejected where."""
        lines = [
            f"{i}. {r.candidate.label}: {r.reason}" for i, r in enumerate(self.candidates[:5], 1)
        ]
        lines += self.memory_gap_lines()
        stages: dict[str, int] = {}
        for r in self.rejected:
            stages[r.stage] = stages.get(r.stage, 0) + 1
        if stages:
            lines.append(
                "rejected: "
                + ", ".join(f"{n} {s}" for s, n in stages.items())
                + " (--json lists each with its reason)"
            )
        return lines


def _model_key(model: Any, name: str) -> dict:
    if isinstance(model, Model):
        return {"name": name, "config": repr(model.config)}
    return {"name": name, "dims": None if model.dims is None else dataclasses.asdict(model.dims)}


def _analytic_time(subject: Subject, c: Candidate, a: Analytic, hw, devices: int) -> float:
    """Pre-compile estimate: useful FLOPs (+ a recomputed forward under full remat,
    stretched by a pipeline's bubble) and the analytic wire bytes, each term over the
    link its mesh axes use (:func:`term_links`)."""
    useful = _useful_flops(subject, c, devices)
    flops = useful * (4 / 3 if c.remat == "full" else 1)
    stages = c.mesh_sizes.get("stage", 1)
    if stages > 1 and c.microbatches:
        flops /= 1 - bubble(stages, c.microbatches, c.schedule or "1f1b", c.virtual_stages)
    comm = 0.0
    for share, crosses in term_links(c, a, hw.devices_per_node):
        comm += share / hw.bandwidth(crosses)
    return max(flops / hw.peak_flops(c.precision), comm)


#: The axis roles (``Recipe.axis_role``) each wire term moves over.
_TERM_ROLES = {
    "weight all-gathers": ("fsdp", "tsp"),
    "activation collectives": ("tensor", "tsp", "sequence"),
    "logits / loss collectives": ("tensor", "tsp", "sequence"),
    "context-parallel K/V": ("sequence", "tsp"),
    "pipeline transfers": ("stage",),
}


def _spans_nodes(sizes: list[int], axes: list[int], per_node: int) -> bool:
    """Whether a group over mesh axes ``axes`` (indices into ``sizes``, the devices laid
    out row-major) holds devices of two nodes: its ids spread over ``per_node`` or more."""
    spread = sum((sizes[i] - 1) * math.prod(sizes[i + 1 :]) for i in axes)
    return spread >= per_node


def term_links(c: Candidate, a: Analytic, per_node: int) -> list[tuple[float, bool]]:
    """The analytic wire bytes of ``c`` as (bytes, crosses nodes) by the axes each term
    moves over, the devices laid out row-major over its mesh (the last axis fastest):
    weights over the FSDP axes, activations over tensor / sequence, a pipeline's sends over
    ``stage``; gradient reductions reduce-scatter over the FSDP axes and all-reduce their
    shard over the data axes (split by the ring formulas' bytes, ``(F−1)/F`` against
    ``2(D−1)/(D·F)``). A term with no such axis here (expert dispatch, the rest) takes
    every axis.

    Example:
      >>> c = Candidate("zeropp", (("data", 4), ("stage", 16), ("fsdp", 8)))
      >>> a = Analytic(0.0, 0.0, 3.0, wire_terms=(("weight all-gathers", 1.0),
      ...                                         ("pipeline transfers", 2.0)))
      >>> term_links(c, a, per_node=8)
      [(1.0, False), (2.0, True)]
    """
    recipe = c.recipe_object()
    names = [n for n, _ in c.mesh]
    sizes = [int(s) for _, s in c.mesh]
    roles = [recipe.axis_role(n) for n in names]
    every = list(range(len(names)))

    def over(wanted) -> list[int]:
        return [i for i, r in enumerate(roles) if r in wanted]

    out: list[tuple[float, bool]] = []
    for term, size in a.wire_terms or (("other collectives", a.wire),):
        if term == "gradient reductions":
            shard, data = over(("fsdp", "tsp")), over(("data",))
            f = math.prod(sizes[i] for i in shard)
            d = math.prod(sizes[i] for i in data)
            scatter = (f - 1) / f if shard else 0.0
            reduce = 2 * (d - 1) / (d * f) if data else 0.0
            for axes, part in ((shard, scatter), (data, reduce)):
                if part:
                    out.append(
                        (size * part / (scatter + reduce), _spans_nodes(sizes, axes, per_node))
                    )
            if not (scatter or reduce):
                out.append((size, _spans_nodes(sizes, every, per_node)))
            continue
        axes = over(_TERM_ROLES.get(term, ())) or every
        out.append((size, _spans_nodes(sizes, axes, per_node)))
    rest = a.wire - sum(size for size, _ in out)
    if rest > 1e-6 * a.wire:  # bytes the terms do not name: over every axis
        out.append((rest, _spans_nodes(sizes, every, per_node)))
    return out


def _useful_flops(subject: Subject, c: Candidate, devices: int) -> float:
    dims = subject.model.dims
    tokens = subject.batch * subject.seq
    if dims is None:
        return model_flops(params=subject.param_count, tokens=tokens) / devices
    return (
        model_flops(
            params=dims.param_count,
            tokens=tokens,
            layers=dims.layers,
            d_model=dims.d_model,
            seq=subject.seq,
        )
        / devices
    )


def _compile_set(order: list[tuple[Candidate, Analytic, float]], max_compiles: int):
    """The best candidate of each recipe (of each of its logits layouts and attention
    strategies, where those are a choice), the fastest recipes first, for up to half of
    ``max_compiles`` (all of them where that is one), then the best overall: breadth
    against a misjudged recipe, depth where the estimate says the step is won (gpt-7b on
    512 devices: meshes and schedules of the fastest recipe)."""
    chosen, seen = [], set()
    breadth = max_compiles // 2 or max_compiles
    for c, _, _ in order:
        if (c.recipe, c.logits, c.attention) not in seen and len(chosen) < breadth:
            seen.add((c.recipe, c.logits, c.attention))
            chosen.append(c)
    for c, _, _ in order:
        if len(chosen) >= max_compiles:
            break
        if c not in chosen:
            chosen.append(c)
    return chosen


def _explain(r: Ranked, best: Ranked, budget: float) -> str:
    e, b = r.estimate, best.estimate
    mem = f"{human_bytes(r.evidence.memory['total'])} of {human_bytes(budget)}"
    if r is best:
        bound = "compute" if e.compute_s >= e.comm_s else "communication"
        parts = [
            f"fastest: {_human_seconds(e.step_time_s)}/step, {bound}-bound "
            f"({_human_seconds(e.compute_s)} compute, {_human_seconds(e.comm_s)} "
            "communication)",
            mem,
        ]
        if e.inter_node_s:
            parts.append(f"{_human_seconds(e.inter_node_s)} of communication across nodes")
        return "; ".join(parts)
    slower = e.step_time_s / b.step_time_s
    if e.compute_s >= e.comm_s:
        what, extra = "compute", e.compute_s - b.step_time_s
    elif e.inter_node_s >= e.intra_node_s:
        what, extra = "inter-node communication", e.comm_s - b.step_time_s
    else:
        what, extra = "intra-node communication", e.comm_s - b.step_time_s
    executions = sum(c[3] if len(c) > 3 else 1 for c in r.evidence.collectives)
    latency = f"{_human_seconds(e.latency_s)} of it the latency of {executions} collectives"
    why = {
        "compute": f"its pipeline's ticks wait on their neighbours ({_human_seconds(e.ticks_s)})"
        if e.ticks_s >= 0.5 * e.compute_s
        else "recomputes the forward (remat)"
        if r.candidate.remat == "full"
        else "more FLOPs per device (replicated work, a pipeline bubble or a slower precision)",
        "intra-node communication": latency
        if e.latency_s >= 0.5 * e.comm_s
        else f"moves {human_bytes(r.evidence.wire_bytes)} per device "
        f"vs {human_bytes(best.evidence.wire_bytes)}",
        "inter-node communication": "sends more of its traffic over the slower inter-node link",
    }[what]
    if slower < 1.005:
        return f"as fast as #1 within 0.5%; ranked after it as the less simple layout (more mesh axes, later in the registry, or more memory); {mem}"
    return f"{slower:.2f}x slower, {what}-bound (+{_human_seconds(extra)}): {why}; {mem}"


def _smallest_fit(subject: Subject, devices: int, remats, precisions, names) -> str:
    """Device counts near ``devices`` where some candidate passes the analytic checks."""
    works = []
    for n in sorted({2**k for k in range(1, 13)} | {devices // 2, devices * 2}):
        if n < 1:
            continue
        for c in enumerate_candidates(
            n,
            subject.batch,
            recipe_names=names,
            remats=remats,
            precisions=precisions,
            n_experts=_experts(subject),
        ):
            if not isinstance(prune(subject, c, budget=math.inf), Pruned):
                works.append(n)
                break
    return ", ".join(map(str, works)) or "none up to 4096"


def autoplan(
    model: Any,
    *,
    batch: int,
    seq: int,
    devices: int,
    memory_per_device: float | None = None,
    hardware: str | hardware_table.Hardware = "h100",
    recipes: Sequence[str] | None = None,
    remats: Sequence[str] | None = None,
    precisions: Sequence[str] = ("f32",),
    schedules: Sequence[str] = SCHEDULES,
    max_compiles: int = 16,
    compile_timeout_s: float | None = 120,
    cache: Cache | None = None,
    progress: bool = True,
) -> AutoplanResult:
    """Rank layouts of ``model``'s AdamW train step on ``devices`` devices.

    Args:
      model: a reference model's name (``"gpt-7b"``), a user's ``"module:factory"``, or a
        model object (``models.get(...)``; compiling then needs ``devices`` devices in
        this process, or use a name).
      batch, seq: global batch and sequence length of a step.
      devices: the device count to plan for.
      memory_per_device: bytes each device may hold (default: the hardware's memory).
      hardware: a name in :func:`shardkit.autoplanner.hardware.names` or a ``Hardware``.
      recipes: recipe names to consider (default: every registered recipe).
      remats: remat policies to try for a reference model (default: none, save_dots,
        full); a user's model keeps its own.
      precisions: ``"f32"`` and/or ``"bf16"``.
      schedules: the pipeline schedules a pipelining recipe is tried with (default:
        1f1b, interleaved, zb1, zbv: :data:`~shardkit.autoplanner.candidates.SCHEDULES`).
      max_compiles: how many survivors of the analytic pruning to compile, the best by
        the pre-compile estimate first (``--compile-top``).
      compile_timeout_s: a candidate compiled in a worker process that takes longer is
        given up and rejected with that reason (``None``: no limit; compiles in this
        process, when it has the devices, have none).
      cache: where compiled evidence is kept (default: :class:`Cache`).
      progress: show a progress bar while compiling.

    Raises:
      NoLayoutFitsError: nothing fits; the message names the smallest memory that
        would fit and the device counts that would work.
    """
    if not isinstance(devices, int) or devices < 1:
        raise ShardingError(f"autoplan(devices=...) is a positive int, got {devices!r}.")
    for p in precisions:
        if p not in PRECISIONS:
            raise ShardingError(f"autoplan precision {p!r}: use one of {PRECISIONS}.")
    for sch in schedules:
        if sch not in ALL_SCHEDULES:
            raise ShardingError(
                f"autoplan schedule {sch!r}: use some of {', '.join(ALL_SCHEDULES)}."
            )
    hw = hardware_table.get(hardware)
    budget = float(memory_per_device or hw.memory_bytes)
    name = model if isinstance(model, str) else getattr(model, "name", type(model).__name__)
    model_obj = resolve(model) if isinstance(model, str) else model
    if not isinstance(model_obj, ProtocolModel):  # init and loss alone: what can be derived
        model_obj = as_user_model(model_obj, name=name)
    subject = Subject.of(model_obj, batch=batch, seq=seq)
    reference = isinstance(model_obj, Model)
    remats = tuple(remats or REMATS) if reference else (None,)
    names = list(recipes or recipe_registry.names())
    for n in names:
        recipe_registry.get(n)  # unknown names fail here, with the list

    rejected: list[Rejected] = []
    survivors: list[tuple[Candidate, Analytic, float]] = []
    for c in enumerate_candidates(
        devices,
        batch,
        recipe_names=names,
        remats=remats,
        precisions=precisions,
        n_experts=_experts(subject),
        schedules=schedules,
    ):
        got = prune(subject, c, budget=budget)
        if isinstance(got, Pruned):
            rejected.append(Rejected(c, got.reason, "analytic"))
        else:
            survivors.append((c, got, _analytic_time(subject, c, got, hw, devices)))
    if not survivors:
        _raise_no_fit(subject, rejected, devices, budget, remats, precisions, names)
    # Ranked by the pre-compile estimate (sk.estimate; the analytic memory where the model
    # declares no dims): what fits first, fastest first; only the top compile.
    survivors.sort(key=lambda s: (s[1].ranking_memory > budget, s[2]))
    chosen = _compile_set(survivors, max_compiles)
    analytic = {c: a for c, a, _ in survivors}
    for c, _, t in survivors:
        if c not in chosen:
            rejected.append(
                Rejected(
                    c,
                    f"not compiled: its analytic estimate ({t:.3g} s/step) "
                    f"is not among the {max_compiles} best",
                    "not compiled",
                )
            )

    evidence = _compile_all(
        subject, name, model, chosen, devices, cache or Cache(), progress, compile_timeout_s
    )
    ranked = []
    for c in chosen:
        got = evidence[c]
        if isinstance(got, Pruned):
            rejected.append(Rejected(c, got.reason, "compile"))
            continue
        if got.memory["total"] > budget:
            rejected.append(
                Rejected(
                    c,
                    f"compiled: {human_bytes(got.memory['total'])} per device, "
                    f"over the {human_bytes(budget)} budget{_estimate_note(analytic[c], got)}",
                    "memory",
                )
            )
            continue
        stages = c.mesh_sizes.get("stage", 1)
        est = estimate(
            flops=got.flops or 0.0,
            collectives=got.collectives,
            hardware=hw,
            precision=c.precision,
            useful_flops=_useful_flops(subject, c, devices),
            devices=devices,
            stages=stages,
            microbatches=c.microbatches,
            remat=c.remat,
            schedule=c.schedule or "1f1b",
            virtual=c.virtual_stages,
        )
        ranked.append(Ranked(c, got, analytic[c], est))
    if not ranked:
        _raise_no_fit(subject, rejected, devices, budget, remats, precisions, names)
    ranked.sort(key=lambda r: (r.estimate.step_time_s, _simplicity(r)))
    ranked = _ties_by_simplicity(ranked)
    best = ranked[0]
    ranked = [
        dataclasses.replace(
            r,
            reason=_explain(r, best, budget)
            + (f"; {r.analytic.experts}" if r.analytic.experts else "")
            + _estimate_note(r.analytic, r.evidence),
        )
        for r in ranked
    ]
    return AutoplanResult(tuple(ranked), tuple(rejected), hw, devices, budget, name, batch, seq)


def _experts(subject: Subject) -> int:
    """The model's routed experts (0: dense, or no declared dims)."""
    dims = subject.model.dims
    return dims.n_experts if dims is not None else 0


def _estimate_note(a: Analytic, e: Evidence) -> str:
    """How far the pre-compile estimate was from the compiled memory."""
    if a.estimated is None:
        return ""
    compiled = e.memory["total"]
    return (
        f"; estimated {human_bytes(a.estimated)} before compiling, "
        f"{a.estimated / compiled - 1:+.0%} off the compiled {human_bytes(compiled)}"
    )


def _simplicity(r: Ranked) -> tuple[int, int, int]:
    """Fewer mesh axes, then earlier in the registry (``dp`` before ``zero1``), then less
    memory."""
    names = recipe_registry.names()
    index = names.index(r.candidate.recipe) if r.candidate.recipe in names else len(names)
    return len(r.candidate.mesh), index, r.evidence.memory["total"]


def _ties_by_simplicity(ranked: list[Ranked]) -> list[Ranked]:
    """Within 0.5 % of step time, the simpler layout (:func:`_simplicity`) goes first."""
    out: list[Ranked] = []
    for r in ranked:
        out.append(r)
        i = len(out) - 1
        while i > 0:
            a, b = out[i - 1], out[i]
            close = b.estimate.step_time_s <= a.estimate.step_time_s * 1.005
            simpler = _simplicity(b) < _simplicity(a)
            if not (close and simpler):
                break
            out[i - 1], out[i] = b, a
            i -= 1
    return out


def _compile_all(subject, name, model, chosen, devices, cache, progress, timeout_s) -> dict:
    base = {
        "model": _model_key(subject.model, name),
        "batch": subject.batch,
        "seq": subject.seq,
        "devices": devices,
        "evidence": 2,  # collectives with their counts and group sizes; loop-weighted FLOPs
        **versions(),
    }
    out: dict[Candidate, Evidence | Pruned] = {}
    todo = []
    for c in chosen:
        hit = cache.get({**base, "candidate": c.to_json()})
        if hit is None:
            todo.append(c)
        else:
            out[c] = (
                Evidence.from_json(hit["evidence"]) if "evidence" in hit else Pruned(hit["pruned"])
            )
    if not todo:
        return out
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"compiling {len(todo)} layouts on {devices} devices", total=len(todo))
        if len(jax.devices()) >= devices:
            results = ({"index": i, **_in_process(subject, c, devices)} for i, c in enumerate(todo))
        else:
            if not isinstance(model, str):
                raise ShardingError(
                    f"autoplan: compiling for {devices} devices needs {devices} devices in this "
                    f"process (it has {len(jax.devices())}) or a model given by name.\nFix: pass "
                    "the model's name (e.g. 'gpt-7b' or 'package.module:factory')."
                )
            results = compile_elsewhere(
                {
                    "model": model,
                    "batch": subject.batch,
                    "seq": subject.seq,
                    "devices": devices,
                    "candidates": [c.to_json() for c in todo],
                },
                timeout_s=timeout_s,
            )
        for line in results:
            c = todo[line["index"]]
            out[c] = (
                Evidence.from_json(line["evidence"])
                if "evidence" in line
                else Pruned(line["pruned"])
            )
            if "timeout" not in line:  # a longer limit may compile it: ask again next time
                cache.put(
                    {**base, "candidate": c.to_json()},
                    {k: v for k, v in line.items() if k != "index"},
                )
            bar.update(task, advance=1, description=f"compiled {c.label}")
    return out


def _in_process(subject: Subject, c: Candidate, devices: int) -> dict:
    got = compile_candidate(subject, c, jax.devices()[:devices])
    return {"evidence": got.to_json()} if isinstance(got, Evidence) else {"pruned": got.reason}


def _raise_no_fit(subject, rejected, devices, budget, remats, precisions, names):
    mems = []
    for c in enumerate_candidates(
        devices,
        subject.batch,
        recipe_names=names,
        remats=remats,
        precisions=precisions,
        n_experts=_experts(subject),
    ):
        got = prune(subject, c, budget=math.inf)
        if isinstance(got, Analytic):
            mems.append((got.memory, c))
    compiled = [r for r in rejected if r.stage == "memory"]
    failed = sorted({r.reason for r in rejected if r.stage == "compile"})
    lines = [
        f"No layout of {len(rejected)} candidates fits {devices} devices with "
        f"{human_bytes(budget)} each."
    ]
    if mems:
        mem, c = min(mems, key=lambda m: m[0])
        lines.append(
            f"The smallest memory that would fit: about {human_bytes(mem)} per device "
            f"(analytic, {c.label})."
        )
    else:
        reasons = sorted({r.reason for r in rejected})[:3]
        lines.append(f"No mesh of {devices} devices divides the model: " + "; ".join(reasons))
    if failed:
        lines.append("Compiling refused: " + "; ".join(failed[:3]))
    if compiled:
        lines.append(
            "Compiled but over budget: "
            + "; ".join(f"{r.candidate.label} ({r.reason})" for r in compiled[:3])
        )
    lines.append(
        f"Device counts whose meshes divide the model and batch: "
        f"{_smallest_fit(subject, devices, remats, precisions, names)}."
    )
    lines.append(
        "Fix: raise memory_per_device (--memory-gb), change the device count, or "
        "shrink the batch or sequence."
    )
    raise NoLayoutFitsError("\n".join(lines))
