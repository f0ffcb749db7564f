"""build_report, the one way to make a report: a user's step, a compiled step, a model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import models, train
from shardkit.errors import NotPipelinableError
from shardkit.report import build_report


@sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",)})
class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = sk.constrain(h, ("batch", "mlp"))
        return nn.Dense(8, use_bias=False, name="out")(h)


TX = optax.adam(1e-2)


def init(rng):
    params = Mlp().init(rng, jnp.ones((1, 16)))["params"]
    return params, TX.init(sk.unbox(params))


def step(state, batch):
    params, opt_state = state

    def loss_fn(p):
        return jnp.mean((Mlp().apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 8)).astype(np.float32),
    }


def test_report_of_a_users_step_from_abstract_or_live_state():
    plan = sk.Plan("fsdp")
    abstract = plan.abstract_init(init, jax.random.key(0))
    b = batch()
    report = build_report(plan, step, abstract, b)
    kernel = next(r for r in report.params if r.path == "0/Dense_0/kernel")
    assert kernel.logical == ("embed", "mlp") and kernel.spec == str(P("fsdp", None))
    assert report.workload.batch == 16 and report.analytic is not None
    # Regression: live state (plain arrays) used to be reported with logical (None, None).
    live = plan.init(abstract)
    with pytest.raises(sk.ShardingError, match=r"(?s)carry no logical axes.*abstract_init"):
        build_report(plan, step, live, b)
    with pytest.raises(sk.ShardingError, match="needs a batch"):
        build_report(plan, step, abstract)
    compiled = plan.jit(step).lower(abstract, b).compile()
    with pytest.raises(sk.ShardingError, match="takes no batch"):
        build_report(plan, compiled, abstract, b)
    with pytest.raises(sk.ShardingError, match=r"(?s)read while compiling.*itemise=True"):
        build_report(plan, compiled, abstract, itemise=True)


def test_a_models_report_is_its_train_step_compiled_by_hand():
    """model= builds the AdamW step, abstract state and token batch one would write."""
    plan, model = sk.Plan("fsdp"), models.get("gpt-tiny")
    r = build_report(plan, model=model, batch=8, seq=32)
    tx = train.adamw()
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 32), np.int32)
    compiled = (
        plan.jit(train.train_step(model, tx))
        .lower(abstract, {"inputs": tokens, "targets": tokens})
        .compile()
    )
    by_hand = compiled.memory_analysis()
    assert r.memory.arguments == by_hand.argument_size_in_bytes
    assert r.memory.temp == by_hand.temp_size_in_bytes
    same = build_report(plan, compiled, abstract, workload=r.workload, dims=model.dims)
    assert same.wire_bytes_by_kind == r.wire_bytes_by_kind
    assert same.analytic == r.analytic  # the model's workload and dims, as given by hand
    assert r.workload.model == "gpt-tiny" and r.workload.seq == 32


def test_a_pipeline_plan_reports_its_pipelined_step_against_the_pipeline_model():
    plan = sk.Plan("dp_pp", sk.make_mesh({"stage": 2, "data": 4}))
    r = build_report(plan, model=models.get("gpt-tiny"), batch=8, seq=32)
    # The flat step has no pipeline options, so it would have no analytic model at all;
    # the pipelined one holds half the layer stack per device and sends activations
    # between the two stages (collective-permutes), as the pipeline model says.
    assert r.analytic is not None
    assert abs(r.ratios()["state_memory"] - 1) < 0.02
    assert abs(r.ratios()["wire_bytes"] - 1) < 0.02
    assert r.wire_bytes_by_kind.get("collective-permute", 0) > 0


def test_pipeline_options_left_out_are_the_steps_defaults_in_the_analytic_model_too():
    # `shardkit report --recipe dp_pp --schedule gpipe` gives only the schedule: the step
    # runs one micro-batch per stage, and the analytic model must count that same step.
    plan = sk.Plan("dp_pp", sk.make_mesh({"stage": 2, "data": 4}))
    model = models.get("gpt-tiny")
    partial = build_report(plan, model=model, batch=8, seq=32, pipeline={"schedule": "gpipe"})
    explicit = build_report(
        plan, model=model, batch=8, seq=32, pipeline={"schedule": "gpipe", "microbatches": 2}
    )
    assert partial.analytic is not None
    assert partial.analytic.wire_bytes_by_kind == explicit.analytic.wire_bytes_by_kind
    assert partial.wire_bytes_by_kind == explicit.wire_bytes_by_kind


def test_a_users_step_with_declared_dims_gets_the_analytic_model():
    # Your own step, the model's dims declared: the same analytic figures as model= gives.
    plan = sk.Plan("fsdp", sk.make_mesh({"fsdp": 8}))
    model = models.get("gpt-tiny")
    tx = train.adamw()
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    batch = train.token_batch(8, 32, plan)
    own = build_report(plan, train.train_step(model, tx), abstract, batch, dims=model.dims)
    built = build_report(plan, model=model, batch=8, seq=32)
    assert own.analytic is not None
    assert own.analytic.wire_bytes_by_kind == built.analytic.wire_bytes_by_kind
    assert own.analytic.memory == built.analytic.memory


def test_pipeline_options_under_a_plan_without_stages_are_refused_not_ignored():
    plan = sk.Plan("dp", sk.make_mesh({"data": 8}))
    with pytest.raises(NotPipelinableError, match="'stage' axis"):
        build_report(plan, step, init(jax.random.key(0)), batch(), pipeline={"microbatches": 2})


def test_bad_arguments_name_the_form_that_fixes_them():
    plan, model = sk.Plan("dp"), models.get("gpt-tiny")
    abstract = plan.abstract_init(init, jax.random.key(0))
    with pytest.raises(sk.ShardingError, match=r"(?s)nothing to report.*model=model"):
        build_report(plan)
    with pytest.raises(sk.ShardingError, match=r"(?s)state is missing.*abstract_init"):
        build_report(plan, step)
    with pytest.raises(sk.ShardingError, match=r"(?s)seq=\.\.\.\) builds a model's step"):
        build_report(plan, step, abstract, batch(), seq=32)
    with pytest.raises(sk.ShardingError, match=r"(?s)builds the model's step and state"):
        build_report(plan, step, abstract, model=model, batch=8, seq=32)
    with pytest.raises(sk.ShardingError, match=r"positive ints, got batch=None, seq=32"):
        build_report(plan, model=model, seq=32)
    with pytest.raises(sk.ShardingError, match=r"got batch=8, seq=0"):
        build_report(plan, model=model, batch=8, seq=0)
    with pytest.raises(NotPipelinableError, match=r"(?s)'stage' axis; recipe 'dp'.*Fix"):
        build_report(plan, model=model, batch=8, seq=32, pipeline={"microbatches": 4})
