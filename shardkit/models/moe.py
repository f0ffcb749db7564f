"""A mixture-of-experts Llama in flax.nnx: Llama's attention, an MoE MLP in every block.

The blocks are Llama's (RMSNorm, RoPE, grouped-query attention) with the SwiGLU MLP
replaced by :class:`shardkit.nn.moe.NnxMoe` (top-k router, capacity, optional shared
experts). The forward returns, next to the logits or the per-token loss, each layer's
router statistics stacked ``[layers, ...]``: the weighted auxiliary losses, which
:class:`~shardkit.models.model.Model` adds to the loss, and the tokens routed and
dropped per expert.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from shardkit.models.config import CONFIGS
  >>> cfg = CONFIGS["moe-tiny"]
  >>> with nnx.use_eager_sharding(False):
  ...     forward = lambda t: MoeLlama(cfg, rngs=nnx.Rngs(0))(t)
  ...     logits, stats = jax.eval_shape(forward, jnp.zeros((2, 8), jnp.int32))
  >>> logits.shape, stats["dropped"].shape
  ((2, 8, 256), (2, 8))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.annotate import axes, constrain
from shardkit.models.config import ModelConfig
from shardkit.models.gpt import LOGITS, RESIDUAL
from shardkit.models.llama import HEAD, Attention, Llama, _rms_norm
from shardkit.nn.loss import chunked_cross_entropy
from shardkit.nn.moe import NnxMoe
from shardkit.nn.rope import rope_tables, rope_tables_at
from shardkit.nn.segments import Segments

__all__ = ["MoeBlock", "MoeLlama"]


@axes({r"^(attn_norm|mlp_norm)/scale$": ("embed",)})
class MoeBlock(nnx.Module):
    """Pre-RMSNorm block: attention, then the MoE MLP; ``(x, stats)``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(config, rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = _rms_norm(config, rngs)
        self.moe = NnxMoe(
            config.moe_spec(),
            config.d_model,
            dtype=config.compute_dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: Segments | None = None
    ):
        x = constrain(x, RESIDUAL)
        x = constrain(x + self.attn(self.attn_norm(x), cos, sin, segments), RESIDUAL)
        valid = None if segments is None else segments.ids != 0  # padding routes nowhere
        y, stats = self.moe(self.mlp_norm(x), valid)
        return constrain(x + y, RESIDUAL), stats


@axes(
    {
        r"^embed/embedding$": ("vocab", "embed"),
        r"^norm/scale$": ("embed",),
        r"^head/kernel$": HEAD,
    }
)
class MoeLlama(Llama):
    """``int32[batch, seq]`` tokens to ``(logits or per-token loss, router stats)``: Llama's
    embedding, norm and head (its ``__init__``), an :class:`MoeBlock` in every layer."""

    block_class = MoeBlock

    def __call__(
        self,
        tokens: jax.Array,
        targets: jax.Array | None = None,
        segments: Segments | None = None,
        **options,
    ):
        """``options``: keyword arguments of every block's call (a subclass's blocks')."""
        cfg = self.config
        x = constrain(self.embed(tokens).astype(cfg.compute_dtype), RESIDUAL)
        if segments is None:
            cos, sin = rope_tables(tokens.shape[-1], cfg.rope_width)
        else:  # packed rows: RoPE at the positions within each document
            cos, sin = rope_tables_at(segments.positions, cfg.rope_width)
        if cfg.scan:
            graphdef, state = nnx.split(self.layers)
            run = self._block_fn(graphdef, cos, sin, segments, **options)
            x, stats = jax.lax.scan(lambda h, layer: run(layer, h), x, state)
        else:
            per_layer = []
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x, s = self._block_fn(graphdef, cos, sin, segments, **options)(state, x)
                per_layer.append(s)
            stats = jax.tree.map(lambda *v: jnp.stack(v), *per_layer)
        x = self.norm(x)
        if targets is not None:
            kernel = self.head.kernel[...].astype(cfg.compute_dtype)
            loss = chunked_cross_entropy(
                x,
                targets,
                lambda w, h: jnp.einsum("...d,dv->...v", h, w),
                weight=kernel,
                weight_axes=HEAD,
                chunks=cfg.loss_chunks,
            )
            return loss, stats
        return constrain(self.head(x).astype(jnp.float32), LOGITS), stats
