"""GPT-2 in flax.linen, every parameter annotated with ``@sk.axes``.

Decoder-only: tied token embedding (``logits = x @ wte.T``), learned positions,
pre-LayerNorm blocks (causal multi-head attention, GELU MLP, biases everywhere),
final LayerNorm. With ``config.scan`` the blocks are one ``nn.scan`` whose
parameters carry a leading ``"layers"`` logical axis; otherwise they are
``layers_0 ... layers_{L-1}``.

Also home of the pieces both reference models share: the activation axes and
``checkpoint_policy``.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from shardkit.models.config import CONFIGS
  >>> tokens = jnp.zeros((1, 4), jnp.int32)
  >>> params = jax.eval_shape(GPT(CONFIGS["gpt-tiny"]).init, jax.random.key(0), tokens)
  >>> sk.logical_axes(params)["params"]["layers"]["attn"]["qkv"]["kernel"]
  ('layers', 'embed', None, 'heads', 'kv')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardkit import errors
from shardkit.annotate import axes, constrain
from shardkit.models.config import ModelConfig
from shardkit.nn.attention import causal_attention
from shardkit.nn.loss import chunked_cross_entropy, head_view
from shardkit.nn.replicas import per_replica
from shardkit.nn.segments import Segments
from shardkit.nn.tsp import SAVED_NAME, TspDot, active_axis
from shardkit.nn.tsp_head import vocab_ring_lookup

__all__ = [
    "Block",
    "CausalSelfAttention",
    "GPT",
    "HEADS",
    "HIDDEN",
    "INIT_STD",
    "LN_EPS",
    "LOGITS",
    "Mlp",
    "RESIDUAL",
    "TABLE",
    "checkpoint_policy",
]

# Logical axes of the activations (resolved by the recipe's activation rules).
RESIDUAL = ("batch", "length", "embed")
HEADS = ("batch", "length", "heads", "kv")
HIDDEN = ("batch", "length", "mlp")
LOGITS = ("batch", "length", "vocab")
TABLE = ("vocab", "embed")

INIT_STD = 0.02
LN_EPS = 1e-5


def checkpoint_policy(remat: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for a ``ModelConfig.remat`` value.

    ``"full"`` saves nothing (``None``: recompute the whole block); ``"save_dots"``
    keeps matmul results that have no batch dimension.

    Example:
      >>> checkpoint_policy("full") is None
      True
    """
    if remat == "save_dots":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(SAVED_NAME),
        )
    return None


@axes(
    {
        r"^qkv/kernel$": ("embed", None, "heads", "kv"),
        r"^qkv/bias$": (None, "heads", "kv"),
        r"^out/kernel$": ("heads", "kv", "embed"),
        r"^out/bias$": ("embed",),
    }
)
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    Kernels: qkv ``(embed, 3, heads, kv)``, out ``(heads, kv, embed)``.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> attn = CausalSelfAttention(CONFIGS["gpt-tiny"])
      >>> p = jax.eval_shape(attn.init, jax.random.key(0), jnp.ones((1, 4, 64)))
      >>> p["params"]["qkv"]["kernel"].names
      ('embed', None, 'heads', 'kv')
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, segments: Segments | None = None) -> jax.Array:
        cfg = self.config

        # One fused projection (as GPT-2's c_attn): under tensor parallelism the input
        # gradient of q, k and v is then summed locally and all-reduced once, not thrice.
        qkv = nn.DenseGeneral(
            (3, cfg.n_heads, cfg.head_dim),
            axis=-1,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(INIT_STD),
            dot_general=TspDot(("embed", None, "heads", "kv")),  # a ring under tsp
            name="qkv",
        )(x)
        qkv = constrain(qkv, ("batch", "length", None, "heads", "kv"))
        q, k, v = (constrain(qkv[:, :, i], HEADS) for i in range(3))
        y = constrain(causal_attention(q, k, v, segments=segments), HEADS)
        return nn.DenseGeneral(
            cfg.d_model,
            axis=(-2, -1),
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(INIT_STD / math.sqrt(2 * cfg.n_layers)),
            dot_general=TspDot(("heads", "kv", "embed")),
            name="out",
        )(y)


