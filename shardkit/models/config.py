"""``ModelConfig``: the shape of a reference model, and its named sizes.

The parameter count is exact (it equals the sum of the real leaves' sizes; the
tests check it), so analytic memory/communication models can use it directly.

Example:
  >>> from shardkit.models.config import CONFIGS
  >>> cfg = CONFIGS["llama-tiny"]
  >>> cfg.head_dim, cfg.param_count()
  (4, 155968)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from shardkit import context, errors
from shardkit.dims import ModelDims
from shardkit.nn.mla import MlaSpec
from shardkit.nn.moe import MoeSpec

__all__ = ["ModelConfig", "CONFIGS", "REMAT_POLICIES"]

REMAT_POLICIES = ("none", "full", "save_dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape and execution options of a GPT-2 (linen), Llama or MoE (NNX) reference model.

    Attributes:
      family: ``"gpt"`` (flax.linen, tied embedding, LayerNorm, GELU MLP, biases),
        ``"llama"`` (flax.nnx, RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases)
        or ``"moe"`` (Llama with a mixture-of-experts MLP, ``shardkit.nn.moe``).
      vocab: vocabulary size.
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: attention (query) heads; must divide ``d_model``.
      n_kv_heads: key/value heads (GQA); must divide ``n_heads``. GPT uses ``n_heads``.
      d_ff: hidden width of the MLP.
      max_seq: longest sequence (GPT: rows of the learned position table).
      remat: ``"none"``, ``"full"`` (recompute each block in the backward pass) or
        ``"save_dots"`` (keep matmul outputs without batch dims, recompute the rest).
      scan: stack the layers under a scan, with a leading ``"layers"`` logical axis.
      dtype: activation / compute dtype; ``None`` (the default) follows the plan's
        precision (``sk.Plan(..., precision="bf16")``: bfloat16), float32 outside a plan.
        See :attr:`compute_dtype`.
      param_dtype: parameter dtype (float32: the master weights, whatever the precision).
      loss_chunks: chunks of the sequence the vocabulary head and the loss run in
        (``sk.chunked_cross_entropy``); ``None`` picks them from the step's size
        (``shardkit.nn.loss.auto_chunks``), 1 projects all the tokens at once.
      n_experts, top_k, n_shared_experts, expert_d_ff, capacity_factor, router,
      aux_loss_weight, z_loss_weight: the MoE MLP of family ``"moe"``
        (:class:`shardkit.nn.moe.MoeSpec`; ``expert_d_ff=None``: ``d_ff``;
        ``capacity_factor=None``: dropless).
      kv_latent, q_latent, nope_dim, rope_dim, v_dim: multi-head latent attention
        (DeepSeek-V2, :class:`shardkit.nn.mla.MlaSpec`) in place of grouped-query
        attention, for family ``"moe"``: the K/V latent's rank (0: no MLA), the query
        latent's (0: none), the per-head widths of the position-free q/k part, of the rope
        part (even; one rope key shared by the heads) and of the values. ``n_kv_heads``
        is then unused (every head reads the latent).

    Example:
      >>> cfg = ModelConfig("gpt", vocab=256, d_model=64, n_layers=2, n_heads=8,
      ...                   n_kv_heads=8, d_ff=256, max_seq=128)
      >>> cfg.head_dim
      8
    """

    family: Literal["gpt", "llama", "moe"]
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq: int
    remat: Literal["none", "full", "save_dots"] = "none"
    scan: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    loss_chunks: int | None = None
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    expert_d_ff: int | None = None
    capacity_factor: float | None = 1.25
    router: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    kv_latent: int = 0
    q_latent: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0

    def __post_init__(self) -> None:
        where = (
            f"ModelConfig(family={self.family!r}, d_model={self.d_model}, n_heads={self.n_heads})"
        )
        if self.family not in ("gpt", "llama", "moe"):
            raise errors.ShardingError(
                f"{where}: family is 'gpt', 'llama' or 'moe', got {self.family!r}."
            )
        if (self.family == "moe") != (self.n_experts != 0):
            raise errors.ShardingError(
                f"{where}: family {self.family!r} with n_experts={self.n_experts!r}; the "
                "'moe' family and only it has experts.\nFix: family='moe' with n_experts > 0, "
                "or n_experts=0."
            )
        if self.family == "moe":
            self.moe_spec()  # validates the expert fields
        mla = (self.kv_latent, self.q_latent, self.nope_dim, self.rope_dim, self.v_dim)
        if self.kv_latent and self.family != "moe":
            raise errors.ShardingError(
                f"{where}: latent attention (kv_latent={self.kv_latent}) is built into the "
                f"'moe' family's blocks, not {self.family!r}'s.\nFix: family='moe' "
                "(deepseek-tiny, deepseek-small), or kv_latent=0."
            )
        if self.kv_latent:
            self.mla_spec()  # validates the latent fields
        elif any(mla):
            raise errors.ShardingError(
                f"{where}: q_latent, nope_dim, rope_dim, v_dim = {mla[1:]} without a K/V "
                "latent (kv_latent=0).\nFix: pass kv_latent=<rank> for latent attention, or "
                "leave the other four at 0."
            )
        if self.remat not in REMAT_POLICIES:
            raise errors.ShardingError(
                f"{where}: remat is one of {REMAT_POLICIES}, got {self.remat!r}."
            )
        for field in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise errors.ShardingError(
                    f"{where}: {field} must be a positive int, got {value!r}."
                )
        if self.loss_chunks is not None and (
            not isinstance(self.loss_chunks, int) or self.loss_chunks <= 0
        ):
            raise errors.ShardingError(
                f"{where}: loss_chunks must be a positive int or None, got "
                f"{self.loss_chunks!r}.\nFix: pass loss_chunks=None to pick it from the step."
            )
        if self.d_model % self.n_heads:
            raise errors.ShardingError(
                f"{where}: d_model {self.d_model} is not divisible by n_heads {self.n_heads}.\n"
                "Fix: pick n_heads dividing d_model."
            )
        if self.kv_latent and self.n_kv_heads != self.n_heads:
            raise errors.ShardingError(
                f"{where}: latent attention (kv_latent={self.kv_latent}) has no K/V heads of "
                f"its own: every head reads the latent, so n_kv_heads equals n_heads, got "
                f"{self.n_kv_heads}.\nFix: pass n_kv_heads={self.n_heads}."
            )
        if self.n_heads % self.n_kv_heads:
            raise errors.ShardingError(
                f"{where}: n_heads {self.n_heads} is not a multiple of n_kv_heads "
                f"{self.n_kv_heads}.\nFix: pick n_kv_heads dividing n_heads."
            )
        if self.family == "gpt" and self.n_kv_heads != self.n_heads:
            raise errors.ShardingError(
                f"{where}: GPT uses multi-head attention; n_kv_heads must equal n_heads, "
                f"got {self.n_kv_heads}.\nFix: pass n_kv_heads={self.n_heads}."
            )

    def moe_spec(self) -> MoeSpec:
        """The MoE MLP of a ``"moe"`` model (:class:`shardkit.nn.moe.MoeSpec`).

        Raises:
          ShardingError: an invalid expert field (``top_k > n_experts``, a capacity
            factor ``≤ 0``, ...).

        Example:
          >>> CONFIGS["moe-tiny"].moe_spec().capacity_of(16)   # ⌈1.25·16·2/8⌉
          5
        """
        return MoeSpec(
            n_experts=self.n_experts,
            top_k=self.top_k,
            d_ff=self.d_ff if self.expert_d_ff is None else self.expert_d_ff,
            n_shared=self.n_shared_experts,
            capacity_factor=self.capacity_factor,
            router=self.router,
            aux_weight=self.aux_loss_weight,
            z_weight=self.z_loss_weight,
        )

    def mla_spec(self) -> MlaSpec | None:
        """The latent attention of a DeepSeek-style model, ``None`` without one.

        Raises:
          ShardingError: an invalid latent field (an odd ``rope_dim``, a rank ≤ 0, ...).

        Example:
          >>> CONFIGS["deepseek-tiny"].mla_spec().qk_dim
          12
        """
        if not self.kv_latent:
            return None
        return MlaSpec(
            n_heads=self.n_heads,
            kv_latent=self.kv_latent,
            nope_dim=self.nope_dim,
            rope_dim=self.rope_dim,
            v_dim=self.v_dim,
            q_latent=self.q_latent,
        )

    @property
    def rope_width(self) -> int:
        """The width RoPE rotates: ``rope_dim`` under latent attention, else ``head_dim``.

        Example:
          >>> CONFIGS["deepseek-tiny"].rope_width, CONFIGS["moe-tiny"].rope_width
          (4, 4)
        """
        return self.rope_dim if self.kv_latent else self.head_dim

    @property
    def compute_dtype(self) -> Any:
        """``dtype`` when set, else the active plan's (``sk.compute_dtype()``).

        Example:
          >>> from shardkit import context
          >>> cfg = CONFIGS["gpt-tiny"]
          >>> with context.using(precision="bf16"):
          ...     cfg.compute_dtype, dataclasses.replace(cfg, dtype=jnp.float32).compute_dtype
          (<class 'jax.numpy.bfloat16'>, <class 'jax.numpy.float32'>)
        """
        return context.compute_dtype() if self.dtype is None else self.dtype

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def in_projections(self) -> int:
        """A layer's column-parallel projections, the matmuls that read the attention's or
        the MLP's input: GPT 2 (the fused ``qkv`` and ``up``), Llama 5 (``wq``, ``wk``,
        ``wv``, ``gate`` and ``up``, each its own kernel). Under tensor parallelism each
        reduces its input's gradient on its own (the analytic wire model,
        :func:`shardkit.report.analytic.wire_bytes_hybrid`).

        Example:
          >>> CONFIGS["gpt-tiny"].in_projections, CONFIGS["llama-tiny"].in_projections
          (2, 5)
        """
        return 2 if self.family == "gpt" else 5

    def dims(self) -> ModelDims:
        """The model's dimensions and structure, as the report and the planner read them.

        Example:
          >>> CONFIGS["gpt-tiny"].dims().tied_embedding, CONFIGS["llama-tiny"].dims().gated_mlp
          (True, True)
        """
        gpt = self.family == "gpt"
        moe = self.moe_spec() if self.family == "moe" else None
        experts = {}
        if moe is not None:
            experts = {
                "n_experts": moe.n_experts,
                "top_k": moe.top_k,
                "n_shared_experts": moe.n_shared,
                "expert_d_ff": moe.d_ff,
                "capacity_factor": moe.capacity_factor,
            }
        mla = self.mla_spec()
        if mla is not None:
            experts.update(
                kv_latent=mla.kv_latent,
                q_latent=mla.q_latent,
                nope_dim=mla.nope_dim,
                rope_dim=mla.rope_dim,
                v_dim=mla.v_dim,
            )
        return ModelDims(
            layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            vocab=self.vocab,
            max_seq=self.max_seq,
            tied_embedding=gpt,
            position_table=gpt,
            gated_mlp=not gpt,
            biases=gpt,
            norm="layernorm" if gpt else "rmsnorm",
            in_projections=self.in_projections,
            chunked_head=True,
            loss_chunks=self.loss_chunks,
            pinned_weights=gpt,  # linen modules under @sk.axes
            **experts,
        )

    def param_count(self) -> int:
        """Exact number of parameters (scalars) of the model this config builds.

        GPT: ``V·d + S·d + L·(4d² + 2·d·f + 9d + f) + 2d`` (tied head, learned positions).
        Llama: ``2·V·d + L·(d·(2·h + 2·k)·hd + 3·d·f + 2d) + d`` (untied head, no biases).

        Example:
          >>> CONFIGS["gpt-small"].param_count()
          124475904
        """
        return self.dims().param_count

    def flops_per_token(self, seq: int) -> float:
        """Training (forward + backward) FLOPs per token at sequence length ``seq``
        (:meth:`ModelDims.flops_per_token`).

        Example:
          >>> cfg = CONFIGS["gpt-tiny"]
          >>> cfg.flops_per_token(16) == 6 * (cfg.param_count() - 128 * 64) + 12 * 2 * 64 * 16
          True
        """
        return self.dims().flops_per_token(seq)


