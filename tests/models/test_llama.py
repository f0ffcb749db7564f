"""Llama (flax.nnx) reference model: its own shapes (GQA), layer layout, size and configs.

The checks both families share (counts, axes, loss, remat, training, sharding) are in
``test_model.py``.
"""

import jax
import pytest
from flax import nnx

import shardkit as sk
from shardkit import models

V = 256  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def name():
    return "llama-tiny"


def test_init_is_param_state_with_expected_shapes(model, boxed, params):
    cfg = model.config
    assert isinstance(boxed, nnx.State) and isinstance(params, nnx.State)
    wq = boxed["layers"]["attn"]["wq"]["kernel"]
    assert isinstance(wq, nnx.Param)
    assert wq.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "kv")
    shapes = jax.tree.map(lambda x: x.shape, params)
    L, d, h, k, hd, f = (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
    )
    assert k < h  # the tiny config exercises grouped-query attention
    assert shapes["embed"]["embedding"] == (V, d)
    assert shapes["head"]["kernel"] == (d, V)
    attn = shapes["layers"]["attn"]
    assert attn["wq"]["kernel"] == (L, d, h, hd)
    assert attn["wk"]["kernel"] == attn["wv"]["kernel"] == (L, d, k, hd)
    assert attn["wo"]["kernel"] == (L, h, hd, d)
    mlp = shapes["layers"]["mlp"]
    assert mlp["gate"]["kernel"] == mlp["up"]["kernel"] == (L, d, f)
    assert mlp["down"]["kernel"] == (L, f, d)
    assert shapes["layers"]["attn_norm"]["scale"] == (L, d)
    assert shapes["norm"]["scale"] == (d,)


def test_apply_full_mha(batch):
    mha = models.get("llama-tiny", n_kv_heads=8)  # no kv repetition
    logits = jax.eval_shape(
        lambda k: mha.apply(sk.unbox(mha.init(k)), batch["inputs"]), jax.random.key(0)
    )
    assert logits.shape == (*batch["inputs"].shape, V)


def test_scan_and_unrolled_agree(model, params, check_unrolled):
    """Unstacking the scanned state gives the unrolled model, with the same loss.

    Unrolled, NNX keeps the layers under ``layers``, indexed by layer number.
    """
    pure = nnx.to_pure_dict(params)
    stacked = pure.pop("layers")
    pure["layers"] = {
        i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.config.n_layers)
    }
    check_unrolled(nnx.State(pure))


def test_llama_7b_size():
    assert abs(models.get("llama-7b").config.param_count() / 6.74e9 - 1) < 0.01


def test_flops_per_token_formula():
    cfg = models.get("llama-7b").config
    nonembed = cfg.param_count() - cfg.vocab * cfg.d_model  # the head counts, the lookup not
    assert cfg.flops_per_token(4096) == 6 * nonembed + 12 * 32 * 4096 * 4096


def test_invalid_configs_are_sharding_errors():
    with pytest.raises(sk.ShardingError, match="n_kv_heads"):
        models.get("llama-tiny", n_kv_heads=3)
    with pytest.raises(sk.ShardingError, match="n_heads"):
        models.get("llama-tiny", n_heads=7)
