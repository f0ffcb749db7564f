"""Stages.post_grad of the reference models: the head's loss and gradients, added in place.

The reference is JAX's own: ``jax.value_and_grad`` of the stages' ``post`` (the same
operations as ``model.loss``, checked in tests/parallel/test_pipeline.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import train
from shardkit.models import get
from shardkit.train import token_batch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_reference_post_grad_is_posts_gradient_added_to_the_sum(name, dtype):
    model = get(name, n_layers=2, dtype=dtype)
    stages = model.stages()
    _, rest = stages.split(sk.unbox(jax.jit(model.init)(jax.random.key(0))))
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    y = jax.random.normal(k1, (2, 8, model.config.d_model)).astype(dtype)
    mb = {"targets": jax.random.randint(k2, (2, 8), 0, model.config.vocab)}
    leaves, treedef = jax.tree.flatten(rest)
    running = jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(jax.random.split(k3, len(leaves)), leaves, strict=True)
        ],
    )
    scale = 0.25

    def post(rest, y):
        return stages.post(rest, y, mb) * scale

    want, (d_rest, d_y) = jax.jit(jax.value_and_grad(post, argnums=(0, 1)))(rest, y)
    loss, summed, dy = jax.jit(stages.post_grad)(rest, y, mb, running, scale)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(float(loss), float(want), rtol=tol)
    assert dy.dtype == d_y.dtype == dtype
    top = float(jnp.abs(d_y.astype(jnp.float32)).max())
    np.testing.assert_allclose(
        np.asarray(dy, np.float32), np.asarray(d_y, np.float32), rtol=0, atol=tol * top
    )
    assert jax.tree.structure(summed) == jax.tree.structure(running)
    for got, base, grad in zip(
        jax.tree.leaves(summed), jax.tree.leaves(running), jax.tree.leaves(d_rest), strict=True
    ):
        assert got.dtype == base.dtype
        top = float(jnp.abs(grad).max())
        np.testing.assert_allclose(got, base + grad, rtol=0, atol=tol * top + 1e-6)


@pytest.mark.filterwarnings("ignore::shardkit.ShardingWarning")  # pp replicates the rest
def test_pipeline_last_stage_holds_the_head_gradient_once():
    # gpt-tiny with a large (tied) vocabulary, so the head's tick is the step's peak:
    # without post_grad the engine runs value_and_grad(post) and adds, and XLA holds the
    # new vocab × d gradient next to the running sum; with it, slices are added in place.
    model = get("gpt-tiny", vocab=8192, n_layers=2)
    grad_bytes = model.config.vocab * model.config.d_model * 4  # 2 MiB
    plan = sk.Plan("pp", devices=jax.devices()[:2])
    tx = train.adamw()
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    stages = model.stages()

    def temp(stages):
        pipeline = {"microbatches": 2, "schedule": "1f1b"}
        step = train.train_step(stages, tx, plan=plan, abstract=abstract, pipeline=pipeline)
        lowered = plan.jit(step, state=abstract).lower(abstract, token_batch(4, 16))
        return lowered.compile().memory_analysis().temp_size_in_bytes

    generic = temp(dataclasses.replace(stages, post_grad=None))
    assert generic - temp(stages) >= grad_bytes  # measured 6.89 -> 4.57 MiB
