import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import shardkit as sk
from shardkit import errors

MLP_AXES = {"up/kernel": ("embed", "mlp"), "down/kernel": ("mlp", "embed"), "bias$": (None,)}


@sk.axes(MLP_AXES)
class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="up")(x)
        return nn.Dense(8, name="down")(nn.relu(h))


@sk.axes(MLP_AXES)
class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def linen_params():
    return LinenMlp().init(jax.random.key(0), jnp.ones((2, 8)))["params"]


def nnx_state():
    with nnx.use_eager_sharding(False):
        return nnx.state(NnxMlp(nnx.Rngs(0)), nnx.Param)


def test_linen_decorator_boxes_params_and_keeps_class_name():
    axes = sk.logical_axes(linen_params())
    assert axes["up"]["kernel"] == ("embed", "mlp")
    assert axes["down"]["kernel"] == ("mlp", "embed")
    assert axes["down"]["bias"] == (None,)
    assert LinenMlp.__name__ == "LinenMlp"

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return LinenMlp()(x)

    params = Outer().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    assert list(params) == ["LinenMlp_0"]  # auto-naming unchanged by the decorator
    y = Outer().apply({"params": sk.unbox(params)}, jnp.ones((2, 8)))
    assert y.shape == (2, 8)


def test_nnx_decorator_sets_out_sharding():
    state = nnx_state()
    assert state["up"]["kernel"].get_metadata()["out_sharding"] == ("embed", "mlp")
    axes = sk.logical_axes(state)
    assert axes["down"]["kernel"] == ("mlp", "embed")


# MaxText-style: two rules for 'embed'. 'mlp' claims fsdp first, so every kernel's
# 'embed' dimension falls through to its second rule (Flax NNX would keep the last rule
# for a name and linen the first; shardkit resolves both models the same way).
MAXTEXT_RULES = sk.Rules(
    [("batch", "data"), ("mlp", "fsdp"), ("embed", "fsdp"), ("embed", "tensor")]
)


def specs(tree, mesh):
    infos, _ = sk.annotate.describe_leaves(tree)
    return {i.path: MAXTEXT_RULES.spec(i.axes, i.shape, mesh, i.path) for i in infos}


def test_linen_and_nnx_get_identical_specs_from_the_same_rules():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    linen, nnx_ = specs(linen_params(), mesh), specs(nnx_state(), mesh)
    assert linen == nnx_
    P = jax.sharding.PartitionSpec
    assert linen["up/kernel"] == P("tensor", "fsdp")  # embed fell through to 'tensor'
    assert linen["down/kernel"] == P("fsdp", "tensor")


def test_flax_native_annotations_are_read_as_is():
    class Native(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(4, kernel_init=init)(x)

    p = Native().init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    assert sk.logical_axes(p)["Dense_0"]["kernel"] == ("embed", "mlp")
    with nnx.use_eager_sharding(False):
        lin = nnx.Linear(
            3,
            4,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            rngs=nnx.Rngs(0),
        )
    assert sk.logical_axes(nnx.state(lin))["kernel"] == ("embed", "mlp")


def test_decorator_rank_mismatch_and_ambiguity():
    @sk.axes({"kernel": ("embed", "mlp", "heads")})
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    with pytest.raises(errors.RankMismatchError, match=r"Bad: Dense_0/kernel: shape \(3, 4\)"):
        Bad().init(jax.random.key(0), jnp.ones((1, 3)))

    @sk.axes({"kernel": ("embed", "mlp"), "Dense_0/kernel": ("mlp", "embed")})
    class Ambiguous(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    with pytest.raises(errors.AmbiguousAxesError, match="Dense_0/kernel"):
        Ambiguous().init(jax.random.key(0), jnp.ones((1, 3)))


def test_decorator_rejects_non_modules():
    with pytest.raises(errors.ShardingError, match="PathAxes"):
        sk.axes({"w": ("embed",)})(dict)


def test_scan_adds_layers_axis():
    @sk.axes({"kernel": ("embed", "mlp")})
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.Dense(8, use_bias=False)(x), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=3,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            return scan()(x, None)[0]

    p = Stack().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    assert sk.logical_axes(p)["ScanBlock_0"]["Dense_0"]["kernel"] == ("layers", "embed", "mlp")
