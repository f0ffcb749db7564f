"""sk.per_replica: a tied parameter's gradient is all-reduced once, with the same value."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.annotate.constrain import activation_rules, param_rules
from shardkit.report.hlo import parse_collectives

V, D, B, S = 64, 16, 8, 4
TABLE = ("vocab", "embed")
DP = sk.Rules([("batch", "data")])


def tied_loss(table, tokens, *, replicas=True, data_axes=("batch",)):
    """A tied embedding: looked up by the tokens, then used for the logits."""
    if replicas:
        view = sk.per_replica(table, TABLE, data=tokens, data_axes=data_axes)
    else:
        view = sk.ReplicaView(table)
    x = jnp.tanh(view.map(lambda t, ids: jnp.take(t, ids, axis=0), tokens))
    logits = view.map(lambda t, y: jnp.einsum("bsd,vd->bsv", y, t), x)
    return jax.nn.logsumexp(logits, -1).mean()


def inputs():
    table = jax.random.normal(jax.random.key(0), (V, D))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, V)
    return table, tokens


def grad_under(mesh_axes, act, params, *, replicas=True, data_axes=("batch",)):
    """The compiled gradient (its HLO text) and its value on ``mesh_axes``."""
    mesh = sk.make_mesh(mesh_axes)
    table, tokens = inputs()
    table = jax.device_put(table, NamedSharding(mesh, params.spec(TABLE, mesh=mesh)))
    tokens = jax.device_put(tokens, NamedSharding(mesh, act.spec(("batch", "length"))))
    loss = functools.partial(tied_loss, replicas=replicas, data_axes=data_axes)
    fn = jax.jit(jax.grad(loss))
    with jax.set_mesh(mesh), activation_rules(act), param_rules(params):
        compiled = fn.lower(table, tokens).compile()
        return compiled.as_text(), compiled(table, tokens)


def table_all_reduces(hlo):
    """How many [V, D] buffers the program all-reduces."""
    return sum(c.shapes.count((V, D)) for c in parse_collectives(hlo) if c.kind == "all-reduce")


def test_plain_call_without_a_mesh():
    table, tokens = inputs()
    view = sk.per_replica(table, TABLE, data=tokens)
    assert view.n == 1 and view.value is table
    np.testing.assert_allclose(tied_loss(table, tokens), tied_loss(table, tokens, replicas=False))


def test_data_parallel_all_reduces_the_tied_gradient_once():
    hlo, grad = grad_under({"data": 8}, DP, sk.Rules([]))
    assert table_all_reduces(hlo) == 1
    # The plain program all-reduces the lookup's and the logits' partial sums apart.
    plain_hlo, plain = grad_under({"data": 8}, DP, sk.Rules([]), replicas=False)
    assert table_all_reduces(plain_hlo) == 2
    # The replica copies cost no communication of their own: half the bytes, one kind.
    ops, plain_ops = parse_collectives(hlo), parse_collectives(plain_hlo)
    assert {c.kind for c in ops} == {"all-reduce"}
    assert sum(c.wire_bytes for c in ops) <= 0.6 * sum(c.wire_bytes for c in plain_ops)
    np.testing.assert_allclose(grad, plain, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, jax.grad(tied_loss)(*inputs()), rtol=1e-5, atol=1e-7)


def test_only_the_batch_axes_that_leave_the_parameter_replicated():
    # Batch over data x fsdp, the table split over fsdp: one copy per 'data' replica.
    act, params = sk.Rules([("batch", ("data", "fsdp"))]), sk.Rules([("vocab", "fsdp")])
    mesh = sk.make_mesh({"data": 2, "fsdp": 4})
    with jax.set_mesh(mesh), activation_rules(act), param_rules(params):
        view = sk.per_replica(inputs()[0], TABLE, data=inputs()[1])
    assert view.axes == ("data",) and view.n == 2 and view.value.shape == (2, V, D)
    assert view.value.sharding.spec == P("data", "fsdp", None)
    _, grad = grad_under({"data": 2, "fsdp": 4}, act, params)
    np.testing.assert_allclose(grad, jax.grad(tied_loss)(*inputs()), rtol=1e-5, atol=1e-7)


def test_context_parallel_replicas_are_batch_and_length_blocks():
    # Batch over data, length over sequence: 2 x 4 replicas, each a block of tokens.
    act = sk.Rules([("batch", "data"), ("length", "sequence")])
    args = {"data": 2, "sequence": 4}, act, sk.Rules([])
    hlo, grad = grad_under(*args, data_axes=("batch", "length"))
    assert table_all_reduces(hlo) == 1
    plain_hlo, _ = grad_under(*args, replicas=False)
    assert table_all_reduces(plain_hlo) >= 2  # 4 here: per use, and per mesh axis
    np.testing.assert_allclose(grad, jax.grad(tied_loss)(*inputs()), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "mesh_axes, act, params, explicit",
    [
        ({"fsdp": 8}, sk.Rules([("batch", "fsdp")]), sk.Rules([("vocab", "fsdp")]), False),
        ({"data": 8}, sk.Rules([]), sk.Rules([]), False),  # batch not sharded
        ({"data": 8}, DP, sk.Rules([]), True),  # Explicit axes: JAX's types decide
    ],
    ids=["sharded-like-the-batch", "batch-not-sharded", "explicit-mesh"],
)
def test_no_replica_axis(mesh_axes, act, params, explicit):
    mesh = sk.make_mesh(mesh_axes, explicit=explicit)
    with jax.set_mesh(mesh), activation_rules(act), param_rules(params):
        view = sk.per_replica(jnp.ones((V, D)), TABLE, data=inputs()[1])
    assert view.n == 1 and view.axes == ()


def test_unknown_or_explicit_parameter_layout_is_left_alone():
    table, tokens = inputs()
    with jax.set_mesh(sk.make_mesh({"data": 8})), activation_rules(DP):
        assert sk.per_replica(table, TABLE, data=tokens).n == 1  # no parameter rules
    auto_data = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Explicit)
    )
    with jax.set_mesh(auto_data), activation_rules(DP), param_rules(sk.Rules([("embed", "model")])):
        assert sk.per_replica(jnp.ones((V, D)), TABLE, data=tokens).n == 1


def test_map_merges_pytrees_back_to_the_batch():
    mesh = sk.make_mesh({"data": 8})
    with jax.set_mesh(mesh), activation_rules(DP), param_rules(sk.Rules([])):

        def f(table, tokens):
            view = sk.per_replica(table, TABLE, data=tokens)
            return view.map(lambda t, ids: {"x": t[ids], "ids": ids}, tokens)

        out = jax.jit(f)(*inputs())
    table, tokens = inputs()
    np.testing.assert_array_equal(out["ids"], tokens)
    np.testing.assert_array_equal(out["x"], table[tokens])
