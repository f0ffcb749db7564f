"""GPT-2 (flax.linen) reference model: its own shapes, layer layout, size and limits.

The checks both families share (counts, axes, loss, remat, training, sharding) are in
``test_model.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit import models

V = 256  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def name():
    return "gpt-tiny"


def test_init_is_boxed_with_expected_shapes(model, boxed):
    cfg = model.config
    assert isinstance(boxed["wte"]["embedding"], nn.LogicallyPartitioned)
    shapes = jax.tree.map(lambda x: x.shape, sk.unbox(boxed))
    L, d, h, hd = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim
    assert shapes["wte"]["embedding"] == (V, d)
    assert shapes["wpe"]["embedding"] == (cfg.max_seq, d)
    attn = shapes["layers"]["attn"]
    assert attn["qkv"]["kernel"] == (L, d, 3, h, hd)
    assert attn["qkv"]["bias"] == (L, 3, h, hd)
    assert attn["out"]["kernel"] == (L, h, hd, d)
    assert shapes["layers"]["mlp"]["up"]["kernel"] == (L, d, cfg.d_ff)
    assert shapes["layers"]["mlp"]["down"]["kernel"] == (L, cfg.d_ff, d)
    assert shapes["ln_f"]["scale"] == (d,)


def test_scan_and_unrolled_agree(model, params, check_unrolled):
    """Unstacking the scanned params gives the unrolled model, with the same loss.

    Unrolled, linen names each layer's submodule ``layers_{i}``.
    """
    unrolled = {k: v for k, v in params.items() if k != "layers"}
    for i in range(model.config.n_layers):
        unrolled[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    check_unrolled(unrolled)


def test_gpt_small_and_7b_sizes():
    assert models.get("gpt-small").config.param_count() == 124_475_904
    assert abs(models.get("gpt-7b").config.param_count() / 6.66e9 - 1) < 0.01


def test_flops_per_token_formula():
    cfg = models.get("gpt-small").config
    nonembed = cfg.param_count() - cfg.max_seq * cfg.d_model
    assert cfg.flops_per_token(512) == 6 * nonembed + 12 * 12 * 768 * 512


def test_too_long_sequence_is_a_sharding_error(model, params):
    with pytest.raises(sk.ShardingError, match="max_seq"):
        model.apply(params, jnp.zeros((1, model.config.max_seq + 1), jnp.int32))
