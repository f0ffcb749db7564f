"""Llama in flax.nnx, every parameter annotated with ``@sk.axes``.

RMSNorm, rotary position embeddings (half-split form), SwiGLU MLP, grouped-query
attention (``n_kv_heads`` key/value heads, each read by ``n_heads / n_kv_heads``
query heads), untied
output head, no biases. With ``config.scan`` the blocks are built once under
``nnx.vmap`` (parameters get a leading ``"layers"`` logical axis) and run with
``jax.lax.scan`` over their stacked state; otherwise they are an ``nnx.List``.

Build NNX modules with ``nnx.use_eager_sharding(False)``: the annotations are
logical names, which flax would otherwise try to apply as mesh axes at creation.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from flax import nnx
  >>> from shardkit.models.config import CONFIGS
  >>> cfg = CONFIGS["llama-tiny"]
  >>> with nnx.use_eager_sharding(False):   # abstract: shapes and metadata only
  ...     model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  ...     forward = lambda tokens: Llama(cfg, rngs=nnx.Rngs(0))(tokens)
  ...     logits = jax.eval_shape(forward, jnp.zeros((2, 8), jnp.int32))
  >>> sk.logical_axes(nnx.state(model, nnx.Param))["layers"]["attn"]["wk"]["kernel"]
  ('layers', 'embed', 'kv_heads', 'kv')
  >>> logits.shape
  (2, 8, 256)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.annotate import axes, constrain
from shardkit.models.config import ModelConfig
from shardkit.models.gpt import HEADS, HIDDEN, LOGITS, RESIDUAL, checkpoint_policy
from shardkit.nn.attention import causal_attention
from shardkit.nn.loss import chunked_cross_entropy
from shardkit.nn.rope import apply_rope, rope_tables, rope_tables_at
from shardkit.nn.segments import Segments
from shardkit.nn.tsp import TspDot, TspEinsum
from shardkit.nn.tsp_head import vocab_ring_lookup

__all__ = [
    "Attention",
    "Block",
    "HEAD",
    "INIT_STD",
    "Llama",
    "Mlp",
]

_KV_HEADS = ("batch", "length", "kv_heads", "kv")
HEAD = ("embed", "vocab")
INIT_STD = 0.02
_NORM_EPS = 1e-5


def _normal() -> nnx.Initializer:
    return nnx.initializers.normal(INIT_STD)


@axes(
    {
        r"^wq/kernel$": ("embed", "heads", "kv"),
        r"^w[kv]/kernel$": ("embed", "kv_heads", "kv"),
        r"^wo/kernel$": ("heads", "kv", "embed"),
    }
)
class Attention(nnx.Module):
    """Grouped-query causal attention with RoPE; k/v have ``n_kv_heads`` heads.

    Kernels: q ``(embed, heads, kv)``, k/v ``(embed, kv_heads, kv)``, out ``(heads, kv, embed)``.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> with nnx.use_eager_sharding(False):
      ...     attn = nnx.eval_shape(lambda: Attention(CONFIGS["llama-tiny"], rngs=nnx.Rngs(0)))
      >>> attn.wk.kernel.shape, attn.wk.kernel.out_sharding
      ((64, 8, 4), ('embed', 'kv_heads', 'kv'))
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        d, hd = cfg.d_model, cfg.head_dim
        proj = functools.partial(
            nnx.Einsum,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=_normal(),
            rngs=rngs,
        )
        # einsum_op: a weight-shard ring under the tsp recipe, jnp.einsum otherwise.
        q_op, kv_op = TspEinsum(("embed", "heads", "kv")), TspEinsum(("embed", "kv_heads", "kv"))
        self.wq = proj("bsd,dhk->bshk", (d, cfg.n_heads, hd), einsum_op=q_op)
        self.wk = proj("bsd,dhk->bshk", (d, cfg.n_kv_heads, hd), einsum_op=kv_op)
        self.wv = proj("bsd,dhk->bshk", (d, cfg.n_kv_heads, hd), einsum_op=kv_op)
        self.wo = proj(
            "bshk,hkd->bsd", (cfg.n_heads, hd, d), einsum_op=TspEinsum(("heads", "kv", "embed"))
        )

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: Segments | None = None
    ) -> jax.Array:
        q = apply_rope(constrain(self.wq(x), HEADS), cos, sin)
        k = apply_rope(constrain(self.wk(x), _KV_HEADS), cos, sin)
        v = constrain(self.wv(x), _KV_HEADS)
        # GQA: K/V keep their n_kv_heads; causal_attention groups the query heads (ring
        # attention moves n_kv_heads/n_heads of the bytes) or repeats them (dense).
        return self.wo(constrain(causal_attention(q, k, v, segments=segments), HEADS))


