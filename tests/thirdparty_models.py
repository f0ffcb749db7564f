"""Two small models written the way popular Flax model libraries write them, and never
annotated for shardkit: a GPT-2 (linen, fused ``c_attn``, tied embedding, blocks
``h/0``, ``h/1``) and a Llama (NNX, ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
gated MLP, untied ``lm_head``). Their logical axes come from ``PathAxes`` alone.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2


def causal_attention(q, k, v):
    """[b, s, h, d] queries, keys, values -> [b, s, h, d]."""
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def lm_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ------------------------------------------------------------------------ GPT-2 (linen)
class GPT2Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        qkv = nn.Dense(3 * d, name="c_attn")(x).reshape(b, s, 3, HEADS, d // HEADS)
        out = causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, s, d)
        return nn.Dense(d, name="c_proj")(out)


class GPT2MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * x.shape[-1], name="c_fc")(x))
        return nn.Dense(x.shape[-1], name="c_proj")(h)


class GPT2Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + GPT2Attention(name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + GPT2MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT2LMHeadModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        wte = nn.Embed(VOCAB, WIDTH, name="wte")
        x = wte(tokens) + nn.Embed(32, WIDTH, name="wpe")(jnp.arange(tokens.shape[1]))
        for i in range(LAYERS):
            x = GPT2Block(name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


GPT2_AXES = [
    ("wte/embedding$", ("vocab", "embed")),
    ("wpe/embedding$", (None, "embed")),
    ("c_attn/kernel$", ("embed", "mlp")),  # fused q, k, v: split like an MLP's columns
    ("c_attn/bias$", ("mlp",)),
    ("c_fc/kernel$", ("embed", "mlp")),
    ("c_fc/bias$", ("mlp",)),
    ("c_proj/kernel$", ("mlp", "embed")),
    ("(c_proj/bias|ln_\\w+/(scale|bias))$", ("embed",)),
]


def gpt2_init(rng):
    return GPT2LMHeadModel().init(rng, jnp.zeros((1, 8), jnp.int32))["params"]


def gpt2_loss(params, batch):
    return lm_loss(GPT2LMHeadModel().apply({"params": params}, batch["inputs"]), batch["targets"])


# ------------------------------------------------------------------------ Llama (NNX)
class LlamaAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, d = x.shape
        q, k, v = (
            p(x).reshape(b, s, HEADS, d // HEADS) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return self.o_proj(causal_attention(q, k, v).reshape(b, s, d))


class LlamaMLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(WIDTH, 4 * WIDTH, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(WIDTH, 4 * WIDTH, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(4 * WIDTH, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, rngs):
        self.input_layernorm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.self_attn = LlamaAttention(rngs)
        self.post_attention_layernorm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.mlp = LlamaMLP(rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nnx.Module):
    def __init__(self, rngs):
        self.embed_tokens = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.lm_head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


LLAMA_AXES = [
    ("embed_tokens/embedding$", ("vocab", "embed")),
    ("(q|k|v)_proj/kernel$", ("embed", "heads")),
    ("o_proj/kernel$", ("heads", "embed")),
    ("(gate|up)_proj/kernel$", ("embed", "mlp")),
    ("down_proj/kernel$", ("mlp", "embed")),
    ("norm/scale$", ("embed",)),
    ("lm_head/kernel$", ("embed", "vocab")),
]

_LLAMA_GRAPH = nnx.graphdef(nnx.eval_shape(lambda: LlamaForCausalLM(nnx.Rngs(0))))


def llama_init(rng):
    return nnx.state(LlamaForCausalLM(nnx.Rngs(params=rng)), nnx.Param)


def llama_loss(params, batch):
    return lm_loss(nnx.merge(_LLAMA_GRAPH, params)(batch["inputs"]), batch["targets"])


MODELS = {
    "gpt2": (gpt2_init, gpt2_loss, GPT2_AXES),
    "llama": (llama_init, llama_loss, LLAMA_AXES),
}


# ------------------------------------------- annotated the Flax way (logical partitioning)
#: Flax's logical names, as its examples (lm1b, wmt) write them. The attention layers
#: create their kernels flat and reshape them, so a (64, 8, 8) query kernel carries
#: 2 names, ``("embed", "kv")``: Flax reads them as a prefix, the last dimension whole.
FLAX_HEADS = 8  # 8 heads of 8: the out kernel's leading 'embed' dimension is the heads
FLAX_LAYERS = 1  # compile time: one block shows every layout
_wlp = nn.with_logical_partitioning


class FlaxBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        norm = functools.partial(
            nn.LayerNorm,
            scale_init=_wlp(nn.initializers.ones, ("embed",)),
            bias_init=_wlp(nn.initializers.zeros, ("embed",)),
        )
        h = norm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=FLAX_HEADS,
            kernel_init=_wlp(nn.initializers.xavier_uniform(), ("embed", "kv")),
            use_bias=False,
            deterministic=True,
        )(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + h
        h = nn.DenseGeneral(
            4 * WIDTH,
            kernel_init=_wlp(nn.initializers.xavier_uniform(), ("embed", "mlp")),
            bias_init=_wlp(nn.initializers.zeros, ("mlp",)),
        )(norm()(x))
        h = nn.DenseGeneral(
            WIDTH,
            kernel_init=_wlp(nn.initializers.xavier_uniform(), ("mlp", "embed")),
            bias_init=_wlp(nn.initializers.zeros, ("embed",)),
        )(nn.gelu(h))
        return x + h


class FlaxLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(
            VOCAB, WIDTH, embedding_init=_wlp(nn.initializers.normal(0.02), ("vocab", "embed"))
        )(tokens)
        for _ in range(FLAX_LAYERS):
            x = FlaxBlock()(x)
        return nn.Dense(
            VOCAB,
            use_bias=False,
            kernel_init=_wlp(nn.initializers.xavier_uniform(), ("embed", "vocab")),
        )(x)


def flax_lm_init(rng):
    return FlaxLM().init(rng, jnp.zeros((1, 8), jnp.int32))["params"]


def flax_lm_loss(params, batch):
    return lm_loss(FlaxLM().apply({"params": params}, batch["inputs"]), batch["targets"])


_wp = nnx.with_partitioning


class NnxBlock(nnx.Module):
    """An NNX block whose attention keeps its own ``nnx.Rngs`` stream for dropout."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(
            WIDTH,
            scale_init=_wp(nnx.initializers.ones, ("embed",)),
            bias_init=_wp(nnx.initializers.zeros, ("embed",)),
            rngs=rngs,
        )
        self.attn = nnx.MultiHeadAttention(
            num_heads=FLAX_HEADS,
            in_features=WIDTH,
            decode=False,
            use_bias=False,
            dropout_rate=0.1,
            kernel_init=_wp(nnx.initializers.xavier_uniform(), ("embed", "kv")),
            rngs=rngs,
        )
        self.up = nnx.Linear(
            WIDTH,
            4 * WIDTH,
            kernel_init=_wp(nnx.initializers.xavier_uniform(), ("embed", "mlp")),
            bias_init=_wp(nnx.initializers.zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            4 * WIDTH,
            WIDTH,
            kernel_init=_wp(nnx.initializers.xavier_uniform(), ("mlp", "embed")),
            bias_init=_wp(nnx.initializers.zeros, ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x):
        h = self.norm(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(h, mask=mask, deterministic=False)
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(
            VOCAB,
            WIDTH,
            embedding_init=_wp(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(FLAX_LAYERS)])
        self.head = nnx.Linear(
            WIDTH,
            VOCAB,
            use_bias=False,
            kernel_init=_wp(nnx.initializers.xavier_uniform(), ("embed", "vocab")),
            rngs=rngs,
        )
        self.rngs = rngs  # the model's own nnx.Rngs: typed keys and counts in its state

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


with nnx.use_eager_sharding(False):
    _NNX_GRAPH = nnx.graphdef(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(params=0, dropout=1))))


def nnx_lm_init(rng):
    """``(params, rngs)``: the model's ``nnx.Param`` s and its ``nnx.Rngs`` keys and counts."""
    model = NnxLM(nnx.Rngs(params=rng, dropout=jax.random.fold_in(rng, 1)))
    return nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))


