"""ZeroPP under bf16: a stage's weights gathered in the compute dtype, their gradients f32.

The gathers are read from the program shardkit hands XLA (the HLO before XLA's passes,
with each op's named scope): XLA's CPU backend widens a bfloat16 all-gather to float32
(it has no bfloat16 collectives), so the CPU-compiled program shows float32 gathers
whatever the program asks for; GPUs and TPUs gather what it asks for.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get
from shardkit.report.hlo import parse_collectives
from shardkit.train import token_batch

LAYERS, MICRO, UNIT, BATCH, SEQ, LR, STEPS = 2, 4, 2, 32, 16, 3e-3, 2


def _step(precision, model, tx, devices):
    recipe = "zeropp" if devices > 1 else "dp"  # the reference: the plain step, one device
    plan = sk.Plan(recipe, devices=jax.devices()[:devices], precision=precision)
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    if devices == 1:
        fn = train.train_step(model, tx, return_grads=True)
        return plan, abstract, plan.jit(fn)
    pipeline = dict(microbatches=MICRO, schedule="1f1b", unit=UNIT)
    fn = train.train_step(
        model, tx, plan=plan, abstract=abstract, pipeline=pipeline, return_grads=True
    )
    return plan, abstract, plan.jit(fn, state=abstract)


def _program_collectives(precision):
    """The zeropp step's collectives as the program asks for them (before XLA's passes)."""
    model, tx = get("gpt-tiny", n_layers=LAYERS), train.adamw(LR)
    _, abstract, step = _step(precision, model, tx, 8)
    lowered = step.lower(abstract.tree, token_batch(BATCH, SEQ))
    # debug_info: each op's metadata, whose named scopes tell the unit's gathers apart
    return parse_collectives(lowered.as_text("hlo", debug_info=True)), abstract


def _unit_bytes(collectives, kind="all-gather"):
    return sum(
        c.bytes * c.count for c in collectives if c.kind == kind and "pipeline.unit" in c.op_name
    )


def test_bf16_zeropp_gathers_each_unit_in_bf16_and_scatters_in_f32():
    f32, abstract = _program_collectives("f32")
    bf16, _ = _program_collectives("bf16")
    # Hand count of the f32 program: each of the ceil(m/U) units gathers the stage's
    # 1/p of the stack leaves the plan splits over fsdp (not the attention's and the
    # MLP's biases, on heads and mlp), at 4 bytes.
    gathered = sum(
        int(np.prod(leaf.shape))
        for leaf in abstract.leaves
        if leaf.path.startswith("params/layers/") and "fsdp" in str(leaf.spec)
    )
    p = 2
    assert _unit_bytes(f32) == (MICRO // UNIT) * gathered // p * 4
    # bf16: the matmul weights (what the layer reads through a cast) gathered at 2 bytes;
    # the norms' scales and biases, read in f32, stay 4 (0.4 % of the stack here).
    assert _unit_bytes(bf16) / _unit_bytes(f32) == pytest.approx(0.5, rel=0.02)
    assert {c.dtype for c in bf16 if "pipeline.unit" in c.op_name} == {"bf16", "f32"}
    # The embedding and head (gathered once per step) and the gradients' reduce-scatter
    # are as under f32.
    rest = lambda cs: sorted(  # noqa: E731
        (c.bytes, c.dtype)
        for c in cs
        if c.kind == "all-gather" and "pipeline.unit" not in c.op_name
    )
    assert rest(bf16) == rest(f32)
    scatter = lambda cs: sorted((c.bytes, c.dtype) for c in cs if c.kind == "reduce-scatter")  # noqa: E731
    assert scatter(bf16) == scatter(f32) and {d for _, d in scatter(bf16)} == {"f32"}


def _train(precision, devices):
    model, tx = get("gpt-tiny", n_layers=LAYERS), train.adamw(LR)
    plan, abstract, step = _step(precision, model, tx, devices)
    state = plan.init(abstract)
    source = MarkovSource(vocab=model.config.vocab, seed=0)
    losses, first = [], None
    for i in range(STEPS):
        state, metrics = step(state, plan.shard_batch(source.batch(BATCH, SEQ, i)))
        losses.append(float(metrics["loss"]))
        first = metrics["grads"] if first is None else first
    return np.array(losses), first, state


def test_bf16_zeropp_trains_like_one_f32_device():
    want, want_grads, _ = _train("f32", 1)
    got, grads, state = _train("bf16", 8)
    # tests/test_precision.py's tolerance: one bfloat16 rounding, 2^-8 relative.
    np.testing.assert_allclose(got, want, rtol=2**-8)
    # The gradients come back through the cast into the float32 master weights: each leaf
    # within 2^-5 (relative, in norm) of the f32 one-device gradient, the distance of
    # the one-device bf16 step's own (measured: 2.9 % at most; this step's 0.7 %).
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert g.dtype == jnp.float32
        g, w = np.asarray(g), np.asarray(w)
        assert np.linalg.norm(g - w) <= 2**-5 * np.linalg.norm(w)
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
