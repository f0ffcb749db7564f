"""``ModelDims``: the sizes and structure of a transformer, as plain data.

What the analytic model, the report and the planner know of a model is what it declares
here: no family names, no model code. A reference model's config gives its dims
(``ModelConfig.dims()``); a model of your own declares them (``dims=`` in its factory).

Example:
  >>> d = ModelDims(layers=2, d_model=64, n_heads=8, n_kv_heads=8, d_ff=256, vocab=256,
  ...               max_seq=128, tied_embedding=True, position_table=True, biases=True,
  ...               norm="layernorm")
  >>> d.head_dim, d.layer_params, d.param_count
  (8, 49984, 124672)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from shardkit.errors import ShardingError

__all__ = ["ModelDims"]

_SIZES = ("layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelDims:
    """A decoder-only transformer's dimensions, from which its parameter counts follow.

    Attributes:
      layers: transformer blocks in the stack.
      d_model: width of the residual stream.
      n_heads: query heads; ``n_kv_heads``: key/value heads (``n_heads`` without GQA).
      d_ff: hidden width of the MLP.
      vocab: vocabulary size.
      max_seq: longest sequence (the rows of a learned position table), if known.
      tied_embedding: the token table is also the output head (GPT-2).
      position_table: learned positions (a ``max_seq × d_model`` table; else RoPE or none).
      gated_mlp: a gated MLP (SwiGLU: gate, up and down matrices; else up and down).
      biases: the projections and the MLP carry biases.
      norm: ``"layernorm"`` (scale and bias) or ``"rmsnorm"`` (scale): two per layer and
        one final.
      in_projections: a layer's column-parallel projections (the matmuls that read the
        attention's or the MLP's input), each reducing its input's gradient on its own
        under tensor parallelism: 2 when fused (``qkv``, ``up``), 5 for separate
        ``wq``, ``wk``, ``wv``, ``gate`` and ``up``.
      chunked_head: the model's head and loss are shardkit's chunked cross-entropy
        (``shardkit.nn.loss.chunked_cross_entropy``); the analytic model then counts the
        step's phases (the layers, the head and loss, the optimizer step) one by one.
      loss_chunks: with ``chunked_head``, the chunks of the sequence the head and the
        loss run in; ``None``: chosen from the step's size.
      pinned_weights: the layers read their weights through ``@sk.axes`` on linen
        modules, which pins each weight to its planned sharding where a module reads it
        (NNX modules are not pinned). Without remat a layer scan's forward saves the
        pinned copy of every sharded weight for the backward: a second copy of the
        stack's shard that the estimate counts.
      n_experts: routed experts of a mixture-of-experts MLP (0: a dense MLP). Each is a
        SwiGLU of width ``expert_d_ff``; ``top_k`` of them read each token, with
        ``capacity_factor`` (``None``: dropless) bounding each expert's tokens;
        ``n_shared_experts`` more read every token. The router is a ``d_model × E``
        matrix. ``d_ff`` is then unused by the counts.
      kv_latent: multi-head latent attention's K/V latent rank ``d_c`` (0: q, k, v and out
        projections of ``head_dim`` per head). With it, ``q_latent`` (the query latent's
        rank, 0: none), ``nope_dim``, ``rope_dim`` (even) and ``v_dim`` (per-head widths
        of the position-free q/k part, the rope part and the values) describe the
        attention (:mod:`shardkit.nn.mla`); ``n_kv_heads`` is then unused by the counts.

    Raises:
      ShardingError: a size that is not a positive int, heads that do not divide
        ``d_model``, or kv heads that do not divide the heads.
    """

    layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    max_seq: int | None = None
    tied_embedding: bool = False
    position_table: bool = False
    gated_mlp: bool = False
    biases: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    in_projections: int = 2
    chunked_head: bool = False
    loss_chunks: int | None = None
    pinned_weights: bool = False
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    expert_d_ff: int | None = None
    capacity_factor: float | None = None
    kv_latent: int = 0
    q_latent: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0

    def __post_init__(self) -> None:
        self._check_experts()
        self._check_latent()
        for field in _SIZES:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ShardingError(
                    f"ModelDims({field}={value!r}): {field} must be a positive int.\n"
                    f"Fix: declare the model's {field} as a positive integer."
                )
        if self.d_model % self.n_heads:
            raise ShardingError(
                f"ModelDims: d_model {self.d_model} is not divisible by n_heads "
                f"{self.n_heads}.\nFix: declare n_heads dividing d_model."
            )
        if self.n_heads % self.n_kv_heads:
            raise ShardingError(
                f"ModelDims: n_heads {self.n_heads} is not a multiple of n_kv_heads "
                f"{self.n_kv_heads}.\nFix: declare n_kv_heads dividing n_heads."
            )
        for field, value in (
            ("in_projections", self.in_projections),
            ("max_seq", self.max_seq),
            ("loss_chunks", self.loss_chunks),
        ):
            optional = field != "in_projections" and value is None
            if not optional and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ShardingError(
                    f"ModelDims({field}={value!r}): {field} must be a positive int"
                    f"{'' if field == 'in_projections' else ' or None'}.\n"
                    f"Fix: declare {field} as a positive integer"
                    f"{'' if field == 'in_projections' else ', or leave it out'}."
                )
        for field in (
            "tied_embedding",
            "position_table",
            "gated_mlp",
            "biases",
            "chunked_head",
            "pinned_weights",
        ):
            if not isinstance(getattr(self, field), bool):
                raise ShardingError(
                    f"ModelDims({field}={getattr(self, field)!r}): {field} is True or False.\n"
                    f"Fix: pass {field}=True or {field}=False."
                )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ShardingError(
                f"ModelDims(norm={self.norm!r}): norm is 'layernorm' or 'rmsnorm'.\n"
                "Fix: pass norm='layernorm' (scale and bias) or norm='rmsnorm' (scale)."
            )
        if self.position_table and self.max_seq is None:
            raise ShardingError(
                "ModelDims(position_table=True) needs max_seq (the table's rows).\n"
                "Fix: pass max_seq=<longest sequence>."
            )

    def _check_experts(self) -> None:
        def whole(field: str, low: int) -> bool:
            value = getattr(self, field)
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        for field, low in (("n_experts", 0), ("top_k", 0), ("n_shared_experts", 0)):
            if not whole(field, low):
                raise ShardingError(
                    f"ModelDims({field}={getattr(self, field)!r}): {field} must be an int ≥ "
                    f"{low}.\nFix: declare {field} as a non-negative integer (0: no experts)."
                )
        if not self.n_experts:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ShardingError(
                f"ModelDims(top_k={self.top_k}, n_experts={self.n_experts}): each token "
                f"reads 1 to n_experts distinct experts.\nFix: declare top_k between 1 and "
                f"{self.n_experts}."
            )
        if not whole("expert_d_ff", 1):
            raise ShardingError(
                f"ModelDims(expert_d_ff={self.expert_d_ff!r}): an MoE model declares its "
                "experts' hidden width as a positive int.\nFix: pass expert_d_ff=<width>."
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or cf <= 0):
            raise ShardingError(
                f"ModelDims(capacity_factor={cf!r}): the capacity factor is > 0, or None "
                "(dropless).\nFix: declare e.g. capacity_factor=1.25."
            )

    def _check_latent(self) -> None:
        fields = ("kv_latent", "q_latent", "nope_dim", "rope_dim", "v_dim")
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ShardingError(
                    f"ModelDims({field}={value!r}): {field} must be an int ≥ 0.\nFix: declare "
                    f"{field} as a non-negative integer (kv_latent=0: no latent attention)."
                )
        if not self.kv_latent:
            if any(getattr(self, f) for f in fields):
                raise ShardingError(
                    f"ModelDims: {', '.join(f'{f}={getattr(self, f)}' for f in fields[1:])} "
                    "without a K/V latent (kv_latent=0).\nFix: declare kv_latent=<rank> for "
                    "latent attention, or leave the other four at 0."
                )
            return
        for field in ("nope_dim", "rope_dim", "v_dim"):
            if not getattr(self, field):
                raise ShardingError(
                    f"ModelDims(kv_latent={self.kv_latent}, {field}=0): latent attention "
                    f"declares its per-head {field} as a positive int.\nFix: pass {field}=<width>."
                )
        if self.rope_dim % 2:
            raise ShardingError(
                f"ModelDims(rope_dim={self.rope_dim}): RoPE rotates pairs, so rope_dim is "
                f"even.\nFix: declare rope_dim={self.rope_dim + 1} (or {self.rope_dim - 1})."
            )

    @property
    def latent_per_token(self) -> int:
        """Values one layer's K/V latent holds per token: ``kv_latent`` (0 without MLA).

        The normalised latent ``c_kv`` (what a decoder caches, beside the ``rope_dim`` key).

        Example:
          >>> ModelDims(layers=1, d_model=8, n_heads=2, n_kv_heads=2, d_ff=8, vocab=8,
          ...           kv_latent=4, nope_dim=2, rope_dim=2, v_dim=2).latent_per_token
          4
        """
        return self.kv_latent

    @property
    def expert_params(self) -> int:
        """One layer's routed experts' weights (``E · 3 · d · f_e``; 0 without experts).

        Example:
          >>> ModelDims(layers=1, d_model=4, n_heads=1, n_kv_heads=1, d_ff=1, vocab=8,
          ...           n_experts=8, top_k=2, expert_d_ff=16).expert_params
          1536
        """
        if not self.n_experts:
            return 0
        return self.n_experts * 3 * self.d_model * self.expert_d_ff

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def _norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    @property
    def attention_params(self) -> tuple[int, int]:
        """(weights, biases) of one layer's attention: q, k, v and the output projection.

        Latent attention: the query (through its latent and the latent's norm scale, when
        ``q_latent``) ``h·(nope+rope)`` wide, the K/V latent ``d·d_c`` and its norm, the
        shared rope key ``d·rope``, the up-projections ``d_c·h·(nope + v)``, out ``h·v·d``.

        Example:
          >>> ModelDims(layers=1, d_model=16, n_heads=2, n_kv_heads=2, d_ff=8, vocab=8,
          ...           kv_latent=8, nope_dim=4, rope_dim=2, v_dim=4).attention_params
          (616, 0)
        """
        d, h = self.d_model, self.n_heads
        if self.kv_latent:
            c, qk = self.kv_latent, self.nope_dim + self.rope_dim
            cq = self.q_latent
            query = cq * (d + 1 + h * qk) if cq else d * h * qk
            kv = c * (d + 1) + d * self.rope_dim + c * h * (self.nope_dim + self.v_dim)
            return query + kv + h * self.v_dim * d, 0
        q, kv = h * self.head_dim, self.n_kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d, (q + 2 * kv + d) if self.biases else 0

    @property
    def mlp_params(self) -> tuple[int, int]:
        """(weights, biases) of one layer's MLP (with experts: the routed and shared
        experts and the router)."""
        d, f = self.d_model, self.d_ff
        if self.n_experts:
            shared = self.n_shared_experts * 3 * d * self.expert_d_ff
            return self.expert_params + shared + d * self.n_experts, 0
        matrices = (3 if self.gated_mlp else 2) * d * f
        biases = ((2 if self.gated_mlp else 1) * f + d) if self.biases else 0
        return matrices, biases

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block: attention, MLP and its two norms.

        Example:
          >>> ModelDims(layers=1, d_model=4, n_heads=2, n_kv_heads=1, d_ff=8, vocab=16,
          ...           gated_mlp=True).layer_params  # 4·4 + 2·4·2 + 4·4, 3·4·8, 2·4
          152
        """
        return sum(self.attention_params) + sum(self.mlp_params) + 2 * self._norm_params

    @property
    def ringed_layer_params(self) -> tuple[int, int]:
        """(a layer's matmul weights Ψ_l, their input-side part): what TSP's rings move.

        The input side is q, k, v and the MLP's up (and gate) matrices.
        """
        d, f = self.d_model, self.d_ff
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv = d * (q + 2 * kv)
        up = (2 if self.gated_mlp else 1) * d * f
        return qkv + q * d + up + d * f, qkv + up

    @property
    def embedding_params(self) -> int:
        """Parameters only looked up, never multiplied: an untied token table, positions."""
        positions = self.max_seq * self.d_model if self.position_table else 0
        tokens = 0 if self.tied_embedding else self.vocab * self.d_model
        return positions + tokens

    @property
    def vocab_tables(self) -> int:
        """Vocabulary-sized tables among the parameters: 1 tied, 2 untied."""
        return 1 if self.tied_embedding else 2

    @property
    def stack_params(self) -> int:
        """Parameters of the whole layer stack."""
        return self.layers * self.layer_params

    @property
    def param_count(self) -> int:
        """Every parameter: tables, the stack, the final norm (and an untied head)."""
        d = self.d_model
        positions = self.max_seq * d if self.position_table else 0
        return (
            self.vocab_tables * self.vocab * d + positions + self.stack_params + (self._norm_params)
        )

    def flops_per_token(self, seq: int) -> float:
        """Training (forward + backward) FLOPs per token at sequence length ``seq``.

        ``6·N + 12·L·d·seq`` (PaLM, Chowdhery et al. 2022, appendix B), ``N`` the
        parameters that multiply activations (all but :attr:`embedding_params`).
        """
        matmul_params = self.param_count - self.embedding_params
        if self.n_experts:  # a token passes through top_k of the experts
            matmul_params -= self.layers * self.expert_params * (1 - self.top_k / self.n_experts)
        return float(6 * matmul_params + 12 * self.layers * self.d_model * seq)
