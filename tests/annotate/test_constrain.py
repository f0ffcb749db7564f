import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.annotate import activation_rules

RULES = sk.Rules([("batch", "data"), ("embed", "tensor")])


def step(x):
    y = jnp.tanh(x) * 2
    return sk.constrain(y, ("batch", "embed")).sum(axis=0)


def test_noop_without_mesh_or_rules():
    x = jnp.ones((8, 4))
    assert sk.constrain(x, ("batch", "embed")) is x
    with activation_rules(RULES):
        assert sk.constrain(x, ("batch", "embed")) is x


def _compile_and_run(explicit):
    mesh = sk.make_mesh({"data": 4, "tensor": 2}, explicit=explicit)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh), activation_rules(RULES):
        compiled = jax.jit(step).lower(x).compile()
        out = compiled(x)
    assert out.shape == (4,)
    return compiled.as_text(), out


def test_compiles_under_auto_mesh():
    text, _ = _compile_and_run(explicit=False)
    assert "all-reduce" in text  # the batch sum crosses 'data'


def test_compiles_under_explicit_mesh():
    # Explicit axes: constrain reshards; the sum over 'batch' keeps 'embed' on tensor.
    text, out = _compile_and_run(explicit=True)
    assert "all-reduce" in text
    assert out.sharding.spec == P("tensor")


def test_constraint_changes_the_layout():
    mesh = sk.make_mesh({"data": 4, "tensor": 2})
    x = jnp.ones((8, 4))
    with jax.set_mesh(mesh), activation_rules(RULES):
        y = jax.jit(lambda x: sk.constrain(x * 2, ("batch", "embed")))(x)
    assert y.sharding.spec == P("data", "tensor")
