"""``Report``: what each device holds, what crosses the wire, against the analytic limit.

Built from a compiled step (:func:`shardkit.report.build_report`): the per-leaf
table from the plan, memory from ``compiled.memory_analysis()``, collectives from
the optimized HLO, FLOPs from XLA's cost analysis with loops weighted by their trip
counts (:mod:`shardkit.report.flops`), the analytic model of the recipe
for the step's :class:`~shardkit.workload.Workload`, and lint warnings. A ``Report``
is data; it renders itself (``print(report)``, rich's ``console.print(report)``,
``report.to_json()``) through :mod:`shardkit.report.render`.

Example:
  >>> import jax, shardkit as sk
  >>> report = sk.report.build_report(sk.Plan("fsdp"), model=sk.models.get("gpt-tiny"), batch=8, seq=32)
  >>> report.mesh, report.replicated_fraction < 0.05, report.workload.seq
  ({'fsdp': 8}, True, 32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import NamedSharding

from shardkit.dims import ModelDims
from shardkit.dtypes import dtype_name, itemsize
from shardkit.errors import ShardingError
from shardkit.report import analytic_mla, analytic_moe, lint, memory_terms, wire_terms
from shardkit.report.analytic import AnalyticModel, analytic_costs, with_phases
from shardkit.report.buffers import BufferAssignment
from shardkit.report.estimator import Estimate, against, estimate_or_refusal
from shardkit.report.flops import compiled_flops
from shardkit.report.formulas import activation_bytes
from shardkit.report.hlo import Collective, collectives_of, wire_bytes_by_kind
from shardkit.report.memory import MemoryStats, memory_per_device
from shardkit.report.records import (
    TOLERANCE,
    CollectiveGroup,
    Explanation,
    MemoryTerm,
    ParamRow,
    WireTerm,
)
from shardkit.report.render import report_renderables, to_text
from shardkit.rules import entry_axes
from shardkit.workload import Workload

__all__ = ["Report", "param_rows", "read_compiled"]


#: What the analytic phase model leaves out, by the phase that sets the peak (measured on
#: gpt-small and llama-small; see docs/explain/limits.md).
_PHASE_WHY = {
    "layers": "the layer being recomputed in the backward pass holds XLA's f32 temporaries "
    "(about 20 buffers of b·s·h under tensor parallelism, and attention scores), which the "
    "analytic model counts with Megatron's 16-bit constants; XLA's buffer assignment, not "
    "the layout, sets them",
    "head_loss": "the head's f32 softmax scratch and its layout copies are not modelled",
    "optimizer_step": "XLA's CPU all-reduce writes each reduced gradient to a new buffer",
}


@dataclasses.dataclass(frozen=True)
class Report:
    """Measured costs of one compiled layout, next to the analytic model."""

    recipe: str
    mesh: dict[str, int]
    params: tuple[ParamRow, ...]
    memory: MemoryStats
    collectives: tuple[Collective, ...]
    flops: float | None
    analytic: AnalyticModel | None
    warnings: tuple[str, ...]
    workload: Workload | None = None
    explanations: tuple[Explanation, ...] = ()
    #: the recipe's logits layout (``Recipe.logits``): with ``recipe``, mesh and workload,
    #: what reproduces the layout.
    logits: str = "auto"
    memory_terms: tuple[MemoryTerm, ...] = ()
    memory_peak_phase: str | None = None
    #: the wire bytes by term against their analytic values (shardkit.report.wire_terms)
    wire_terms: tuple[WireTerm, ...] = ()
    #: the pre-compile estimate of this layout (``sk.estimate``), where the report knows
    #: the model's dims and the estimator covers the layout
    estimate: Estimate | None = None
    #: every layer's K/V latent per device, for a model with latent attention (analytic,
    #: :func:`shardkit.report.analytic_mla.latent_bytes`: the heads' layout keeps it whole
    #: on every tensor rank, ``Recipe.with_latent("split")`` splits it)
    kv_latent_bytes: float | None = None

    def estimate_vs_compiled(self, tolerance: float = 0.10) -> dict[str, Any] | None:
        """The estimate next to the compiled memory (and its itemised terms), and the
        terms off by more than ``tolerance``
        (:func:`shardkit.report.estimator.against`)."""
        if self.estimate is None:
            return None
        m = self.memory
        terms = {t.term: t.bytes for t in self.memory_terms} or None
        compiled = {"arguments": m.arguments, "temp": m.temp, "total": m.total}
        return against(self.estimate, compiled, terms, tolerance=tolerance)

    @property
    def replicated_fraction(self) -> float:
        """Share of parameter bytes (not optimizer state) stored whole on every device."""
        rows = [r for r in self.params if r.kind == "param"]
        full = sum(_full_bytes(r) for r in rows)
        return sum(_full_bytes(r) for r in rows if r.replicated) / full if full else 0.0

    @property
    def wire_bytes_by_kind(self) -> dict[str, float]:
        return wire_bytes_by_kind(list(self.collectives))

    @property
    def wire_bytes(self) -> float:
        return float(sum(self.wire_bytes_by_kind.values()))

    def ratios(self) -> dict[str, float]:
        """measured / analytic for state memory (params + optimizer) and wire bytes."""
        if self.analytic is None:
            return {}
        a = self.analytic
        out = {"state_memory": self.memory.arguments / (a.memory.params + a.memory.optimizer)}
        analytic_wire = sum(a.wire_bytes_by_kind.values())
        if analytic_wire:
            out["wire_bytes"] = self.wire_bytes / analytic_wire
        return out

    def collective_groups(self) -> list[CollectiveGroup]:
        """Collectives grouped by cause (kind, pass, model path, source line, block),
        largest first."""
        groups: dict[tuple[str, ...], list[Collective]] = {}
        for c in self.collectives:
            key = (c.kind + ("*" if c.lowered_as else ""), c.pass_, c.where, c.source, c.block)
            groups.setdefault(key, []).append(c)
        rows = [
            CollectiveGroup(
                kind=k[0],
                pass_=k[1],
                where=k[2],
                source=k[3],
                block=k[4],
                ops=len(cs),
                executions=sum(c.count for c in cs),
                wire_bytes=sum(c.wire_bytes for c in cs),
            )
            for k, cs in groups.items()
        ]
        return sorted(rows, key=lambda g: -g.wire_bytes)

    def to_json(self) -> dict[str, Any]:
        """The schema ``shardkit report --json`` prints."""
        analytic = self.analytic
        term = {id(c): t.term for t in self.wire_terms for c in t.collectives}
        return {
            "recipe": self.recipe,
            "logits": self.logits,
            "mesh": self.mesh,
            "devices": math.prod(self.mesh.values()),
            "workload": self.workload.to_json() if self.workload else None,
            "memory_per_device_bytes": self.memory.to_dict(),
            "analytic_memory_per_device_bytes": analytic.memory.to_dict() if analytic else None,
            "collectives": [
                {
                    "kind": c.kind,
                    "bytes": c.bytes,
                    "wire_bytes": c.wire_bytes,
                    "group_size": c.group_size,
                    "count": c.count,
                    "op_name": c.op_name,
                    "lowered_as": c.lowered_as,
                    "module_path": c.module_path,
                    "pass": c.pass_,
                    "source": c.source,
                    "block": c.block,
                    "function": c.function,
                    "dtype": c.dtype,
                    "shape": list(c.shape),
                    "shapes": [list(x) for x in c.shapes],
                    "logical": list(c.logical),
                    "rule": c.rule,
                    "term": term.get(id(c), ""),
                }
                for c in self.collectives
            ],
            "wire_terms": [t.to_json() for t in self.wire_terms],
            "wire_bytes_by_kind": self.wire_bytes_by_kind,
            "analytic_wire_bytes_by_kind": analytic.wire_bytes_by_kind if analytic else None,
            "ratios": self.ratios(),
            "params": [r.to_json() for r in self.params],
            "replicated_fraction": self.replicated_fraction,
            "warnings": list(self.warnings),
            "explanations": [e.to_json() for e in self.explanations],
            "memory_terms": [t.to_json() for t in self.memory_terms],
            "memory_peak_phase": self.memory_peak_phase,
            "estimate": self.estimate.to_json() if self.estimate else None,
            "kv_latent_bytes": self.kv_latent_bytes,
            "estimate_vs_compiled": self.estimate_vs_compiled(),
            "flops": self.flops,
        }

    def __rich_console__(self, console: Any, options: Any):
        yield from report_renderables(self, width=options.max_width)

    def __str__(self) -> str:
        return to_text(self)


def _full_bytes(row: ParamRow) -> int:
    return math.prod(row.shape) * itemsize(row.dtype)


def param_rows(plan: Any, state: Any) -> list[ParamRow]:
    """One ``ParamRow`` per leaf of ``state`` under ``plan`` (no compile needed)."""
    rows = []
    for leaf in plan.leaves(state):
        info = leaf.info
        shard = NamedSharding(plan.mesh, leaf.spec).shard_shape(info.shape)
        kind = info.kind
        rows.append(
            ParamRow(
                path=info.path,
                shape=info.shape,
                dtype=dtype_name(info.dtype),
                logical=tuple(info.axes),
                spec=str(leaf.spec),
                bytes_per_device=math.prod(shard) * itemsize(info.dtype),
                replicated=all(e is None for e in leaf.spec),
                kind=kind,
                shard_shape=tuple(shard),
                mesh_axes=_mesh_axes(leaf.spec, len(info.shape)),
                prefix=info.prefix,
            )
        )
    return rows


def _mesh_axes(spec: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes of a ``PartitionSpec`` entry (``()`` for ``None``)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return tuple(entry_axes(e) for e in entries[:ndim])


def _compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device with each while loop weighted by its trip count
    (:func:`shardkit.report.flops.compiled_flops`; ``cost_analysis()`` counts a body once)."""
    got = compiled_flops(compiled)
    return got.flops if got is not None and got.flops >= 0 else None


