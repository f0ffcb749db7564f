"""The MoE layer, its reference models and expert parallelism against one device."""

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get

STEPS, BATCH, SEQ, LR, EPS = 2, 8, 16, 1e-2, 1e-5
# Capacity factor 4 = E/k: every expert has a slot for every token of a sequence, so no
# token drops on any layout (checked below) and every layout must compute the same sums.
NO_DROP = {"capacity_factor": 4.0}
RECIPES = ["dp", "fsdp", "ep", "fsdp_ep", "ep_tp", "ep_gspmd"]


def run_steps(plan, **overrides):
    model = get("moe-tiny", **overrides)
    tx = train.adamw(LR, eps=EPS)
    source = MarkovSource(vocab=model.config.vocab, seed=0)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx, return_grads=True))
    stats = plan.jit(lambda p, b: (p, model.router_stats(p, b)), donate_state=False)
    losses, first_grads, dropped = [], None, 0.0
    for i in range(STEPS):
        batch = plan.shard_batch(source.batch(BATCH, SEQ, i))
        dropped += float(stats(state.params, batch)[1]["dropped"].sum())
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        first_grads = metrics["grads"] if first_grads is None else first_grads
    return losses, first_grads, dropped


@pytest.fixture(scope="module")
def one_device():
    return run_steps(sk.Plan("dp", devices=jax.devices()[:1]), **NO_DROP)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_one_device(recipe, one_device):
    ref_losses, ref_grads, ref_dropped = one_device
    losses, grads, dropped = run_steps(sk.Plan(recipe), **NO_DROP)
    assert ref_dropped == dropped == 0.0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale)
