"""The pipeline engine manual over ``stage`` and ``data`` only, ``tensor`` left to XLA.

A Megatron pair of layers (column- then row-parallel) per layer, its kernels sharded over
``tensor``: the loss and gradients equal one device's (``jax.value_and_grad`` layer by
layer), each device holds ``1/(p·T)`` of the stack, and no weight is ever all-gathered.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.parallel import PipelineError, pipeline
from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind

H, LAYERS, ROWS, M = 32, 4, 16, 4
SPECS = {"a": P("stage", None, "tensor"), "b": P("stage", "tensor", None)}


def layer(w, x):
    return jnp.tanh(x @ w["a"]) @ w["b"]


def pre(rest, mb):
    return mb["x"]


def post(rest, y, mb):
    return jnp.mean((y - mb["x"]) ** 2)


def megatron_pipeline(layer_fn, mesh):
    """1F1B over ``stage``, ``data`` splitting the batch, ``tensor`` left to XLA."""
    return pipeline.mesh_value_and_grad(
        layer_fn,
        pre,
        post,
        mesh=mesh,
        microbatches=M,
        schedule="1f1b",
        stack_specs=SPECS,
        batch_axes=("data",),
        auto_axes=("tensor",),
    )


def test_tensor_axis_left_to_xla_is_exact_and_sharded():
    mesh = sk.make_mesh({"stage": 2, "tensor": 2, "data": 2}, devices=jax.devices()[:8])
    k = jax.random.split(jax.random.key(0), 3)
    stack = {
        "a": jax.random.normal(k[0], (LAYERS, H, 4 * H)) / 8,
        "b": jax.random.normal(k[1], (LAYERS, 4 * H, H)) / 16,
    }
    batch = {"x": jax.random.normal(k[2], (ROWS, H))}

    def reference(stack):
        x = batch["x"]
        for i in range(LAYERS):
            x = layer({n: w[i] for n, w in stack.items()}, x)
        return post({}, x, batch)

    want, want_g = jax.value_and_grad(reference)(stack)
    fn = megatron_pipeline(layer, mesh)
    stack = {n: jax.device_put(w, NamedSharding(mesh, SPECS[n])) for n, w in stack.items()}
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    compiled = jax.jit(fn).lower(stack, {}, batch).compile()
    loss, (grads, _) = compiled(stack, {}, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for n in stack:
        np.testing.assert_allclose(grads[n], want_g[n], rtol=0, atol=1e-6)
        # the gradient keeps its tensor shards
        assert grads[n].sharding.is_equivalent_to(NamedSharding(mesh, SPECS[n]), 3)
    stack_bytes = sum(w.size for w in stack.values()) * 4
    batch_bytes = ROWS * H * 4 // 2
    # Arguments: 1/(p·T) of the stack (the engine gathers nothing over tensor) + the batch.
    assert compiled.memory_analysis().argument_size_in_bytes == stack_bytes // 4 + batch_bytes
    wire = wire_bytes_by_kind(parse_collectives(compiled.as_text()))
    assert "all-gather" not in wire  # no weight gathered; Megatron's pair needs none


def test_auto_axes_must_be_neither_stage_nor_batch():
    mesh = sk.make_mesh({"stage": 2, "tensor": 2}, devices=jax.devices()[:4])
    for bad in (("stage",), ("sequence",)):
        with pytest.raises(PipelineError, match=r"cannot be left to XLA(.|\n)*Fix"):
            pipeline.mesh_value_and_grad(layer, pre, post, mesh=mesh, microbatches=2, auto_axes=bad)
    with pytest.raises(PipelineError, match="batch axes"):
        pipeline.mesh_value_and_grad(
            layer,
            pre,
            post,
            mesh=mesh,
            microbatches=2,
            batch_axes=("tensor",),
            auto_axes=("tensor",),
        )


def test_rules_inside_the_stages_drop_the_manual_axes():
    from shardkit.parallel.pipeline import _auto_rules
    from shardkit.recipes.recipe import VocabRules

    manual = frozenset({"stage", "data", "fsdp"})
    rules = sk.Rules(
        [
            ("batch", "data"),
            ("embed", "fsdp"),
            ("embed", "tensor"),
            ("length", ("data", "tensor")),
            ("layers", "stage"),
        ]
    )
    got = _auto_rules(rules, manual)
    # batch and layers: only manual axes, replicated; embed: the later tensor rule applies;
    # length: its tensor part stays.
    assert got == sk.Rules(
        [("embed", "tensor"), ("length", "tensor"), ("batch", None), ("layers", None)]
    )
    assert got.spec(("batch", "length")) == P(None, "tensor")
    vocab = VocabRules(
        sk.Rules([("vocab", "tensor"), ("batch", "data")]),
        sk.Rules([("batch", "data")]),
        gathered=8,
    )
    got = _auto_rules(vocab, manual)
    assert isinstance(got, VocabRules) and got.gathered == 8
    assert got.spec(("batch", "vocab"), shape=(4, 16)) == P(None, "tensor")
    assert got.spec(("batch", "vocab"), shape=(4, 4)) == P(None, None)


def test_pipeline_recipes_leave_only_tensor_to_xla():
    from shardkit import models, parallel, train

    model, tx = models.get("gpt-tiny", n_layers=4), train.adamw()
    want = {"pp": (2, ()), "dp_pp": (8, ()), "zeropp": (8, ()), "dp_tp_sp_pp": (8, ("tensor",))}
    for recipe, (devices, auto) in want.items():
        plan = sk.Plan(recipe, devices=jax.devices()[:devices])
        abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
        fn = parallel.pipeline_value_and_grad(model.stages(), plan, abstract, microbatches=2)
        assert fn.auto_axes == auto, recipe


def test_weights_read_through_a_constraint_are_not_kept_per_micro_batch():
    # A model under dp_tp_sp_pp constrains its weights to their tensor layout inside the
    # layer, so the vjp's residual is the constrained copy, not the weight itself. The
    # rolled engine recomputes it in the backward; kept in the ring, it cost one copy of
    # the stage's weights per micro-batch in flight (gpt-7b, 64 devices: 30.0 -> 17.0 GiB).
    # Reference: the same layer reading its weights unconstrained, whose residuals were
    # always the weights themselves. The ring here would hold 3 slots x 2 layers x 64 KiB.
    mesh = sk.make_mesh({"stage": 2, "tensor": 2, "data": 2}, devices=jax.devices()[:8])
    h = 64
    k = jax.random.split(jax.random.key(1), 3)
    stack = {
        "a": jax.random.normal(k[0], (LAYERS, h, 4 * h)) / 8,
        "b": jax.random.normal(k[1], (LAYERS, 4 * h, h)) / 16,
    }
    batch = {"x": jax.random.normal(k[2], (ROWS, h))}

    def constrained(w, x):
        w = {n: jax.lax.with_sharding_constraint(v, P(*SPECS[n][1:])) for n, v in w.items()}
        return layer(w, x)

    def compile_with(fn):
        step = megatron_pipeline(fn, mesh)
        args = (
            {n: jax.device_put(w, NamedSharding(mesh, SPECS[n])) for n, w in stack.items()},
            {},
            jax.device_put(batch, NamedSharding(mesh, P("data"))),
        )
        compiled = jax.jit(step).lower(*args).compile()
        return compiled, compiled(*args)

    plain, (loss, (grads, _)) = compile_with(layer)
    pinned, (loss_c, (grads_c, _)) = compile_with(constrained)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    for n in stack:
        np.testing.assert_allclose(grads_c[n], grads[n], rtol=0, atol=1e-6)
    ring_of_weights = 3 * (LAYERS // 2) * 2 * h * 4 * h * 4 // 2
    extra = pinned.memory_analysis().temp_size_in_bytes - plain.memory_analysis().temp_size_in_bytes
    assert extra < ring_of_weights // 4, (extra, ring_of_weights)
