"""TSP's vocabulary rings: the head and loss, and the lookup, against one device."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import shardkit as sk
from shardkit import context
from shardkit.nn.loss import cross_entropy
from shardkit.nn.tsp_head import vocab_ring_cross_entropy, vocab_ring_lookup
from shardkit.report.hlo import parse_collectives
from shardkit.rules import Rules

N, B, S, D, V = 4, 2, 16, 8, 32  # devices, batch, sequence, width, vocabulary
HEAD = ("embed", "vocab")
TABLE = ("vocab", "embed")


def _ctx():
    mesh = jax.make_mesh((N,), ("tsp",), devices=jax.devices()[:N], axis_types=(AxisType.Auto,))
    ctx = dict(
        param_rules=Rules([("vocab", "tsp"), ("embed", "tsp")]),
        activation_rules=Rules([("length", "tsp")]),
        attention="ring",
        attention_axis="tsp",
        layer_schedule="tsp",
    )
    return mesh, ctx


def _under_tsp(fn, *args):
    """``fn(*args)`` jitted under a TSP context: (result, compiled HLO text)."""
    mesh, ctx = _ctx()
    with jax.set_mesh(mesh), context.using(**ctx):
        jitted = jax.jit(fn)
        return jitted(*args), jitted.lower(*args).compile().as_text()


def _data():
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (B, S, D))
    w = 0.5 * jax.random.normal(kw, (D, V))
    targets = jax.random.randint(kt, (B, S), 0, V)
    return hidden, w, targets


def _project(w, h):
    return jnp.einsum("...d,dv->...v", h, w)


def _loss(ring):
    def loss(h, w, t):
        if ring:
            losses = vocab_ring_cross_entropy(h, t, _project, w, HEAD)
            assert losses is not None  # the ring applies under this context
        else:
            losses = cross_entropy(_project(w, h), t)
        return jnp.sum(losses * jnp.cos(jnp.arange(B * S).reshape(B, S)))

    return jax.value_and_grad(loss, argnums=(0, 1))


def test_head_ring_matches_dense_cross_entropy_with_gradients():
    h, w, t = _data()
    (v, g), hlo = _under_tsp(_loss(True), h, w, t)
    v_ref, g_ref = jax.jit(_loss(False))(h, w, t)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))
    # only the ring's permutes (and the loss's scalar sum): the weight is never gathered
    assert {c.kind for c in parse_collectives(hlo) if c.bytes > 4} == {"collective-permute"}


def test_chunked_cross_entropy_takes_the_ring_under_tsp():
    h, w, t = _data()

    def loss(h, w):
        return sk.chunked_cross_entropy(h, t, _project, weight=w, weight_axes=HEAD).sum()

    v, hlo = _under_tsp(loss, h, w)
    np.testing.assert_allclose(v, cross_entropy(_project(w, h), t).sum(), rtol=1e-5)
    assert "collective-permute" in hlo and "all-gather" not in hlo


def test_head_ring_wire_bytes_forward_and_backward():
    # Hand count: forward, each device receives the N - 1 other vocabulary shards
    # [D, V/N]; backward, the shards again and a gradient accumulator, N - 1 hops each.
    # The backward needs the forward's log-partition function, so its program runs
    # both; their first hop (the own shard sent to p + 1) is one op, shared.
    h, w, t = _data()
    shard = D * V // N * 4
    mesh, ctx = _ctx()

    def fwd(h, w):
        return vocab_ring_cross_entropy(h, t, _project, w, HEAD)

    def bwd(h, w, ct):
        return jax.vjp(fwd, h, w)[1](ct)

    with jax.set_mesh(mesh), context.using(**ctx):
        wire = [
            sum(c.wire_bytes for c in parse_collectives(jax.jit(f).lower(*a).compile().as_text()))
            for f, a in ((fwd, (h, w)), (bwd, (h, w, t.astype(jnp.float32))))
        ]
    assert wire == [(N - 1) * shard, (3 * (N - 1) - 1) * shard]


def test_lookup_ring_matches_take_with_gradients_and_wire():
    table = jax.random.normal(jax.random.key(1), (V, D))
    tokens = jax.random.randint(jax.random.key(2), (B, S), 0, V)
    cot = jax.random.normal(jax.random.key(3), (B, S, D))

    def ring(w):
        x = vocab_ring_lookup(w, tokens, TABLE)
        assert x is not None
        return x

    def loss(lookup):
        return jax.value_and_grad(lambda w: jnp.sum(jnp.sin(lookup(w)) * cot))

    x, _ = _under_tsp(ring, table)
    np.testing.assert_array_equal(x, jnp.take(table, tokens, axis=0))  # one row is non-zero
    (v, g), hlo = _under_tsp(loss(ring), table)
    v_ref, g_ref = loss(lambda w: jnp.take(w, tokens, axis=0))(table)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-6)
    # Hand count: the token ids all-gathered (4 bytes a token), the partial embeddings
    # reduce-scattered and their gradient all-gathered around the ring: N - 1 blocks
    # [B, S/N, D] each way. The table itself never moves.
    wire = collections.Counter()
    for c in parse_collectives(hlo):
        if c.bytes > 4:  # not the loss's scalar sum
            wire[c.kind] += c.wire_bytes
    block = B * S // N * D * 4
    assert wire == {
        "all-gather": (N - 1) / N * B * S * 4,
        "collective-permute": 2 * (N - 1) * block,
    }
