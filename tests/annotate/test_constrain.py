import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import context
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


@sk.axes({"kernel": ("embed", "mlp")})
class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(x.shape[-1], use_bias=False)(x)), None


class _Stack(nn.Module):
    """4 layers of a 128 × 128 kernel in a layer scan, no remat: the forward saves what
    the backward reads that is not a slice of the stacked kernel itself."""

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            _Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=4,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return layers()(x, None)[0]


def _stack():
    """The stack, its parameters and an input of 64 rows."""
    model, x = _Stack(), jnp.ones((64, 128))
    return model, sk.unbox(model.init(jax.random.key(0), x)), x


def _grad_temp_bytes(param_rules) -> int:
    """The compiled temp of the stack's gradient over 8 devices, its batch on 'data'."""
    mesh = sk.make_mesh({"data": 8})
    model, params, x = _stack()
    with jax.set_mesh(mesh), context.using(param_rules=param_rules):
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        grad = jax.jit(jax.grad(lambda p, x: model.apply(p, x).sum()))
        return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_a_replicated_parameter_is_not_pinned_into_a_saved_copy():
    # Under data parallelism every kernel is replicated: pinning it gathers nothing, and
    # inside the scan the pin's output would be a new value the forward saves, one more
    # copy of the 4 × 128 × 128 × 4 B stack (256 KiB). The step holds what it holds with
    # parameters not pinned at all (no rules).
    replicated = sk.Rules([("embed", None), ("mlp", None)])
    assert _grad_temp_bytes(replicated) == _grad_temp_bytes(None)


def test_a_sharded_parameter_is_still_pinned():
    # Sharded over 'data' (fsdp), the pin gathers each layer's kernel inside the scan.
    mesh = sk.make_mesh({"data": 8})
    model, params, x = _stack()
    with jax.set_mesh(mesh), context.using(param_rules=sk.Rules([("mlp", "data")])):
        jaxpr = jax.make_jaxpr(lambda p: model.apply(p, x))(params)
    assert "sharding_constraint" in str(jaxpr)
