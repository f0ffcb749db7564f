"""Context-parallel causal attention: ring and allgather equal dense, with the expected HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.annotate import activation_rules
from shardkit.nn.attention import causal_attention, current_attention, use_attention
from shardkit.report.hlo import parse_collectives

MESHES = {
    "seq8": ({"sequence": 8}, [("length", "sequence")], P(None, "sequence")),
    "data2_seq4": (
        {"data": 2, "sequence": 4},
        [("batch", "data"), ("length", "sequence")],
        P("data", "sequence"),
    ),
}


def _qkv(seq: int, batch: int = 2):
    keys = jax.random.split(jax.random.key(seq), 3)
    return tuple(jax.random.normal(k, (batch, seq, 2, 8), jnp.float32) for k in keys)


def _out_and_grads(q, k, v):
    """Output and d(loss)/d(q, k, v) for a loss that weights every output element differently."""
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def loss(q, k, v):
        out = causal_attention(q, k, v)
        return (out * w).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _reference(q, k, v):
    return jax.jit(lambda *a: _out_and_grads(*a))(q, k, v)


def test_dense_matches_naive_softmax():
    q, k, v = _qkv(16, batch=1)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    s = np.where(np.tril(np.ones((16, 16), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(causal_attention(q, k, v), want, rtol=1e-5, atol=1e-6)


def test_use_attention_nests_and_restores():
    assert current_attention() == ("dense", "sequence")
    with use_attention("ring"):
        assert current_attention() == ("ring", "sequence")
        with use_attention("allgather", axis="context"):
            assert current_attention() == ("allgather", "context")
        assert current_attention() == ("ring", "sequence")
    assert current_attention() == ("dense", "sequence")
    with pytest.raises(sk.ShardingError, match="strategy"), use_attention("flash"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("seq", [64, 128])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_dense_with_gradients(mesh_name, strategy, seq):
    axes, rules, spec = MESHES[mesh_name]
    mesh = sk.make_mesh(axes)
    q, k, v = _qkv(seq)
    want_out, want_grads = _reference(q, k, v)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    with jax.set_mesh(mesh), activation_rules(sk.Rules(rules)), use_attention(strategy):
        # A fresh function per strategy: jit caches traces by function, not by use_attention.
        compiled = jax.jit(lambda *a: _out_and_grads(*a)).lower(*args).compile()
    out, grads = compiled(*args)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    hlo = compiled.as_text()
    if strategy == "ring":
        assert "collective-permute" in hlo
        assert "all-gather" not in hlo
    else:
        assert "all-gather" in hlo


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_heads_on_tensor_under_an_explicit_mesh(strategy):
    mesh = sk.make_mesh({"data": 2, "sequence": 2, "tensor": 2}, explicit=True)
    rules = sk.Rules([("batch", "data"), ("length", "sequence"), ("heads", "tensor")])
    q, k, v = _qkv(32)
    want_out, want_grads = _reference(q, k, v)
    spec = P("data", "sequence", "tensor")
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    with jax.set_mesh(mesh), activation_rules(rules), use_attention(strategy):
        out, grads = jax.jit(lambda *a: _out_and_grads(*a))(*args)
    assert out.sharding.spec[:3] == tuple(spec)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", [None, {"data": 8}, {"data": 8, "sequence": 1}])
def test_falls_back_to_dense(axes):
    q, k, v = _qkv(16)
    want = causal_attention(q, k, v)
    with use_attention("ring"):
        if axes is None:
            got = jax.jit(lambda *a: causal_attention(*a))(q, k, v)
        else:
            with jax.set_mesh(sk.make_mesh(axes)):
                fn = jax.jit(lambda *a: causal_attention(*a))
                got = fn(q, k, v)
                hlo = fn.lower(q, k, v).compile().as_text()
            assert "collective-permute" not in hlo
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_indivisible_sequence_is_a_sharding_error():
    q, k, v = _qkv(24)  # 24 = 3 x 8, not a multiple of 2 x 8 zigzag chunks
    with jax.set_mesh(sk.make_mesh({"sequence": 8})), use_attention("ring"):
        with pytest.raises(sk.ShardingError, match="multiple of 16"):
            causal_attention(q, k, v)


def test_ring_temp_memory_is_a_fraction_of_dense_on_long_sequences():
    mesh = sk.make_mesh({"sequence": 8})
    x = jax.ShapeDtypeStruct(
        (1, 8 * 512, 2, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence"))
    )
    temp = {}
    for strategy in ("dense", "ring"):
        with jax.set_mesh(mesh), activation_rules(sk.Rules([("length", "sequence")])):
            with use_attention(strategy):
                compiled = jax.jit(lambda *a: causal_attention(*a)).lower(x, x, x).compile()
        temp[strategy] = compiled.memory_analysis().temp_size_in_bytes
    # dense: [1, 2, 512, 4096] f32 scores per device (16 MiB, several live); ring: one block pair.
    assert temp["dense"] >= 16 * 2**20
    assert temp["ring"] < temp["dense"] / 4, temp


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_grouped_kv_heads_match_repeated_and_cross_as_kv_heads(strategy):
    # GQA: 4 query heads read 2 K/V heads (head i reads K/V head i // 2). The reference
    # repeats K/V to 4 heads and runs dense attention on one device.
    keys = jax.random.split(jax.random.key(7), 3)
    b, s, hq, g, d, n = 2, 64, 4, 2, 8, 8
    q = jax.random.normal(keys[0], (b, s, hq, d))
    k, v = (jax.random.normal(key, (b, s, g, d)) for key in keys[1:])
    want_out, want_grads = _reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
    mesh = sk.make_mesh({"sequence": n})
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sequence"))) for x in (q, k, v)]
    with jax.set_mesh(mesh), activation_rules(sk.Rules([("length", "sequence")])):
        with use_attention(strategy):
            compiled = jax.jit(lambda *a: _out_and_grads(*a)).lower(*args).compile()
    out, (dq, dk, dv) = compiled(*args)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dq, want_grads[0], rtol=1e-5, atol=1e-6)
    # the repeated heads' gradients sum into their K/V head
    for got, want in ((dk, want_grads[1]), (dv, want_grads[2])):
        np.testing.assert_allclose(got, want.reshape(b, s, g, 2, d).sum(3), rtol=1e-5, atol=1e-5)
    if strategy == "ring":
        # Hand count of the K/V ring (forward, backward of autodiff, no remat): the
        # stacked K and V block [2, b, s/n, g, d] crosses n - 1 hops each way, f32.
        fwd = jax.jit(lambda *a: causal_attention(*a))
        with jax.set_mesh(mesh), activation_rules(sk.Rules([("length", "sequence")])):
            with use_attention(strategy):
                hlo = fwd.lower(*args).compile().as_text()
        block = (2, b, s // n, g, d)
        ring = [c for c in parse_collectives(hlo) if c.shape == block and c.group_size == n]
        assert sum(c.wire_bytes for c in ring) == (n - 1) * 2 * b * (s // n) * g * d * 4
        # no block of the query heads' width travels the ring
        assert not [
            c
            for c in parse_collectives(hlo)
            if c.group_size == n and any(x[-2:] == (hq, d) for x in c.shapes)
        ]


def test_masked_softmax_is_softmax_and_keeps_only_its_output():
    from jax._src.ad_checkpoint import saved_residuals

    from shardkit.nn.attention import masked_softmax

    b, h, s = 2, 3, 16
    scores = jax.random.normal(jax.random.key(0), (b, h, s, s), jnp.float32) * 4
    keep = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    g = jax.random.normal(jax.random.key(1), (b, h, s, s), jnp.float32)

    def ref(x):
        return jnp.sum(jax.nn.softmax(jnp.where(keep, x, -jnp.inf), axis=-1) * g)

    def mine(x):
        return jnp.sum(masked_softmax(x, keep, jnp.float32) * g)

    np.testing.assert_allclose(mine(scores), ref(scores), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(mine)(scores), jax.grad(ref)(scores), rtol=1e-5, atol=1e-6)
    # bf16: the backward keeps the b·h·s·s probabilities at 2 bytes each, nothing else
    saved = saved_residuals(lambda x: jnp.sum(masked_softmax(x, keep, jnp.bfloat16)), scores)
    assert sum(a.size * a.dtype.itemsize for a, _ in saved) == b * h * s * s * 2


# USP: (mesh, the strategy that runs), the length ring-major over (sequence, ulysses); an
# axis of size 1 leaves the other's strategy.
USP_MESHES = [
    ({"sequence": 4, "ulysses": 2}, "usp"),
    ({"sequence": 8, "ulysses": 1}, "ring"),
    ({"sequence": 1, "ulysses": 2}, "ulysses"),
]


@pytest.mark.parametrize(("axes", "runs"), USP_MESHES)
def test_usp_matches_dense_with_gradients_under_gqa(axes, runs):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, 64, 4, 8))
    k, v = (jax.random.normal(x, (2, 64, 2, 8)) for x in keys[1:])  # 2 K/V heads
    want_out, want_grads = _reference(q, k, v)
    devices = jax.devices()[: axes["sequence"] * axes["ulysses"]]
    mesh = sk.make_mesh(axes, devices=devices)
    length = ("sequence", "ulysses")
    args = [jax.device_put(x, NamedSharding(mesh, P(None, length))) for x in (q, k, v)]
    rules = sk.Rules([("length", length)])
    with (
        jax.set_mesh(mesh),
        activation_rules(rules),
        use_attention("usp", axis=("ulysses", "sequence")),
    ):
        compiled = jax.jit(lambda *a: _out_and_grads(*a)).lower(*args).compile()
    out, grads = compiled(*args)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    kinds = {c.kind for c in parse_collectives(compiled.as_text())}
    assert ("collective-permute" in kinds) == (runs in ("usp", "ring"))
    assert ("all-to-all" in kinds) == (runs in ("usp", "ulysses"))


def test_usp_bad_axes_and_sequences_are_sharding_errors():
    with pytest.raises(sk.ShardingError, match="pair of axes"):
        use_attention("usp", axis="sequence")
    with pytest.raises(sk.ShardingError, match="pair of axes"):
        use_attention("ring", axis=("ulysses", "sequence"))
    q, k, v = _qkv(36)  # ring 4 × Ulysses 2: a multiple of lcm(8, 2·4) = 8
    mesh = sk.make_mesh({"sequence": 4, "ulysses": 2})
    with jax.set_mesh(mesh), use_attention("usp", axis=("ulysses", "sequence")):
        with pytest.raises(sk.ShardingError, match="sequence of 32 or 40"):
            causal_attention(q, k, v)