def read_compiled(
    plan: Any,
    compiled: Any,
    state: Any,
    *,
    workload: Workload | None = None,
    dims: ModelDims | None = None,
    replicated_threshold_bytes: int = 1 << 20,
    replicated_threshold_share: float = 1e-3,
    pipeline: Any = None,
    buffers: BufferAssignment | None = None,
) -> Report:
    """A ``Report`` of ``compiled`` (a step compiled under ``plan``) for ``state``; what
    :func:`shardkit.report.build_report` reads once it has compiled.

    Args:
      plan: the ``sk.Plan`` the step was compiled under.
      compiled: ``plan.compile(...)`` (or ``plan.jit(step).lower(...).compile()``).
      state: an ``AbstractState`` (``plan.abstract_init``), the annotated tree
        (``jax.eval_shape(init_fn, key)``), or arrays whose logical axes the plan knows.
      workload: the step's sizes; enables the analytic model (state and data-parallel
        terms from the batch alone; activation terms with the model's dimensions).
      dims: the model's dimensions (:class:`~shardkit.dims.ModelDims`), for a model whose
        loss is shardkit's chunked head: with ``workload`` they add the analytic peak of
        each phase of the step.
      replicated_threshold_bytes, replicated_threshold_share: warn about replicated
        parameters at least this big, in bytes and as a share of all parameter bytes.
        Gradients all-reduced more than once are checked for parameters over
        ``replicated_threshold_bytes``.
      pipeline: a pipelined step's options (``{"microbatches": m, "schedule": ...}``, what
        a ``PipelinedStep`` carries as ``step.options``; ``build_report`` reads it):
        the analytic model of a recipe with a ``stage`` axis counts the stage's share.
      buffers: the step's buffer assignment
        (:func:`shardkit.report.buffers.compile_with_buffers`): the temp memory at its
        peak is split into named terms (``Report.memory_terms``), and each term off by
        more than 10 % from its analytic value gets an explanation.
    """
    rows = param_rows(plan, state)
    collectives = tuple(wire_terms.attach_layouts(collectives_of(compiled), rows))
    recipe = plan.recipe
    mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    analytic, notes = None, []
    if workload is not None:
        full = {k: sum(_full_bytes(r) for r in rows if r.kind == k) for k in ("param", "optimizer")}
        stack = {
            k: sum(_full_bytes(r) for r in rows if r.kind == k and r.logical[:1] == ("layers",))
            for k in ("param", "optimizer")
        }
        # the non-layer parameters split over a tensor axis (a pipeline's vocab-parallel
        # tables), the axis's role read from the recipe's rules
        split = sum(
            _full_bytes(r)
            for r in rows
            if r.kind == "param"
            and r.logical[:1] != ("layers",)
            and any(recipe.axis_role(a) == "tensor" for e in r.mesh_axes for a in e)
        )
        try:
            analytic = analytic_costs(
                recipe,
                mesh,
                workload=workload,
                param_bytes=full["param"],
                optimizer_bytes=full["optimizer"],
                pipeline=pipeline,
                stack_param_bytes=stack["param"],
                stack_optimizer_bytes=stack["optimizer"],
                tensor_rest_bytes=split,
                # the vocabulary tables among the parameters: 1 tied (GPT), 2 untied
                **({"vocab_tables": dims.vocab_tables} if dims is not None else {}),
            )
            if dims is not None and dims.n_experts:  # before the phases: their state
                analytic = analytic_moe.with_experts(
                    analytic,
                    dims,
                    recipe,
                    mesh,
                    batch=workload.batch,
                    seq=workload.seq or 0,
                    remat=workload.remat or "none",
                    param_bytes=full["param"],
                    optimizer_bytes=full["optimizer"],
                    bytes_per_value=2 if workload.precision == "bf16" else 4,
                )
            if dims is not None:  # a chunked head: the step's phases set the total
                analytic = with_phases(analytic, dims, recipe, mesh, workload)
        except ShardingError as e:  # a layout the analytic model does not cover
            notes.append(f"no analytic model: {' '.join(str(e).split())}")
    logical_names = {n for r in rows for n in r.logical if n}
    shards_params = bool(recipe.rules.mesh_axis_names)
    warnings = [
        *notes,
        *lint.unexpected_collectives(collectives, recipe.collectives, recipe.name, rows),
        *lint.unused_rules(recipe.rules, logical_names | recipe.optional_names),
    ]
    warnings += lint.grows_with_devices(recipe, mesh, workload, collectives)
    warnings += lint.reduced_more_than_once(
        collectives, rows, devices=math.prod(mesh.values()), min_bytes=replicated_threshold_bytes
    )
    if shards_params:
        total = sum(_full_bytes(r) for r in rows if r.kind == "param")
        threshold = max(replicated_threshold_bytes, replicated_threshold_share * total)
        warnings += lint.replicated_params(rows, recipe.name, min_bytes=threshold)
    explanations = _explain_memory(memory_per_device(compiled), analytic)
    wire = wire_terms.attribute(
        collectives,
        rows,
        stages=mesh.get("stage", 1),
        analytic=analytic.wire_terms if analytic else None,
    )
    if analytic is not None and analytic.wire_terms:
        explanations += wire_terms.explain(wire, rows)
    guess = None
    if dims is not None and workload is not None and workload.seq:
        guess, refusal = estimate_or_refusal(recipe, dims, mesh, workload, pipeline)
        warnings += [refusal] if refusal else []
    latent = None
    if dims is not None and dims.kv_latent and workload is not None and workload.seq:
        latent = analytic_mla.latent_bytes(
            dims,
            recipe,
            mesh,
            batch=workload.batch,
            seq=workload.seq,
            itemsize=activation_bytes(workload.precision),
        )
    terms: list[MemoryTerm] = []
    phase = None
    if buffers is not None:
        terms, why, phase = _itemise(buffers, compiled, rows, recipe, mesh, workload, dims)
        explanations += why
    return Report(
        recipe=recipe.name,
        mesh=mesh,
        params=tuple(rows),
        memory=memory_per_device(compiled),
        collectives=collectives,
        flops=_compiled_flops(compiled),
        analytic=analytic,
        warnings=tuple(warnings),
        workload=workload,
        explanations=tuple(explanations),
        memory_terms=tuple(terms),
        memory_peak_phase=phase,
        estimate=guess,
        kv_latent_bytes=latent,
        logits=recipe.logits,
        wire_terms=tuple(wire),
    )


