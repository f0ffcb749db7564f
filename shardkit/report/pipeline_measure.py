"""Measure a model's pipelined step against :mod:`shardkit.report.pipeline_analytic`.

Compile only (abstract state and batch): memory per device from ``memory_analysis()``
(arguments + output + temp − alias), wire bytes by kind from
:func:`shardkit.report.hlo.parse_collectives`, FLOPs from XLA's cost analysis with each
loop weighted by its trip count (:func:`shardkit.report.flops.compiled_flops`), next to the
analytic bubble, collective-permute and ZeroPP bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from shardkit import train
from shardkit.report.flops import compiled_flops
from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind
from shardkit.report.pipeline_analytic import PipelineCosts, pipeline_costs

__all__ = ["PipelineMeasurement", "measure", "useful_flops"]


@dataclasses.dataclass(frozen=True)
class PipelineMeasurement:
    """A compiled pipelined step's costs per device, and the analytic ones."""

    memory: dict[str, int]
    wire_bytes_by_kind: dict[str, float]
    flops: float
    analytic: PipelineCosts

    def ratio(self, kind: str) -> float:
        """Measured / analytic wire bytes of one collective kind (``nan`` if none expected)."""
        want = self.analytic.wire_bytes_by_kind.get(kind, 0.0)
        return self.wire_bytes_by_kind.get(kind, 0.0) / want if want else float("nan")


def _step_and_abstract(plan: Any, model: Any, tx: Any, *, seed: int = 0, **opts: Any):
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(seed))
    step = train.train_step(model, tx, plan=plan, abstract=abstract, pipeline=opts)
    return step, abstract


def measure(
    plan: Any,
    model: Any,
    tx: Any,
    *,
    batch: int,
    seq: int,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    unit: int | None = None,
    stack_order: str = "layers",
    rolled: bool = True,
) -> PipelineMeasurement:
    """Compile the pipelined step of ``model`` under ``plan`` and read its costs
    (``stack_order="interleaved"``: the abstract state taken as stored in that order)."""
    step, abstract = _step_and_abstract(
        plan,
        model,
        tx,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        unit=unit,
        stack_order=stack_order,
        rolled=rolled,
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)
    batch_ = {"inputs": tokens, "targets": tokens}
    compiled = plan.jit(step, state=abstract).lower(abstract, batch_).compile()
    ma = compiled.memory_analysis()
    memory = {
        "arguments": ma.argument_size_in_bytes,
        "output": ma.output_size_in_bytes,
        "temp": ma.temp_size_in_bytes,
        "alias": ma.alias_size_in_bytes,
    }
    memory["total"] = memory["arguments"] + memory["output"] + memory["temp"] - memory["alias"]
    flops = compiled_flops(compiled)
    wire = wire_bytes_by_kind(parse_collectives(compiled.as_text()))
    return PipelineMeasurement(
        memory,
        wire,
        flops.flops if flops is not None else float("nan"),
        _analytic_for(
            plan,
            model,
            batch=batch,
            seq=seq,
            microbatches=microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            unit=unit,
        ),
    )


def _analytic_for(
    plan: Any,
    model: Any,
    *,
    batch: int,
    seq: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int = 1,
    unit: int | None = None,
    bytes_per_value: int = 4,
) -> PipelineCosts:
    """:func:`pipeline_costs` for a model's declared dims under ``plan``'s mesh."""
    dims = model.dims
    shape = dict(plan.mesh.shape)
    p, fsdp, data = shape.get("stage", 1), shape.get("fsdp", 1), shape.get("data", 1)
    stack = dims.stack_params * bytes_per_value
    rest = dims.param_count * bytes_per_value - stack
    rows = batch // (microbatches * fsdp * data)
    return pipeline_costs(
        schedule,
        stages=p,
        microbatches=microbatches,
        virtual=virtual_stages,
        unit=unit,
        fsdp=fsdp,
        data=data,
        stack_param_bytes=stack,
        rest_param_bytes=rest,
        activation_bytes=rows * seq * dims.d_model * bytes_per_value,
    )


def useful_flops(model: Any, *, batch: int, seq: int, stages: int, devices: int) -> float:
    """``6·Ψ_stack·tokens/p`` per device of the layer stack (``tokens`` split over replicas)."""
    replicas = devices // stages
    return 6.0 * model.dims.stack_params * batch * seq / replicas / stages