@axes(
    {
        r"^up/kernel$": ("embed", "mlp"),
        r"^up/bias$": ("mlp",),
        r"^down/kernel$": ("mlp", "embed"),
        r"^down/bias$": ("embed",),
    }
)
class Mlp(nn.Module):
    """GELU MLP: ``down(gelu(up(x)))``; kernels ``(embed, mlp)`` and ``(mlp, embed)``.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> p = jax.eval_shape(Mlp(CONFIGS["gpt-tiny"]).init, jax.random.key(0), jnp.ones((1, 4, 64)))
      >>> p["params"]["down"]["kernel"].names
      ('mlp', 'embed')
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = nn.Dense(
            cfg.d_ff,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(INIT_STD),
            dot_general=TspDot(("embed", "mlp")),
            name="up",
        )(x)
        h = constrain(nn.gelu(h), HIDDEN)
        return nn.Dense(
            cfg.d_model,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(INIT_STD / math.sqrt(2 * cfg.n_layers)),
            dot_general=TspDot(("mlp", "embed")),
            name="down",
        )(h)


@axes({r"^ln_[12]/(scale|bias)$": ("embed",)})
class Block(nn.Module):
    """Pre-LayerNorm transformer block; ``(x, segments) -> (x, None)`` so ``nn.scan`` can
    stack it (``segments``: packed rows' ``Segments``, the same for every layer).

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> block = Block(CONFIGS["gpt-tiny"])
      >>> x = jnp.ones((1, 4, 64))
      >>> y, _ = jax.eval_shape(lambda k: block.apply(block.init(k, x), x), jax.random.key(0))
      >>> y.shape
      (1, 4, 64)
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, segments: Segments | None = None) -> tuple[jax.Array, None]:
        cfg = self.config
        norm = dict(epsilon=LN_EPS, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
        x = constrain(x, RESIDUAL)
        x = x + CausalSelfAttention(cfg, name="attn")(
            nn.LayerNorm(**norm, name="ln_1")(x), segments
        )
        x = constrain(x, RESIDUAL)
        x = x + Mlp(cfg, name="mlp")(nn.LayerNorm(**norm, name="ln_2")(x))
        return constrain(x, RESIDUAL), None


@axes(
    {
        r"^wte/embedding$": TABLE,
        r"^wpe/embedding$": (None, "embed"),
        r"^ln_f/(scale|bias)$": ("embed",),
    }
)
class GPT(nn.Module):
    """GPT-2 language model: ``int32[batch, seq]`` tokens to ``f32[batch, seq, vocab]`` logits.

    Example:
      >>> import shardkit as sk
      >>> from shardkit.models.config import CONFIGS
      >>> model = GPT(CONFIGS["gpt-tiny"])
      >>> tokens = jnp.zeros((2, 8), jnp.int32)
      >>> forward = lambda key: model.apply(sk.unbox(model.init(key, tokens)), tokens)
      >>> jax.eval_shape(forward, jax.random.key(0)).shape
      (2, 8, 256)
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        targets: jax.Array | None = None,
        segments: Segments | None = None,
    ) -> jax.Array:
        """Logits ``f32[batch, seq, vocab]``; with ``targets``, the cross-entropy of each
        token ``f32[batch, seq]`` instead, from ``sk.chunked_cross_entropy`` (the logits
        are never held whole). ``segments``: packed rows (positions restart per document,
        attention stays inside each one)."""
        cfg = self.config
        seq = tokens.shape[-1]
        if seq > cfg.max_seq:
            raise errors.ShardingError(
                f"GPT: sequence length {seq} exceeds max_seq {cfg.max_seq} (rows of the "
                f"position table).\nFix: get(..., max_seq={seq}) or shorter sequences."
            )
        embed = dict(dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
        wte = nn.Embed(
            cfg.vocab,
            cfg.d_model,
            embedding_init=nn.initializers.normal(INIT_STD),
            name="wte",
            **embed,
        )
        wpe = nn.Embed(
            cfg.max_seq,
            cfg.d_model,
            embedding_init=nn.initializers.normal(INIT_STD / 2),
            name="wpe",
            **embed,
        )
        # The embedding is tied: read by the lookup and by the logits. One replica view
        # for both uses makes data parallelism all-reduce its gradient once, not twice.
        weight = wte.embedding.astype(cfg.compute_dtype)
        table = per_replica(weight, TABLE, data=tokens, data_axes=("batch", "length"))
        if targets is not None and table.n > 1:
            # The chunked head reads the table in its own layout (see head_view). Where
            # the lookup has replicas, it reads that view too, so the two uses'
            # gradients add up on each replica before one reduction.
            table = head_view(weight, TABLE, data=targets, reuse=table)
        x = vocab_ring_lookup(weight, tokens, TABLE) if table.n == 1 else None  # TSP's ring
        if x is None:
            x = table.map(lambda t, ids: jnp.take(t, ids, axis=0), tokens)
        x = x + wpe(jnp.arange(seq)[None, :] if segments is None else segments.positions)
        x = constrain(x.astype(cfg.compute_dtype), RESIDUAL)

        block: Any = Block
        if cfg.remat != "none":
            block = nn.remat(Block, prevent_cse=not cfg.scan, policy=checkpoint_policy(cfg.remat))
        if cfg.scan:
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
                in_axes=nn.broadcast,  # the segments: every layer reads the same
            )
            x, _ = stack(cfg, name="layers")(x, segments)
        else:
            for i in range(cfg.n_layers):
                x, _ = block(cfg, name=f"layers_{i}")(x, segments)

        x = nn.LayerNorm(epsilon=LN_EPS, name="ln_f", **embed)(x)

        def head(t: jax.Array, y: jax.Array) -> jax.Array:
            return jnp.einsum("...d,vd->...v", y, t)

        if targets is not None:
            if table.n == 1 and active_axis() is not None:  # TSP: a ring of vocab shards
                return chunked_cross_entropy(
                    x, targets, head, weight=weight, weight_axes=TABLE, chunks=cfg.loss_chunks
                )
            if table.n == 1:  # the head's layout, here, after the layers
                table = head_view(weight, TABLE, data=targets, reuse=table)
            return chunked_cross_entropy(x, targets, head, weight=table, chunks=cfg.loss_chunks)
        return constrain(table.map(head, x).astype(jnp.float32), LOGITS)
