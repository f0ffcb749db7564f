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
from shardkit.nn.ulysses import check_heads, check_usp
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
    # USP: the zigzag over the ring's 4 ranks (Ulysses attends each one's whole block)
    np.testing.assert_array_equal(sk.Plan("cp_usp").balance_order(SEQ), zigzag_order(SEQ, 4))
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


@functools.cache
def _llama_report(recipe):
    model = models.get("llama-tiny", n_layers=1, remat="full")
    return sk.report.build_report(sk.Plan(recipe), model=model, batch=8, seq=64)


def _block_bytes(report, block, kind, dtype=None):
    return sum(
        c.wire_bytes
        for c in report.collectives
        if c.block == block and c.kind == kind and (dtype is None or c.dtype == dtype)
    )


def test_ulysses_wire_matches_its_all_to_all_model():
    report = _llama_report(sk.recipes.get("cp").with_attention("ulysses"))
    a2a = _block_bytes(report, "attention.ulysses", "all-to-all")
    cfg = models.get("llama-tiny").config
    h, h_kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    # 4 all-to-alls a layer, 3 passes (forward, recompute, backward), each sending 7/8 of
    # a local [8, 64/8, width] f32 tensor.
    want = 1 * 3 * 8 * 8 * (2 * h + 2 * h_kv) * 4 * 7 / 8
    assert want / 1.1 <= a2a <= 1.1 * want, (a2a, want)
    kv = next(t for t in report.wire_terms if t.term == "context-parallel K/V")
    assert kv.ratio is not None and 1 / 1.1 <= kv.ratio <= 1.1


def test_ulysses_places_no_positions_a_users_zigzag_does():
    """Ulysses attends whole sequences: with_attention drops the zigzag, and with it the
    segment ids and positions every layer gathered; a user's explicit zigzag stays."""
    plain = _llama_report(sk.recipes.get("cp").with_attention("ulysses"))
    chosen = _llama_report(sk.recipes.get("cp").with_attention("ulysses", balance="zigzag"))
    assert _block_bytes(plain, "attention.ulysses", "all-gather") == 0
    # by hand: the int32 segment ids and positions [8, 64/8] gathered over 8, once a step
    assert _block_bytes(chosen, "attention.ulysses", "all-gather") >= 2 * 8 * 64 * 4 * 7 / 8


def test_with_attention_picks_the_balance_and_keeps_a_users_choice():
    cp = sk.recipes.get("cp")
    assert [cp.with_attention(a).balance for a in ("ring", "allgather", "ulysses", "dense")] == [
        "zigzag",
        "none",
        "none",
        "none",
    ]
    assert cp.with_attention("ulysses").with_attention("ring").balance == "zigzag"
    mine = dataclasses.replace(cp, balance="none")  # the ring on the contiguous split
    assert mine.with_attention("allgather").with_attention("ring").balance == "zigzag"
    assert mine.with_attention("ring").balance == "none"  # a choice the strategy's is not
    assert cp.with_attention("allgather", balance="zigzag").with_attention("ulysses").balance == (
        "zigzag"
    )
    with pytest.raises(sk.ShardingError, match="cp_usp"):
        cp.with_attention("usp")
    with pytest.raises(sk.ShardingError, match=r"recipes.get\('cp'\)"):
        sk.recipes.get("cp_usp").with_attention("ring")


def test_usp_wire_is_all_to_all_on_one_axis_and_the_ring_on_the_other():
    """cp_usp: ring 'sequence' = 4 × Ulysses 'ulysses' = 2, llama-tiny (GQA 16/8 heads)."""
    report = _llama_report(sk.recipes.get("cp_usp"))
    cfg = models.get("llama-tiny").config
    h, h_kv, b, s, u, r, passes = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, 8, 64, 2, 4, 3
    # By hand, per layer: q, k, v, out all-to-all'd over U of a [b, s/(U·R), width] shard,
    # (U-1)/U of it sent; the ring's R-1 blocks of K and V [b, s/R, h_kv/U] each pass.
    a2a = passes * (u - 1) / u * b * s / (u * r) * (2 * h + 2 * h_kv) * 4
    ring = passes * (r - 1) * 2 * b * (s / r) * (h_kv / u) * 4
    got_a2a = _block_bytes(report, "attention.ulysses", "all-to-all")
    got_ring = _block_bytes(report, "attention.ring", "collective-permute", "f32")
    assert a2a / 1.1 <= got_a2a <= 1.1 * a2a, (got_a2a, a2a)
    assert ring / 1.1 <= got_ring <= 1.1 * ring, (got_ring, ring)
    kinds = {(c.block, c.kind) for c in report.collectives if c.block.startswith("attention")}
    assert ("attention.ulysses", "collective-permute") not in kinds
    assert ("attention.ring", "all-to-all") not in kinds
    kv = next(t for t in report.wire_terms if t.term == "context-parallel K/V")
    assert kv.ratio is not None and 1 / 1.1 <= kv.ratio <= 1.1, kv.ratio
    notes = [n for n in report.analytic.notes if "USP" in n]
    assert any(n.startswith("all-to-all") for n in notes)
    assert any(n.startswith("collective-permute") for n in notes)


def test_usp_bad_heads_and_sequences_name_the_nearest_setting():
    with pytest.raises(sk.ShardingError, match="'ulysses' = 2 and 'sequence' = 4"):
        check_usp(64, 16, 2, ("ulysses", "sequence"), (4, 2))  # 2 K/V heads over 4
    with pytest.raises(sk.ShardingError, match="sequence of 32 or 40 .a multiple of 8"):
        check_usp(36, 8, 8, ("ulysses", "sequence"), (2, 4))
    with pytest.raises(sk.ShardingError, match="sequence of 16 or 24 .a multiple of 8"):
        check_usp(20, 8, 8, ("ulysses", "sequence"), (4, 2))  # U·R = 8 > 2R = 4
    recipe = sk.recipes.get("cp_usp").with_mesh({"ulysses": 4, "sequence": 2})
    model = models.get("llama-tiny", n_kv_heads=2)
    with pytest.raises(sk.ShardingError, match="'ulysses' = 2 and 'sequence' = 4"):
        sk.report.build_report(sk.Plan(recipe), model=model, batch=2, seq=32)
