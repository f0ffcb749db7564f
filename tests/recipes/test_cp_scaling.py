"""Context parallelism that scales: state ZeRO-3 over the context axis, the zigzag order
applied once where the batch is placed, and every attention strategy (ring, all-gather,
Ulysses) training to the 1-device losses and gradients."""

import dataclasses
import functools
from collections import Counter

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit import models, train
from shardkit.balance import balance_batch, zigzag_order
from shardkit.data import MarkovSource
from shardkit.nn.ulysses import check_heads
from shardkit.report.analytic import analytic_model

ROWS, SEQ = 4, 32


def _batch(vocab: int) -> dict:
    return MarkovSource(vocab=vocab).batch(ROWS, SEQ, 0)


@functools.cache
def _one_device(name: str):
    """Losses of two AdamW steps and the first step's gradients on one device."""
    model, tx = models.get(name, n_layers=1), train.adamw()
    plan = sk.Plan("dp", devices=jax.devices()[:1])
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = jax.jit(train.train_step(model, tx, return_grads=True))
    batch = plan.shard_batch(_batch(model.config.vocab))
    state, m0 = step(state, batch)
    _, m1 = step(state, batch)
    return float(m0["loss"]), jax.device_get(m0["grads"]), float(m1["loss"])


def _context_parallel(name: str, recipe, devices=None):
    model, tx = models.get(name, n_layers=1), train.adamw()
    plan = sk.Plan(recipe, devices=devices)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx, return_grads=True))
    batch = plan.shard_batch(_batch(model.config.vocab))
    state, m0 = step(state, batch)
    _, m1 = step(state, batch)
    return float(m0["loss"]), jax.device_get(m0["grads"]), float(m1["loss"]), batch


#: What each strategy needs placed (by hand): the ring (alone or in USP) the zigzag for
#: its causal load; all-gather and Ulysses attend evenly as the tokens come.
ZIGZAG = {"ring": True, "usp": True, "allgather": False, "ulysses": False}


def _recipe(strategy: str):
    """cp with ``strategy``; USP on cp_usp (ring 4 × Ulysses 2)."""
    return sk.recipes.get("cp_usp" if strategy == "usp" else "cp").with_attention(strategy)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("gpt-tiny", "ring"),
        ("gpt-tiny", "ulysses"),
        ("gpt-tiny", "usp"),
        ("llama-tiny", "allgather"),
        ("llama-tiny", "ulysses"),
        ("llama-tiny", "usp"),
    ],
)
def test_every_strategy_trains_to_the_one_device_losses(name, strategy):
    want0, want_grads, want1 = _one_device(name)
    recipe = _recipe(strategy)
    assert recipe.balance == ("zigzag" if ZIGZAG[strategy] else "none")
    loss0, grads, loss1, batch = _context_parallel(name, recipe)
    # placed in the zigzag order with positions carried along only where the ring runs
    assert ("positions" in batch) == ZIGZAG[strategy]
    np.testing.assert_allclose(loss0, want0, rtol=1e-5)
    np.testing.assert_allclose(loss1, want1, rtol=1e-5)
    top = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * top)


def test_fsdp_cp_shards_the_state_over_both_axes_and_matches_one_device():
    """llama-tiny's ring (GQA blocks), the state ZeRO-3 over fsdp × sequence."""
    want0, want_grads, _ = _one_device("llama-tiny")
    loss0, grads, _, _ = _context_parallel("llama-tiny", "fsdp_cp")
    np.testing.assert_allclose(loss0, want0, rtol=1e-5)
    top = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * top)
    rules = sk.recipes.get("fsdp_cp").rules
    assert rules.spec(("embed", "mlp")) == jax.sharding.PartitionSpec(("fsdp", "sequence"), None)


