"""Two small models written the way popular Flax model libraries write them, and never
annotated for shardkit: a GPT-2 (linen, fused ``c_attn``, tied embedding, blocks
``h/0``, ``h/1``) and a Llama (NNX, ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
gated MLP, untied ``lm_head``). Their logical axes come from ``PathAxes`` alone.
"""

from __future__ import annotations

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
