"""ModelDims: parameter counts by hand, and the errors a bad declaration gets."""

import jax
import pytest

import shardkit as sk
from shardkit.dims import ModelDims
from shardkit.models import CONFIGS, get


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_counts_match_the_real_parameters(name):
    model = get(name)
    params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
    dims = CONFIGS[name].dims()
    sizes = {
        "/".join(str(k.key) for k in path): leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    assert dims.param_count == sum(sizes.values())
    stack = sum(v for k, v in sizes.items() if k.startswith("layers"))
    assert dims.stack_params == stack


def test_hand_count_gated_gqa_without_biases():
    d = ModelDims(layers=3, d_model=8, n_heads=4, n_kv_heads=2, d_ff=16, vocab=32, gated_mlp=True)
    # q 8x8, k and v 8x4 each, out 8x8; gate/up/down 8x16; two rms norms of 8
    layer = 64 + 32 + 32 + 64 + 3 * 128 + 2 * 8
    assert d.layer_params == layer
    assert d.param_count == 2 * 32 * 8 + 3 * layer + 8
    assert d.ringed_layer_params == (64 + 64 + 64 + 2 * 128 + 128, 128 + 2 * 128)
    assert d.embedding_params == 32 * 8 and d.vocab_tables == 2


def test_hand_count_tied_with_positions_and_biases():
    d = ModelDims(
        layers=1,
        d_model=4,
        n_heads=2,
        n_kv_heads=2,
        d_ff=8,
        vocab=10,
        max_seq=6,
        tied_embedding=True,
        position_table=True,
        biases=True,
        norm="layernorm",
    )
    layer = 4 * 16 + 4 * 4 + (2 * 32 + 8 + 4) + 2 * 8
    assert d.layer_params == layer
    assert d.param_count == 10 * 4 + 6 * 4 + layer + 8
    assert d.embedding_params == 6 * 4 and d.vocab_tables == 1
    assert d.flops_per_token(6) == 6 * (d.param_count - 24) + 12 * 1 * 4 * 6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": 0}, "layers must be a positive int"),
        ({"d_model": 10, "n_heads": 4}, "not divisible by n_heads"),
        ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"norm": "batchnorm"}, "norm is 'layernorm' or 'rmsnorm'"),
        ({"position_table": True}, "needs max_seq"),
        ({"in_projections": 0}, "in_projections must be a positive int"),
        ({"max_seq": "2048"}, "max_seq must be a positive int or None"),
        ({"loss_chunks": 0}, "loss_chunks must be a positive int or None"),
        ({"gated_mlp": "yes"}, "gated_mlp is True or False"),
    ],
)
def test_bad_declarations_name_the_field_and_the_fix(kwargs, match):
    base = dict(layers=2, d_model=8, n_heads=4, n_kv_heads=2, d_ff=16, vocab=32)
    with pytest.raises(sk.ShardingError, match=match) as info:
        ModelDims(**{**base, **kwargs})
    assert "Fix:" in str(info.value)