def test_zigzag_order_gives_rank_i_chunks_i_and_2n_minus_1_minus_i():
    n, seq = 4, 32
    order = zigzag_order(seq, n).reshape(n, 2, seq // (2 * n))
    for i in range(n):  # by hand: chunk c holds tokens [c·4, c·4 + 4)
        assert order[i, 0].tolist() == list(range(4 * i, 4 * i + 4))
        assert order[i, 1].tolist() == list(range(4 * (7 - i), 4 * (7 - i) + 4))
    with pytest.raises(sk.ShardingError, match="multiple of 8"):
        zigzag_order(12, 4)


def test_shard_batch_places_inputs_targets_and_positions_in_one_order():
    plan = sk.Plan("cp")
    host = _batch(256)
    placed = jax.device_get(plan.shard_batch(host))
    order = zigzag_order(SEQ, 8)
    np.testing.assert_array_equal(placed["inputs"], host["inputs"][:, order])
    np.testing.assert_array_equal(placed["targets"], host["targets"][:, order])
    np.testing.assert_array_equal(placed["positions"], np.broadcast_to(order, (ROWS, SEQ)))
    np.testing.assert_array_equal(placed["segment_ids"], np.ones((ROWS, SEQ)))  # one document
    assert sk.Plan("fsdp").balance_order(SEQ) is None
    with pytest.raises(sk.ShardingError, match="permutation"):
        balance_batch(host, np.zeros(SEQ, int))


@functools.cache
def _cp_report():
    model = models.get("gpt-tiny", n_layers=1, remat="full")
    return sk.report.build_report(sk.Plan("cp"), model=model, batch=8, seq=64)


def test_no_collective_permute_outside_the_ring():
    """The zigzag order is the batch's: the compiled step permutes only K/V blocks."""
    permutes = Counter(c.block for c in _cp_report().collectives if c.kind == "collective-permute")
    assert permutes and set(permutes) == {"attention.ring"}, permutes


def test_cp_state_is_sharded_like_fsdp_and_the_replicated_layout_stays_available():
    psi = models.get("gpt-tiny", n_layers=1).config.param_count()
    args = _cp_report().memory.arguments
    assert args <= 1.05 * 16 * psi / 8 + 4 * 2**10  # + the batch and step counter
    old = sk.recipes.get("cp").with_context_state("replicated")
    assert old.rules.spec(("vocab", "embed")) == jax.sharding.PartitionSpec(None, None)
    assert old.context_state == "replicated" and "all-reduce" in old.collectives
    model = models.get("gpt-tiny", n_layers=1)
    abstract = sk.Plan(old).abstract_init(train.init_fn(model, train.adamw()), jax.random.key(0))
    leaves = jax.tree.leaves(abstract.tree)
    assert all(x.sharding.shard_shape(x.shape) == x.shape for x in leaves)  # whole everywhere
    with pytest.raises(sk.ShardingError, match="with_context_state"):
        dataclasses.replace(sk.recipes.get("cp"), context_state="replicated")


@pytest.mark.parametrize(
    ("name", "mesh"), [("cp", {"sequence": 8}), ("fsdp_cp", {"fsdp": 4, "sequence": 2})]
)
def test_analytic_state_is_split_over_every_token_axis(name, mesh):
    dims = models.get("llama-tiny").config.dims()
    m = analytic_model(dims, name, mesh, batch=8, seq=64, remat="full")
    psi = dims.param_count
    assert m.memory.params == m.memory.grads == pytest.approx(4 * psi / 8)
    assert m.memory.optimizer == pytest.approx(8 * psi / 8)
    old = analytic_model(
        dims, sk.recipes.get(name).with_context_state("replicated"), mesh, batch=8, seq=64
    )
    assert old.memory.params == pytest.approx(4 * psi / mesh.get("fsdp", 1))


def test_ulysses_heads_not_divisible_name_the_nearest_axis_size():
    with pytest.raises(sk.ShardingError, match="'sequence' axis of 6 "):
        check_heads(12, 12, 8)  # gpt-small's 12 heads over 8
    with pytest.raises(sk.ShardingError, match="axis of 4 .*1, 2, 4"):
        check_heads(16, 4, 8)  # GQA: the K/V heads bind
    recipe = sk.recipes.get("cp").with_attention("ulysses")
    model = models.get("gpt-tiny", n_heads=4, n_kv_heads=4)  # 4 heads over 8 devices
    with pytest.raises(sk.ShardingError, match="axis of 4"):
        sk.report.build_report(sk.Plan(recipe), model=model, batch=2, seq=32)


def test_ulysses_wire_matches_its_all_to_all_model():
    recipe = sk.recipes.get("cp").with_attention("ulysses")
    model = models.get("llama-tiny", n_layers=1, remat="full")
    report = sk.report.build_report(sk.Plan(recipe), model=model, batch=8, seq=64)
    a2a = sum(c.wire_bytes for c in report.collectives if c.block == "attention.ulysses")
    cfg = model.config
    h, h_kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    # 4 all-to-alls a layer, 3 passes (forward, recompute, backward), each sending 7/8 of
    # a local [8, 64/8, width] f32 tensor; the segment ids and positions (int32)
    # all-gathered in the 2 forward passes.
    want = cfg.n_layers * 3 * 8 * 8 * (2 * h + 2 * h_kv) * 4 * 7 / 8
    want += cfg.n_layers * 2 * 2 * 8 * 64 * 4 * 7 / 8  # segment ids and positions
    assert want / 1.1 <= a2a <= 1.1 * want, (a2a, want)
    kv = next(t for t in report.wire_terms if t.term == "context-parallel K/V")
    assert kv.ratio is not None and 1 / 1.1 <= kv.ratio <= 1.1
