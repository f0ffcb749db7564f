"""Judge one candidate: analytic pruning, then compiled evidence.

Runs in a process that has the candidate's devices (the planner starts a worker
process with that many emulated CPU devices when this one has fewer).

- :func:`prune` rejects a candidate without compiling: a parameter, optimizer-state or
  batch dimension its mesh does not divide (the same ``ShardingError`` the plan would
  raise, first line), a pipeline that cannot split the batch into micro-batches, or
  state (parameters, gradients and optimizer state) over the memory budget. It returns the analytic
  memory and wire bytes otherwise.
- :func:`compile_candidate` compiles the candidate's train step (abstract state, no
  allocation) and returns what XLA's program says: memory per device, FLOPs and every
  collective with its wire bytes and first replica group.

Example:
  >>> from shardkit import models
  >>> from shardkit.autoplanner.candidates import Candidate
  >>> from shardkit.autoplanner.evaluate import Subject, prune
  >>> subject = Subject.of(models.get("gpt-tiny"), batch=8, seq=32)
  >>> prune(subject, Candidate("dp", (("data", 16),)), budget=2**30).reason.split(":")[0]
  'batch'
  >>> prune(subject, Candidate("fsdp", (("fsdp", 8),)), budget=2**30).state == 16 * 124_672 / 8
  True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from shardkit import train
from shardkit.autoplanner.candidates import Candidate
from shardkit.autoplanner.roofline import ticks as schedule_ticks
from shardkit.errors import ShardingError
from shardkit.mesh import make_mesh
from shardkit.models.model import Model
from shardkit.nn.ulysses import check_heads, check_usp
from shardkit.parallel.schedules import PipelineError
from shardkit.plan import Plan
from shardkit.report import analytic_moe, build_report
from shardkit.report.analytic import analytic_costs, with_phases
from shardkit.report.estimator import estimate
from shardkit.report.records import human_bytes
from shardkit.report.wire_terms import TERMS as WIRE_TERMS
from shardkit.step import PIPELINE_DEFAULTS
from shardkit.workload import Workload

__all__ = ["Subject", "Pruned", "Analytic", "Evidence", "prune", "compile_candidate"]


@dataclasses.dataclass
class Subject:
    """The model and step being planned, with its unsharded state counted once."""

    model: Any
    batch: int
    seq: int
    leaves: tuple  # PlannedLeaf of a one-device plan: paths, shapes, kinds, logical axes
    param_bytes: int
    optimizer_bytes: int

    @classmethod
    def of(cls, model: Any, *, batch: int, seq: int) -> Subject:
        plan = Plan("dp", devices=jax.devices()[:1], annotations=model.annotations)
        abstract = plan.abstract_init(train.init_fn(model, train.adamw()), jax.random.key(0))
        size = {"param": 0, "optimizer": 0}
        for leaf in abstract.leaves:
            if leaf.kind in size:
                size[leaf.kind] += math.prod(leaf.shape) * leaf.info.dtype.itemsize
        return cls(model, batch, seq, abstract.leaves, size["param"], size["optimizer"])

    @property
    def param_count(self) -> float:
        return self.param_bytes / 4

    def model_for(self, candidate: Candidate) -> Any:
        """The model with the candidate's remat (reference models only)."""
        model = self.model
        if (
            candidate.remat is None
            or not isinstance(model, Model)
            or model.remat == candidate.remat
        ):
            return model
        return Model(dataclasses.replace(model.config, remat=candidate.remat), name=model.name)

    def workload(self, candidate: Candidate) -> Workload:
        return Workload.of_model(
            self.model_for(candidate), batch=self.batch, seq=self.seq, precision=candidate.precision
        )


