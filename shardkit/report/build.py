"""``build_report``: the one way to make a :class:`~shardkit.report.Report`.

One function, three forms; each compiles under the plan (nothing runs, nothing is
allocated for abstract arguments) and reads the compiled program:

- ``build_report(plan, step, state, batch, *extra)``: a step of your own,
  ``step(state, batch, *extra) -> (new_state, ...)`` or a ``PipelinedStep``, for
  ``state`` (an ``AbstractState``, ``plan.abstract_init``) and ``batch`` (arrays or
  ``jax.ShapeDtypeStruct``\\ s), compiled as ``plan.jit`` would;
- ``build_report(plan, compiled, state)``: a step compiled already
  (``plan.jit(step).lower(state, batch).compile()``);
- ``build_report(plan, model=model, batch=8, seq=32)``: any model's AdamW train step
  (:func:`shardkit.train.train_step`, pipelined under a plan with a ``stage`` axis) on
  its abstract state and a batch of ``int32[batch, seq]`` tokens, with the model's
  workload and dimensions for the analytic model.

Example:
  >>> import shardkit as sk
  >>> r = sk.report.build_report(sk.Plan("fsdp"), model=sk.models.get("gpt-tiny"), batch=8, seq=32)
  >>> r.workload.model, r.ratios()["state_memory"] < 1.1
  ('gpt-tiny', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from shardkit import train
from shardkit.dims import ModelDims
from shardkit.errors import NotPipelinableError, ShardingError
from shardkit.parallel.cli import for_plan
from shardkit.protocol import Model
from shardkit.report.buffers import compile_with_buffers
from shardkit.report.estimator import estimate_or_refusal
from shardkit.report.report import Report, read_compiled
from shardkit.step import PipelinedStep
from shardkit.workload import Workload, dims_sizes

__all__ = ["build_report"]


def build_report(
    plan: Any,
    step: Any = None,
    state: Any = None,
    batch: Any = None,
    *extra: Any,
    model: Model | None = None,
    seq: int | None = None,
    tx: Any = None,
    seed: int = 0,
    pipeline: Mapping[str, Any] | None = None,
    workload: Workload | None = None,
    dims: ModelDims | None = None,
    itemise: bool = False,
    replicated_threshold_bytes: int = 1 << 20,
    replicated_threshold_share: float = 1e-3,
) -> Report:
    """A :class:`~shardkit.report.Report` of a step under ``plan``: compiled, then read.

    Args:
      plan: the ``sk.Plan``.
      step: the step function (or ``PipelinedStep``), or the compiled step; leave it
        out with ``model=``.
      state: the step's state: an ``AbstractState`` (``plan.abstract_init``), the
        annotated tree, or arrays whose logical axes the plan knows.
      batch: the batch the step compiles for (arrays or ``ShapeDtypeStruct``\\ s; none
        with a compiled step); with ``model=``, the global batch size (an ``int``).
      *extra: further arguments of the step, after ``(state, batch)``.
      model: a model (:class:`shardkit.protocol.Model`: ``models.get(...)``,
        ``models.load(...)``): its AdamW train step is built and reported.
      seq: with ``model=``: the sequence length.
      tx: with ``model=``: the optimizer (default :func:`shardkit.train.adamw`).
      seed: with ``model=``: the PRNG seed of the (abstract) init.
      pipeline: the pipeline's options (``{"microbatches": m, "schedule":
        "gpipe"|"1f1b"|"interleaved", "virtual_stages": v, "unit": u}``) under a plan
        with a ``stage`` axis: with ``model=``, the step to build (default 1F1B, one
        micro-batch per stage); with a compiled pipelined step, what it runs (a
        ``PipelinedStep`` brings its own, ``step.options``). The analytic model counts
        the stage's share.
      workload: the step's sizes (:class:`~shardkit.workload.Workload`) for the
        analytic model; default: the model's, else read from the batch (its leading
        dimension; the sequence from 2-D integer token arrays), with the plan's precision.
      dims: the model's dimensions (:class:`~shardkit.dims.ModelDims`) for a model
        whose loss is shardkit's chunked head: the analytic peak of each phase of the
        step (default with ``model=``: ``model.dims``, unpipelined).
      itemise: compile with XLA's buffer-assignment dump and split the temp memory at
        its peak into named terms (``Report.memory_terms``), each explained where it is
        off by more than 10 % from its analytic value.
      replicated_threshold_bytes, replicated_threshold_share: warn about replicated
        parameters at least this big, in bytes and as a share of all parameter bytes.

    Raises:
      ShardingError: a missing or contradictory argument, named with the fix; live
        state that lost its logical axes.
      NotPipelinableError: ``pipeline=`` under a plan without a ``stage`` axis.
    """
    if model is not None:
        step, state, batch, workload, dims = _model_step(
            plan, model, step, state, batch, extra, seq, tx, seed, pipeline, workload, dims
        )
        if isinstance(step, PipelinedStep):  # the options filled in (micro-batches, ...)
            pipeline = step.options
    else:
        for name, value in (("seq", seq), ("tx", tx)):
            if value is not None:
                raise ShardingError(
                    f"build_report(..., {name}=...) builds a model's step, and no model= is "
                    "given.\nFix: build_report(plan, model=model, batch=8, seq=32), or pass "
                    "your step, its state and batch: build_report(plan, step, state, batch)."
                )
        if step is None:
            raise ShardingError(
                "build_report(plan): nothing to report.\nFix: build_report(plan, step, state, "
                "batch), build_report(plan, compiled, state), or build_report(plan, "
                "model=model, batch=8, seq=32)."
            )
        if state is None:
            raise ShardingError(
                "build_report(plan, step): the state is missing.\nFix: build_report(plan, "
                "step, plan.abstract_init(init_fn, key), batch)."
            )
        if pipeline is not None and not dict(plan.mesh.shape).get("stage"):
            raise NotPipelinableError(
                f"build_report(..., pipeline={dict(pipeline)}): the analytic pipeline model "
                f"needs a plan with a 'stage' axis; recipe {plan.recipe.name!r} has "
                f"{dict(plan.mesh.shape)}.\nFix: drop pipeline=, or report a pipelined step "
                "under sk.Plan('pp' | 'dp_pp' | 'zeropp' | 'dp_tp_sp_pp', ...)."
            )
    _check_axes_known(plan, state)  # before any compile: a lost layout fails fast
    buffers = None
    if _is_compiled(step):
        if batch is not None or extra:
            raise ShardingError(
                "build_report(plan, compiled, state) takes no batch: the step is compiled already."
            )
        if itemise:
            raise ShardingError(
                "build_report(plan, compiled, state, itemise=True): the buffer assignment is "
                "read while compiling.\nFix: pass the step and its batch, "
                "build_report(plan, step, state, batch, itemise=True)."
            )
        compiled = step
    else:
        if batch is None:
            raise ShardingError(
                "build_report(plan, step, state, batch): a step needs a batch to compile.\n"
                "Fix: pass the batch (arrays or jax.ShapeDtypeStructs)."
            )
        lowered = plan.lower(step, state, batch, *extra)
        compiled, buffers = compile_with_buffers(lowered) if itemise else (lowered.compile(), None)
        if workload is None:  # the batch's sizes, and the model's where dims= declares them
            workload = Workload.of_batch(batch, plan.precision)
            if workload is not None and dims is not None:
                workload = dataclasses.replace(workload, **dims_sizes(dims))
        if pipeline is None and isinstance(step, PipelinedStep):
            pipeline = step.options  # what the pipeline's analytic model counts
    report = read_compiled(
        plan,
        compiled,
        state,
        workload=workload,
        dims=dims,
        pipeline=pipeline,
        buffers=buffers,
        replicated_threshold_bytes=replicated_threshold_bytes,
        replicated_threshold_share=replicated_threshold_share,
    )
    if model is not None and isinstance(step, PipelinedStep):
        report = _with_pipeline_estimate(report, plan, model, workload, pipeline)
    return report


def _with_pipeline_estimate(report: Report, plan, model, workload, pipeline) -> Report:
    """A pipelined model's report with the pre-compile estimate of its layout next to
    the compiled memory (the rolled engine, every schedule; the unrolled one at a layer
    a stage chunk), or the estimator's refusal among the warnings; the rest of the
    report is as it was (the model's dims are not passed on to its analytic model)."""
    model_dims = getattr(model, "dims", None)
    if not isinstance(model_dims, ModelDims) or workload is None or not workload.seq:
        return report
    mesh = dict(plan.mesh.shape)
    guess, refusal = estimate_or_refusal(plan.recipe, model_dims, mesh, workload, pipeline)
    if refusal is not None:
        return dataclasses.replace(report, warnings=(*report.warnings, refusal))
    return dataclasses.replace(report, estimate=guess)


def _model_step(plan, model, step, state, batch, extra, seq, tx, seed, pipeline, workload, dims):
    """(step, abstract state, token batch, workload, dims) of ``model``'s train step."""
    if step is not None or state is not None or extra:
        raise ShardingError(
            "build_report(plan, ..., model=...) builds the model's step and state itself.\n"
            "Fix: build_report(plan, model=model, batch=8, seq=32), or pass a step of your "
            "own without model=: build_report(plan, step, state, batch)."
        )
    sizes = {"batch": batch, "seq": seq}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool)}
    if bad or min(sizes.values()) < 1:
        raise ShardingError(
            f"build_report(plan, model=...) takes the batch and sequence sizes as positive "
            f"ints, got batch={batch!r}, seq={seq!r}.\nFix: build_report(plan, model=model, "
            "batch=8, seq=32)."
        )
    tx = train.adamw() if tx is None else tx
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(seed))
    if workload is None:
        workload = Workload.of_model(model, batch=batch, seq=seq, precision=plan.precision)
    if dict(plan.mesh.shape).get("stage"):  # a pipeline runs its own step
        options = for_plan(plan, dict(pipeline or {}))
        step = train.train_step(model, tx, plan=plan, abstract=abstract, pipeline=options)
    else:
        if pipeline is not None:
            raise NotPipelinableError(
                f"build_report(..., pipeline={dict(pipeline)}): a pipeline needs a plan with "
                f"a 'stage' axis; recipe {plan.recipe.name!r} has {dict(plan.mesh.shape)}.\n"
                "Fix: sk.Plan('pp' | 'dp_pp' | 'zeropp' | 'dp_tp_sp_pp', ...), or drop "
                "pipeline=."
            )
        step = train.train_step(model, tx)
        dims = model.dims if dims is None else dims
    return step, abstract, train.token_batch(batch, seq, plan), workload, dims


def _check_axes_known(plan: Any, state: Any) -> None:
    """Live state that lost its logical axes would report them all as ``None``."""
    lost = [
        leaf
        for leaf in plan.leaves(state)
        if leaf.info.source == "unmatched" and any(e is not None for e in leaf.spec)
    ]
    if lost:
        raise ShardingError(
            f"build_report: {len(lost)} state leaves are sharded (e.g. {lost[0].path} as "
            f"{lost[0].spec}) but carry no logical axes: plain arrays (what plan.init "
            "returns) do not keep them.\nFix: pass the abstract state, "
            "build_report(plan, step, plan.abstract_init(init_fn, key), batch), or give the "
            "plan annotations=sk.PathAxes([...]) that cover these paths."
        )


def _is_compiled(x: Any) -> bool:
    return hasattr(x, "as_text") and hasattr(x, "memory_analysis")