def _itemise(buffers, compiled, rows, recipe, mesh, workload, dims):
    """(memory terms, their explanations, the peak's phase) of the temp memory at its peak."""
    par = recipe.parallelism(mesh)
    seq = set()
    if workload is not None and workload.seq:  # whole, and split by sequence or TSP axes
        seq = {workload.seq, workload.seq // par.sequence, workload.seq // max(par.tsp, 1)}
    phase = memory_terms.peak_phase_of(buffers)
    analytic = {}
    if dims is not None and workload is not None and workload.seq:
        try:
            analytic = memory_terms.analytic_terms(
                dims,
                recipe,
                mesh,
                batch=workload.batch,
                seq=workload.seq,
                phase=phase,
                remat=workload.remat or "none",
            )
        except ShardingError:  # a layout the analytic model does not cover
            analytic = {}
    terms = memory_terms.attribute(buffers, rows, seq=seq, analytic=analytic)
    # Without an analytic model (a pipelined step: the phase model knows no pipelines)
    # every term is unmodelled, and each still gets its line: what is live, and why not.
    return terms, memory_terms.explain(terms, phase), phase


def _explain_memory(memory: MemoryStats, analytic: AnalyticModel | None) -> list[Explanation]:
    """The total's gap to the analytic phase peak, with the phase and what it leaves out."""
    if analytic is None or not analytic.memory.phases:
        return []
    phases = analytic.memory.phases
    peak = max(phases, key=lambda k: phases[k])
    want = analytic.memory.total
    if abs(memory.total / want - 1) <= TOLERANCE:
        return []
    over = memory.total > want
    why = f"the peak is the {peak} phase ({want / 2**20:,.1f} MiB analytic); " + (
        _PHASE_WHY.get(peak, "")
        if over
        else "XLA reuses buffers the analytic model counts as live at once"
    )
    return [Explanation("memory total", float(memory.total), float(want), why)]