def _gpt(vocab, d, layers, heads, ff, seq) -> ModelConfig:
    return ModelConfig("gpt", vocab, d, layers, heads, heads, ff, seq)


def _llama(vocab, d, layers, heads, kv_heads, ff, seq) -> ModelConfig:
    return ModelConfig("llama", vocab, d, layers, heads, kv_heads, ff, seq)


CONFIGS: dict[str, ModelConfig] = {
    "gpt-tiny": _gpt(256, 64, 2, 8, 256, 128),
    # GPT-2 small with vocab padded to 50304: 124,475,904 parameters with 1024 positions
    # (124,082,688 with 512). The often-quoted Ψ = 123.7M (123,689,472) is this model without
    # its position table; neither max_seq reproduces it, so max_seq stays GPT-2's 1024.
    "gpt-small": _gpt(50304, 768, 12, 12, 3072, 1024),
    # Planning configs pad the vocabulary to a multiple of 512 (as Megatron and MaxText
    # pad it) so that FSDP or vocab-parallel layouts divide it on up to 512 devices.
    "gpt-1b": _gpt(50688, 2048, 24, 16, 8192, 2048),
    "gpt-7b": _gpt(50688, 4096, 32, 32, 16384, 2048),
    "llama-tiny": _llama(256, 64, 2, 16, 8, 256, 128),  # 8 kv heads: TP over 8 devices
    "llama-small": _llama(32000, 768, 12, 12, 4, 2048, 1024),
    "llama-1b": _llama(32256, 2048, 16, 32, 8, 8192, 2048),
    "llama-7b": _llama(32256, 4096, 32, 32, 32, 11008, 4096),
    # Mixtures of experts (Llama trunks, shardkit.nn.moe): 8 experts, 2 per token. moe-tiny
    # has a shared expert too (DeepSeek-style); moe-47b is Mixtral-8x7B's shape (its
    # 32,000-token vocabulary: 46,702,792,704 parameters, 12.9B active per token).
    "moe-tiny": ModelConfig(
        "moe", 256, 64, 2, 16, 8, 64, 128, n_experts=8, top_k=2, n_shared_experts=1
    ),
    "moe-small": ModelConfig("moe", 32000, 768, 12, 12, 4, 2048, 1024, n_experts=8, top_k=2),
    "moe-47b": ModelConfig("moe", 32000, 4096, 32, 32, 8, 14336, 4096, n_experts=8, top_k=2),
    # DeepSeek-V2-style (shardkit.nn.mla + shardkit.nn.moe): latent attention with a query
    # latent and decoupled RoPE, fine-grained experts (16 narrow ones, 4 per token) and 2
    # shared experts. Heads, latents and experts divide over 8 devices (tp, tp_latent, ep).
    "deepseek-tiny": ModelConfig(
        "moe",
        256,
        64,
        2,
        8,
        8,
        64,
        128,
        n_experts=16,
        top_k=4,
        n_shared_experts=2,
        expert_d_ff=16,
        kv_latent=32,
        q_latent=32,
        nope_dim=8,
        rope_dim=4,
        v_dim=8,
    ),
    # At the llama-small trunk's width: 16 heads (tp over 8), a 256-rank K/V latent.
    "deepseek-small": ModelConfig(
        "moe",
        32000,
        768,
        12,
        16,
        16,
        2048,
        1024,
        n_experts=16,
        top_k=4,
        n_shared_experts=2,
        expert_d_ff=384,
        kv_latent=256,
        q_latent=384,
        nope_dim=32,
        rope_dim=16,
        v_dim=32,
    ),
}
