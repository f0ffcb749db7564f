"""TSP's weight-shard rings: exact values and gradients against dense references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shardkit import context
from shardkit.nn import tsp
from shardkit.nn.tsp import ring_dot
from shardkit.report import build_report
from shardkit.report.hlo import parse_collectives
from shardkit.rules import Rules

N = 4
AUTO = AxisType.Auto


def _mesh():
    return jax.make_mesh((N,), ("tsp",), devices=jax.devices()[:N], axis_types=(AUTO,))


def _ringed(kind, dims=None, kdim=None):
    """x [2, 8, 16] tokens split on dim 1; "in": w [16, 12] rows split; "out": w [16, 12] cols."""
    wspec = P("tsp") if kind == "in" else P(None, "tsp")

    @jax.jit
    def f(x, w):
        def body(x, w):
            return ring_dot(x, w, kind=kind, axis="tsp", size=N, dims=dims, kdim=kdim)

        return jax.shard_map(
            body,
            mesh=_mesh(),
            in_specs=(P(None, "tsp"), wspec),
            out_specs=P(None, "tsp"),
            check_vma=False,
        )(x, w)

    return f


@pytest.mark.parametrize("kind", ["in", "out"])
def test_ring_dot_value_and_gradients_match_dense(kind):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 16))
    w = jax.random.normal(kw, (16, 12 if kind == "in" else 16))
    cot = jax.random.normal(kc, (2, 8, w.shape[1]))

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * cot)  # a generic cotangent

    def dense(x, w):
        return x @ w

    y, y_ref = _ringed(kind)(x, w), dense(x, w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    g = jax.grad(loss(_ringed(kind)), argnums=(0, 1))(x, w)
    g_ref = jax.grad(loss(dense), argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_ring_dot_multi_dim_kernel_like_attention_out():
    # "out" over a (heads, kv, embed) kernel: contract two dims, split the last.
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (2, 8, 3, 4))
    w = jax.random.normal(kw, (3, 4, 8))
    dims = (((2, 3), (0, 1)), ((), ()))

    @jax.jit
    def f(x, w):
        def body(x, w):
            return ring_dot(x, w, kind="out", axis="tsp", size=N, dims=dims, kdim=2)

        return jax.shard_map(
            body,
            mesh=_mesh(),
            in_specs=(P(None, "tsp"), P(None, None, "tsp")),
            out_specs=P(None, "tsp"),
            check_vma=False,
        )(x, w)

    def ref(x, w):
        return jnp.einsum("bshk,hkd->bsd", x, w)

    np.testing.assert_allclose(f(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(ref(x, w))), argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["in", "out"])
def test_ring_dot_wire_bytes_forward_and_backward(kind):
    # Independent count: forward, each device receives the D-1 other shards; backward,
    # the shards again plus D-1 hops of a gradient accumulator. 4 bytes a value.
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    shard = 16 * 16 // N * 4
    f = _ringed(kind)
    fwd = jax.jit(f).lower(x, w).compile()
    # The backward alone: the forward's outputs are unused, so XLA drops its ring.
    bwd = jax.jit(lambda x, w, ct: jax.vjp(f, x, w)[1](ct)).lower(x, w, x).compile()

    def wire(c):
        return sum(op.wire_bytes for op in parse_collectives(c.as_text()))

    assert wire(fwd) == (N - 1) * shard
    assert wire(bwd) == 2 * (N - 1) * shard


def _tsp_context(n=N, schedule="tsp"):
    rules = [("embed", "tsp"), ("length", "tsp")]
    mesh = jax.make_mesh((n,), ("tsp",), devices=jax.devices()[:n], axis_types=(AUTO,))
    return mesh, dict(
        param_rules=Rules(rules[:1]),
        activation_rules=Rules(rules[1:]),
        attention="ring",
        attention_axis="tsp",
        layer_schedule=schedule,
    )


def _grads(fn, args, schedule=None):
    """Value and gradients of sum(sin(fn(*args))): under a TSP context, or plain (None)."""
    loss = jax.jit(
        jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=tuple(range(len(args))))
    )
    if schedule is None:
        return loss(*args), ""
    mesh, ctx = _tsp_context(schedule=schedule)
    with jax.set_mesh(mesh), context.using(**ctx):
        return loss(*args), loss.lower(*args).compile().as_text()


def _check_against_dense(fn, args):
    ((v, g), hlo), ((v_ref, g_ref), _) = _grads(fn, args, "tsp"), _grads(fn, args)
    # The rings' permutes, and the loss's scalar sum: XLA gathered no weight.
    kinds = {c.kind for c in parse_collectives(hlo) if c.bytes > 4}
    assert kinds == {"collective-permute"}, kinds
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    scale = max(float(jnp.abs(a).max()) for a in g_ref)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


def test_gated_mlp_matches_dense_with_gradients():
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (2, 16, 8))
    wg, wu = (0.3 * jax.random.normal(k, (8, 12)) for k in ks[1:3])
    wd = 0.3 * jax.random.normal(ks[3], (12, 8))
    _check_against_dense(tsp.gated_mlp, (x, wg, wu, wd))


def test_attention_gqa_rope_matches_dense_with_gradients():
    from shardkit.nn.rope import rope_tables

    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (2, 16, 8))
    wq = 0.5 * jax.random.normal(ks[1], (8, 6, 4))  # 6 heads: not divisible by D=4
    wk, wv = (0.5 * jax.random.normal(k, (8, 3, 4)) for k in ks[2:4])
    wo = 0.5 * jax.random.normal(ks[4], (6, 4, 8))
    rope = rope_tables(16, 4)
    _check_against_dense(lambda *a: tsp.attention(*a, rope=rope), (x, wq, wk, wv, wo))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("recipe", ["tsp", "tsp_gspmd"])
def test_sequence_not_a_multiple_of_2d_names_the_numbers(recipe):
    import shardkit as sk
    from shardkit import models
    from shardkit.errors import ShardingError

    with pytest.raises(ShardingError) as err:
        build_report(sk.Plan(recipe), model=models.get("gpt-tiny"), batch=2, seq=24)
    assert "length 24" in str(err.value) and "\nFix: " in str(err.value)
    assert "multiple of 16" in str(err.value).split("Fix:")[1]


def test_weight_dimension_not_divisible_by_tsp_names_the_numbers():
    import shardkit as sk
    from shardkit import models
    from shardkit.errors import ShardingError

    model = models.get("gpt-tiny", d_model=36, n_heads=4, n_kv_heads=4)
    with pytest.raises(ShardingError, match=r"'embed'.*36.*tsp=8.*\nFix: .*multiple of 8"):
        build_report(sk.Plan("tsp"), model=model, batch=2, seq=32)


@pytest.mark.parametrize("recipe", ["tsp", "tsp_gspmd"])
def test_tsp_and_tensor_on_one_dimension_is_refused(recipe):
    import dataclasses

    import shardkit as sk
    from shardkit.errors import ShardingError

    base = sk.recipes.get(recipe)
    both = dataclasses.replace(
        base,
        mesh_axes=(("tsp", 4), ("tensor", 2)),
        rules=Rules([("vocab", "tsp"), ("embed", ("tsp", "tensor"))]),
    )
    with pytest.raises(ShardingError, match=r"'embed'.*tsp=4, tensor=2.*\nFix: map 'embed'"):
        sk.Plan(both)
    # under the paper's schedule, a kernel split over tsp and tensor at trace time too
    with pytest.raises(ShardingError, match=r"also over \['tensor'\].*\nFix"):
        mesh = jax.make_mesh((4, 2), ("tsp", "tensor"), axis_types=(AUTO, AUTO))
        ctx = dict(
            param_rules=Rules([("embed", "tsp"), ("mlp", "tensor")]),
            activation_rules=Rules([("length", "tsp")]),
            layer_schedule="tsp",
            attention_axis="tsp",
        )
        with jax.set_mesh(mesh), context.using(**ctx):
            jax.jit(tsp.gated_mlp).lower(
                jnp.ones((1, 16, 8)), None, jnp.ones((8, 4)), jnp.ones((4, 8))
            )