@dataclasses.dataclass(frozen=True)
class Pruned:
    """Why a candidate was dropped before compiling."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Analytic:
    """The analytic model's memory per device and wire bytes per step."""

    memory: float
    state: float  # parameters + gradients + optimizer state
    wire: float
    #: the pre-compile estimate's total per device (``sk.estimate``), where the model
    #: declares its dims and the estimator covers the layout; else ``None``
    estimated: float | None = None
    #: an MoE model's expert state per device and its dispatch's all-to-all bytes, in
    #: words (why expert parallelism wins or loses); ``None`` for a dense model
    experts: str | None = None
    #: the wire bytes by term (``weight all-gathers``, ``pipeline transfers``, ...), which
    #: tell the mesh axes, and so the links, each moves over
    wire_terms: tuple[tuple[str, float], ...] = ()

    @property
    def ranking_memory(self) -> float:
        """The estimate where there is one, else the analytic memory."""
        return self.memory if self.estimated is None else self.estimated


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the compiled program of one candidate says (per device, per step).

    ``memory_terms`` splits the temp memory at its peak into the analytic model's named
    terms (``MemoryTerm.to_json``: measured bytes, analytic bytes, largest buffers) and
    ``explanations`` says why each term, and the total, is off its analytic value
    (``Explanation.to_json``): the planner's analytic memory is checked, or itemised.
    """

    memory: dict[str, int]
    flops: float | None
    # kind, wire bytes per step, first group, executions per step, devices per group
    collectives: tuple[tuple[str, float, tuple[int, ...], int, int], ...]
    memory_terms: tuple[dict, ...] = ()
    explanations: tuple[dict, ...] = ()

    @property
    def wire_bytes(self) -> float:
        return float(sum(c[1] for c in self.collectives))

    def to_json(self) -> dict:
        return {
            "memory": self.memory,
            "flops": self.flops,
            "collectives": [[c[0], c[1], list(c[2]), *c[3:]] for c in self.collectives],
            "memory_terms": list(self.memory_terms),
            "explanations": list(self.explanations),
        }

    @classmethod
    def from_json(cls, d: dict) -> Evidence:
        return cls(
            d["memory"],
            d["flops"],
            tuple(
                (k, w, tuple(g), *(rest or (1, len(g) or 1))) for k, w, g, *rest in d["collectives"]
            ),
            tuple(d.get("memory_terms", ())),
            tuple(d.get("explanations", ())),
        )


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]


def prune(subject: Subject, candidate: Candidate, *, budget: float) -> Pruned | Analytic:
    """:class:`Pruned` with the reason, or the candidate's :class:`Analytic` costs."""
    recipe = candidate.recipe_object()
    mesh = candidate.mesh_sizes
    stages = mesh.get("stage")
    if stages and candidate.microbatches is None:
        return Pruned(
            f"batch {subject.batch} does not split into {stages}, {2 * stages} or "
            f"{4 * stages} micro-batches per data replica"
        )
    dims = subject.model.dims
    sizes = [int(mesh.get(a, 1)) for a in recipe.context_axes]
    ring = sizes[-1]
    zigzag = (
        recipe.attention in ("ring", "usp")
        or recipe.layer_schedule == "tsp"
        or recipe.balance == "zigzag"
    )
    chunks = math.lcm(math.prod(sizes), 2 * ring) if zigzag and ring > 1 else math.prod(sizes)
    if chunks > 1 and subject.seq % chunks:
        return Pruned(
            f"attention over {recipe.attention_axis}={'×'.join(map(str, sizes))} cuts each "
            f"sequence into {chunks} {'zigzag ' if zigzag and ring > 1 else ''}chunks; "
            f"sequence {subject.seq} does not divide"
        )
    v = candidate.virtual_stages
    if stages and dims is not None and dims.layers % (stages * v):
        chunks = f" × {v} chunks ({candidate.schedule})" if v > 1 else ""
        return Pruned(f"{dims.layers} layers do not split into {stages} stages{chunks}")
    if stages and candidate.schedule is not None:
        try:  # the table the roofline counts the ticks of, built (and cached) here
            schedule_ticks(stages, candidate.microbatches, candidate.schedule, v)
        except PipelineError as e:
            return Pruned(str(e).split("\n")[0])
    split = 0.0  # the non-layer parameters' bytes split over tensor (a 3D pipeline's tables)
    try:
        if recipe.attention == "ulysses" and ring > 1 and dims is not None:
            check_heads(dims.n_heads, dims.n_kv_heads, ring, recipe.attention_axis)
        if recipe.attention == "usp" and dims is not None and min(sizes) > 1:
            check_usp(subject.seq, dims.n_heads, dims.n_kv_heads, recipe.context_axes, sizes)
        for leaf in subject.leaves:
            rules = recipe.rules
            if leaf.kind == "optimizer" and recipe.optimizer_rules is not None:
                rules = recipe.optimizer_rules
            if leaf.axes is not None and leaf.kind != "scalar":
                spec = rules.spec(leaf.axes, leaf.shape, mesh, path=leaf.path)
                axes = {a for e in spec for a in (e if isinstance(e, tuple) else (e,))}
                tensor = any(recipe.axis_role(a) == "tensor" for a in axes if a)
                if leaf.kind == "param" and tensor and leaf.axes[0] != "layers":
                    split += math.prod(leaf.shape) * leaf.info.dtype.itemsize
        recipe.activation_rules.spec(
            ("batch", "length"), (subject.batch, subject.seq), mesh, path="batch"
        )
        if dims is not None:  # heads are activations' dimensions too
            recipe.activation_rules.spec(
                ("batch", "length", "heads"),
                (subject.batch, subject.seq, dims.n_heads),
                mesh,
                path="attention",
            )
        extra = {}
        if stages:  # the layer stack's bytes, from the dims the model declares
            stack = 4 * dims.stack_params if dims is not None else None
            extra = {
                "pipeline": _pipeline_options(candidate),
                "stack_param_bytes": stack,
                "stack_optimizer_bytes": None if stack is None else 2 * stack,
                "tensor_rest_bytes": split,
            }
        workload = subject.workload(candidate)
        analytic = analytic_costs(
            recipe,
            mesh,
            workload=workload,
            param_bytes=subject.param_bytes,
            optimizer_bytes=subject.optimizer_bytes,
            **({"vocab_tables": dims.vocab_tables} if dims is not None else {}),
            **extra,
        )
        experts = None
        if dims is not None and dims.n_experts:  # the experts split (before the phases)
            analytic = analytic_moe.with_experts(
                analytic,
                dims,
                recipe,
                mesh,
                batch=subject.batch,
                seq=subject.seq,
                remat=workload.remat or "none",
                param_bytes=subject.param_bytes,
                optimizer_bytes=subject.optimizer_bytes,
                bytes_per_value=2 if candidate.precision == "bf16" else 4,
            )
            experts = _experts_note(subject, recipe, mesh, analytic)
        if not stages:  # a no-op unless the model's loss is shardkit's chunked head
            analytic = with_phases(analytic, dims, recipe, mesh, workload)
    except ShardingError as e:
        return Pruned(_first_line(e))
    state = analytic.memory.params + analytic.memory.grads + analytic.memory.optimizer
    if state > budget:
        return Pruned(
            f"parameters, gradients and optimizer state alone are {human_bytes(state)} "
            f"per device (analytic), over the {human_bytes(budget)} budget"
        )
    return Analytic(
        memory=float(analytic.memory.total),
        state=float(state),
        wire=float(sum(analytic.wire_bytes_by_kind.values())),
        estimated=_estimated(subject, candidate, extra.get("pipeline")),
        experts=experts,
        wire_terms=tuple((t, float(b)) for t, b in (analytic.wire_terms or {}).items() if b),
    )