def nnx_lm_loss(params, rngs, batch):
    """The loss, and the ``nnx.Rngs`` state after the step (dropout advanced its count)."""
    model = nnx.merge(_NNX_GRAPH, params, rngs)
    loss = lm_loss(model(batch["inputs"]), batch["targets"])
    return loss, nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param)))


#: Models annotated the Flax way: (init, loss).
FLAX_MODELS = {"linen": (flax_lm_init, flax_lm_loss), "nnx": (nnx_lm_init, nnx_lm_loss)}


# ------------------------------------- sharding in types (NNX's explicit-sharding guide)
class NnxTypedMLP(nnx.Module):
    """An MLP that asks for its activations' sharding by mesh axis, the NNX way
    (``out_sharding=`` on its einsums): it needs Explicit mesh axes."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (WIDTH, 4 * WIDTH)))
        self.w2 = nnx.Param(init(rngs.params(), (4 * WIDTH, WIDTH)))

    def __call__(self, x):
        h = jnp.einsum("bd,df->bf", x, self.w1, out_sharding=jax.P("data", None))
        return jnp.einsum("bf,fd->bd", nnx.relu(h), self.w2, out_sharding=jax.P("data", None))


_TYPED_GRAPH = nnx.graphdef(nnx.eval_shape(lambda: NnxTypedMLP(nnx.Rngs(0))))


def typed_mlp_init(rng):
    return nnx.state(NnxTypedMLP(nnx.Rngs(params=rng)), nnx.Param)


def typed_mlp_loss(params, batch):
    y = nnx.merge(_TYPED_GRAPH, params)(batch["x"])
    return jnp.mean((y - batch["y"]) ** 2)
