"""Attention over packed rows: every strategy (dense, ring, all-gather, Ulysses, USP) equals
each document attended alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.annotate import activation_rules
from shardkit.nn.attention import Segments, causal_attention, use_attention
from shardkit.packing import pack_documents

LENGTHS = (9, 14, 6, 20)  # rows of 32: [8 + 13 + 5 pairs, padding], [19 pairs, padding]


def _inputs():
    rng = np.random.default_rng(0)
    b = pack_documents([rng.integers(0, 9, n) for n in LENGTHS], rows=2, seq=32)
    seg = Segments(jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"]))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 32, 4, 8))
    k, v = (jax.random.normal(x, (2, 32, 2, 8)) for x in keys[1:])  # GQA: 2 K/V heads
    return q, k, v, seg


def _out_and_grads(q, k, v, seg):
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def loss(q, k, v):
        out = causal_attention(q, k, v, segments=seg)
        return (out * w).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def test_dense_is_each_document_alone_and_padding_is_zero():
    q, k, v, seg = _inputs()
    out = causal_attention(q, k, v, segments=seg)
    # Independent: ordinary causal attention of each document's slice, no segments.
    for row, spans in ((0, [(0, 8), (8, 21), (21, 26)]), (1, [(0, 19)])):
        for lo, hi in spans:
            alone = causal_attention(
                q[row : row + 1, lo:hi], k[row : row + 1, lo:hi], v[row : row + 1, lo:hi]
            )
            np.testing.assert_allclose(out[row, lo:hi], alone[0], rtol=1e-5, atol=1e-6)
    assert not np.asarray(out[0, 26:]).any() and not np.asarray(out[1, 19:]).any()


#: (mesh, the length's axes, what attention runs over) per strategy: 4 query heads and
#: 2 K/V heads split at most 2 ways by Ulysses.
MESHES = {
    "ring": ({"data": 2, "sequence": 4}, "sequence", "sequence"),
    "allgather": ({"data": 2, "sequence": 4}, "sequence", "sequence"),
    "ulysses": ({"data": 2, "sequence": 2}, "sequence", "sequence"),  # 4 devices
    "usp": (
        {"data": 2, "sequence": 2, "ulysses": 2},
        ("sequence", "ulysses"),
        ("ulysses", "sequence"),
    ),
}


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("strategy", list(MESHES))
def test_strategies_equal_dense_with_gradients(strategy, explicit):
    q, k, v, seg = _inputs()
    want_out, want_grads = jax.jit(_out_and_grads)(q, k, v, seg)
    sizes, length, axis = MESHES[strategy]
    devices = jax.devices()[: math.prod(sizes.values())]
    mesh = sk.make_mesh(sizes, devices=devices, explicit=explicit)
    sharded = NamedSharding(mesh, P("data", length))
    args = [jax.device_put(x, sharded) for x in (q, k, v)]
    placed = Segments(*(jax.device_put(x, sharded) for x in seg))
    rules = sk.Rules([("batch", "data"), ("length", length)])
    with jax.set_mesh(mesh), activation_rules(rules), use_attention(strategy, axis=axis):
        compiled = jax.jit(lambda *a: _out_and_grads(*a)).lower(*args, placed).compile()
    out, grads = compiled(*args, placed)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    hlo = compiled.as_text()
    assert ("collective-permute" in hlo) == (strategy in ("ring", "usp"))
    assert ("all-to-all" in hlo) == (strategy in ("ulysses", "usp"))