@axes({r"^(gate|up)/kernel$": ("embed", "mlp"), r"^down/kernel$": ("mlp", "embed")})
class Mlp(nnx.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, no biases.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> with nnx.use_eager_sharding(False):
      ...     mlp = nnx.eval_shape(lambda: Mlp(CONFIGS["llama-tiny"], rngs=nnx.Rngs(0)))
      >>> mlp.down.kernel.out_sharding
      ('mlp', 'embed')
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=_normal(),
            rngs=rngs,
        )
        ring_in, ring_out = TspDot(("embed", "mlp")), TspDot(("mlp", "embed"))  # tsp recipe
        self.gate = linear(cfg.d_model, cfg.d_ff, dot_general=ring_in)
        self.up = linear(cfg.d_model, cfg.d_ff, dot_general=ring_in)
        self.down = linear(cfg.d_ff, cfg.d_model, dot_general=ring_out)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(nnx.silu(self.gate(x)) * self.up(x), HIDDEN)
        return self.down(h)


def _rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        cfg.d_model,
        epsilon=_NORM_EPS,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


@axes({r"^(attn_norm|mlp_norm)/scale$": ("embed",)})
class Block(nnx.Module):
    """Pre-RMSNorm transformer block: attention then SwiGLU, each residual.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> with nnx.use_eager_sharding(False):
      ...     block = lambda x: Block(CONFIGS["llama-tiny"], rngs=nnx.Rngs(0))(x, *rope_tables(4, 4))
      ...     y = jax.eval_shape(block, jnp.ones((1, 4, 64)))
      >>> y.shape
      (1, 4, 64)
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(config, rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = _rms_norm(config, rngs)
        self.mlp = Mlp(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: Segments | None = None
    ) -> jax.Array:
        x = constrain(x, RESIDUAL)
        x = constrain(x + self.attn(self.attn_norm(x), cos, sin, segments), RESIDUAL)
        return constrain(x + self.mlp(self.mlp_norm(x)), RESIDUAL)


@axes(
    {
        r"^embed/embedding$": ("vocab", "embed"),
        r"^norm/scale$": ("embed",),
        r"^head/kernel$": HEAD,
    }
)
class Llama(nnx.Module):
    """Llama language model: ``int32[batch, seq]`` tokens to ``f32[batch, seq, vocab]`` logits.

    Example:
      >>> from shardkit.models.config import CONFIGS
      >>> with nnx.use_eager_sharding(False):
      ...     model = nnx.eval_shape(lambda: Llama(CONFIGS["llama-tiny"], rngs=nnx.Rngs(0)))
      >>> model.head.kernel.out_sharding
      ('embed', 'vocab')
    """

    #: The block of every layer (a subclass swaps it: the MoE Llama's MoE block).
    block_class: type[nnx.Module] = Block

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=_normal(),
            rngs=rngs,
        )
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_layers(rngs: nnx.Rngs) -> nnx.Module:
                return self.block_class(cfg, rngs=rngs)

            self.layers = make_layers(rngs)
        else:
            self.layers = nnx.List([self.block_class(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = _rms_norm(cfg, rngs)
        self.head = nnx.Linear(
            cfg.d_model,
            cfg.vocab,
            use_bias=False,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=_normal(),
            rngs=rngs,
        )

    def _block_fn(
        self, graphdef: nnx.GraphDef, cos: jax.Array, sin: jax.Array, segments=None, **options
    ):
        """``(state, x) -> x`` running one block, wrapped in ``jax.checkpoint`` per ``remat``;
        ``options``: keyword arguments of the block's call (none for Llama's own)."""

        def run(state: nnx.State, x: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state)(x, cos, sin, segments, **options)

        cfg = self.config
        if cfg.remat == "none":
            return run
        return jax.checkpoint(run, prevent_cse=not cfg.scan, policy=checkpoint_policy(cfg.remat))

    def __call__(
        self,
        tokens: jax.Array,
        targets: jax.Array | None = None,
        segments: Segments | None = None,
    ) -> jax.Array:
        """Logits ``f32[batch, seq, vocab]``; with ``targets``, the cross-entropy of each
        token ``f32[batch, seq]`` instead, from ``sk.chunked_cross_entropy`` (the logits
        are never held whole). ``segments``: packed rows (RoPE at the positions within
        each document, attention inside each one)."""
        cfg = self.config
        # Under TSP's schedules the table's vocabulary shards serve a ring lookup.
        x = vocab_ring_lookup(self.embed.embedding[...], tokens, ("vocab", "embed"))
        x = self.embed(tokens) if x is None else x
        x = constrain(x.astype(cfg.compute_dtype), RESIDUAL)
        if segments is None:
            cos, sin = rope_tables(tokens.shape[-1], cfg.head_dim)
        else:
            cos, sin = rope_tables_at(segments.positions, cfg.head_dim)
        if cfg.scan:
            graphdef, state = nnx.split(self.layers)
            run = self._block_fn(graphdef, cos, sin, segments)
            x, _ = jax.lax.scan(lambda h, layer: (run(layer, h), None), x, state)
        else:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x = self._block_fn(graphdef, cos, sin, segments)(state, x)
        x = self.norm(x)
        if targets is not None:
            kernel = self.head.kernel[...].astype(cfg.compute_dtype)
            return chunked_cross_entropy(
                x,
                targets,
                lambda w, h: jnp.einsum("...d,dv->...v", h, w),
                weight=kernel,
                weight_axes=HEAD,
                chunks=cfg.loss_chunks,
            )
        return constrain(self.head(x).astype(jnp.float32), LOGITS)