def _experts_note(subject: Subject, recipe: Any, mesh: dict, analytic: Any) -> str:
    """The expert state one device holds and the dispatch's all-to-all bytes, in words."""
    dims = subject.model.dims
    split = analytic_moe.expert_split(recipe, mesh)
    per_param = (subject.param_bytes + subject.optimizer_bytes) / dims.param_count + 4
    whole = dims.layers * dims.expert_params * per_param
    a2a = analytic.wire_bytes_by_kind.get("all-to-all", 0.0)
    moved = f"{human_bytes(a2a)} of all-to-all dispatch a step" if a2a else "no all-to-all"
    return (
        f"expert state {human_bytes(whole / split)} per device (1/{split} of "
        f"{human_bytes(whole)}), {moved}"
    )


def _estimated(subject: Subject, candidate: Candidate, pipeline: Any) -> float | None:
    """The candidate's estimated total memory per device, or ``None`` where the model
    declares no dims or the estimator does not cover the layout."""
    model = subject.model_for(candidate)
    if model.dims is None:
        return None
    try:
        return estimate(
            candidate.recipe_object(),
            model,
            mesh=candidate.mesh_sizes,
            batch=subject.batch,
            seq=subject.seq,
            precision=candidate.precision,
            pipeline=pipeline,
        ).total
    except ShardingError:
        return None


def _pipeline_options(candidate: Candidate) -> dict:
    """The pipeline a candidate with a ``stage`` axis runs: the defaults, its micro-batches
    and schedule (1F1B without one). Interleaved and zbv keep the layer stack stored in
    the schedule's order (``stack_order="interleaved"``): in layer order the engine would
    move the stack between stages every step, and its gradient back."""
    schedule = candidate.schedule or PIPELINE_DEFAULTS["schedule"]
    return {
        **PIPELINE_DEFAULTS,
        "microbatches": candidate.microbatches,
        "schedule": schedule,
        "virtual_stages": candidate.virtual_stages,
        "stack_order": "interleaved" if candidate.virtual_stages > 1 else "layers",
    }


def _plan(candidate: Candidate, subject: Subject, devices: list) -> Any:
    mesh = make_mesh(
        candidate.mesh_sizes, devices=devices[: math.prod(candidate.mesh_sizes.values())]
    )
    kwargs = {"precision": candidate.precision} if candidate.precision != "f32" else {}
    return Plan(
        candidate.recipe_object(),
        mesh,
        annotations=subject.model.annotations,
        **kwargs,
    )


def compile_candidate(subject: Subject, candidate: Candidate, devices: list | None = None):
    """:class:`Evidence` from the compiled step, or :class:`Pruned` if the plan refuses it.

    Compile only, on abstract state: ``build_report`` of the candidate's plan with its
    memory itemised (XLA's buffer assignment), so the evidence carries the memory,
    FLOPs and collectives a ranking needs and the named terms that explain the gap
    between the analytic and the compiled memory.
    """
    devices = devices if devices is not None else jax.devices()
    pipeline = _pipeline_options(candidate) if candidate.microbatches is not None else None
    try:
        plan = _plan(candidate, subject, devices)
        report = build_report(
            plan,
            model=subject.model_for(candidate),
            batch=subject.batch,
            seq=subject.seq,
            pipeline=pipeline,
            itemise=True,
        )
    except ShardingError as e:
        return Pruned(_first_line(e))
    return Evidence(
        memory=report.memory.to_dict(),
        flops=report.flops,
        collectives=tuple(
            (c.kind, float(c.wire_bytes), c.group, c.count, c.group_size)
            for c in report.collectives
        ),
        memory_terms=tuple(t.to_json() for t in report.memory_terms),
        explanations=tuple(
            e.to_json() for e in report.explanations if e.term not in WIRE_TERMS
        ),  # memory's only
    )
