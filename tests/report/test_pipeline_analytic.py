"""The analytic model of a pipelined step: per-stage state, and the report that uses it.

Expected values are hand counts (state) or the compiled program (the report test).
"""

import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit import train
from shardkit.errors import ShardingError
from shardkit.models import get
from shardkit.parallel.stages import reference_stages, train_step
from shardkit.report.analytic import analytic_costs
from shardkit.report.pipeline_analytic import in_flight
from shardkit.workload import Workload

# 1000 parameter bytes, 800 of them the layer stack; Adam's state twice that.
STATE = dict(param_bytes=1000.0, optimizer_bytes=2000.0, stack_param_bytes=800.0,
             stack_optimizer_bytes=1600.0)  # fmt: skip


@pytest.mark.parametrize(
    "recipe,mesh,params,optimizer",
    [
        ("pp", {"stage": 4}, 800 / 4 + 200, 1600 / 4 + 400),  # the rest on every stage
        ("dp_pp", {"stage": 4, "data": 2}, 800 / 4 + 200, 1600 / 4 + 400),
        ("zeropp", {"stage": 2, "fsdp": 4}, (800 / 2 + 200) / 4, (1600 / 2 + 400) / 4),
    ],
)
def test_state_per_device_is_the_stage_share(recipe, mesh, params, optimizer):
    model = analytic_costs(recipe, mesh, workload=Workload(batch=16),
                           pipeline={"microbatches": 8, "schedule": "1f1b"}, **STATE)  # fmt: skip
    assert model.memory.params == pytest.approx(params)
    assert model.memory.grads == pytest.approx(params)
    assert model.memory.optimizer == pytest.approx(optimizer)


def test_a_pipeline_recipe_without_the_pipeline_options_names_the_fix():
    with pytest.raises(ShardingError, match=r"pipeline=\{'microbatches'"):
        analytic_costs("pp", {"stage": 4}, workload=Workload(batch=16), param_bytes=1000.0,
                       optimizer_bytes=2000.0)  # fmt: skip


def test_activations_in_flight_follow_the_schedule():
    # Hand counts from the timelines: gpipe holds all m, 1f1b 2p - 1 on its first stage.
    assert [in_flight("gpipe", 4, m) for m in (4, 16)] == [4, 16]
    assert [in_flight("1f1b", 4, m) for m in (2, 4, 16, 32)] == [2, 4, 7, 7]


def test_report_of_a_pipelined_step_counts_the_stage_share():
    model, tx = get("gpt-tiny", n_layers=4), train.adamw()
    plan = sk.Plan("pp", devices=jax.devices()[:4])
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    step = train_step(reference_stages(model), tx, plan, abstract, microbatches=4)
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32) for k in ("inputs", "targets")}
    workload = Workload.from_config(model.config, batch=8, seq=16)
    report = plan.report(step, abstract, batch, workload=workload)
    # The plan's own placement: what one device holds of the parameters.
    held = sum(r.bytes_per_device for r in report.params if r.kind == "param")
    assert report.analytic.memory.params == pytest.approx(held, rel=1e-6)
    # The stage-to-stage bytes, read from the compiled program.
    measured = report.wire_bytes_by_kind["collective-permute"]
    assert report.analytic.wire_bytes_by_kind["collective-permute"] == pytest.approx(measured,
                                                                                     rel=0.1)  # fmt: skip
