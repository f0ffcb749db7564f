"""A DeepSeek-V2-style model in flax.nnx: latent attention and fine-grained + shared experts.

The MoE Llama (:mod:`shardkit.models.moe`) with each block's grouped-query attention
replaced by multi-head latent attention (:class:`shardkit.nn.mla.NnxMla`: a K/V latent
shared by the heads, a query latent, decoupled RoPE of ``rope_dim``). The experts are
:class:`shardkit.nn.moe.NnxMoe`'s (many narrow routed experts, shared ones beside).
:func:`latent_cache` runs the stack and returns every layer's K/V latent, what a decoder
caches and what the two tensor-parallel layouts keep differently per device.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from shardkit.models import get
  >>> model = get("deepseek-tiny")
  >>> params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
  >>> cache = lambda p, t: latent_cache(model, p, t)
  >>> jax.eval_shape(cache, params, jnp.zeros((2, 8), jnp.int32)).shape
  (2, 2, 8, 32)
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from shardkit.annotate import axes, constrain
from shardkit.models.config import ModelConfig
from shardkit.models.gpt import RESIDUAL
from shardkit.models.llama import _rms_norm
from shardkit.models.moe import MoeLlama
from shardkit.nn.mla import NnxMla
from shardkit.nn.moe import NnxMoe
from shardkit.nn.segments import Segments

__all__ = ["DeepseekBlock", "DeepseekLlama", "latent_cache"]


@axes({r"^(attn_norm|mlp_norm)/scale$": ("embed",)})
class DeepseekBlock(nnx.Module):
    """Pre-RMSNorm block: latent attention, then the MoE MLP; ``(x, stats)``.

    With ``latents=True`` the stats carry the attention's K/V latent too (``"latent"``).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dtypes = {"dtype": config.compute_dtype, "param_dtype": config.param_dtype}
        self.attn_norm = _rms_norm(config, rngs)
        self.attn = NnxMla(config.mla_spec(), config.d_model, rngs=rngs, **dtypes)
        self.mlp_norm = _rms_norm(config, rngs)
        self.moe = NnxMoe(config.moe_spec(), config.d_model, rngs=rngs, **dtypes)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segments: Segments | None = None,
        latents: bool = False,
    ):
        x = constrain(x, RESIDUAL)
        y, latent = self.attn(self.attn_norm(x), cos, sin, segments)
        x = constrain(x + y, RESIDUAL)
        valid = None if segments is None else segments.ids != 0  # padding routes nowhere
        y, stats = self.moe(self.mlp_norm(x), valid)
        if latents:
            stats = {**stats, "latent": latent}
        return constrain(x + y, RESIDUAL), stats


@axes(
    {
        r"^embed/embedding$": ("vocab", "embed"),
        r"^norm/scale$": ("embed",),
        r"^head/kernel$": ("embed", "vocab"),
    }
)
class DeepseekLlama(MoeLlama):
    """``int32[batch, seq]`` tokens to ``(logits or per-token loss, router stats)``, a
    :class:`DeepseekBlock` in every layer (RoPE tables of ``config.rope_dim``)."""

    block_class = DeepseekBlock


def latent_cache(model: Any, params: Any, tokens: jax.Array) -> jax.Array:
    """Every layer's normalised K/V latent on ``tokens``: ``[layers, batch, seq, kv_latent]``.

    ``model``: a DeepSeek reference model (``models.get("deepseek-tiny")``); ``params``:
    ``sk.unbox(model.init(key))``. Jit it under a plan to see where the latent lives: the
    output's per-device bytes are the latent's activation memory per device.
    """
    module = nnx.merge(nnx.split(model.module)[0], params)
    _, stats = module(tokens, latents=True)
    return stats["latent"]
