"""A small language model written in plain Flax, with no shardkit annotations.

Stands for a model you did not write for shardkit (in the style of a model
library: layers named ``blocks_0``, ``blocks_1``, ..., an ``lm_head``, no logical
axes anywhere). ``build()`` hands it to shardkit with path patterns that name
each parameter's logical axes, so every recipe can shard it::

    shardkit report --model examples.my_model:build --recipe fsdp
    shardkit run --model examples.my_model:build --recipe tp --steps 20

The model file imports only JAX, Flax and optax; shardkit reads the mapping
``build()`` returns.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

VOCAB, WIDTH, HIDDEN, LAYERS = 256, 64, 256, 2


class Block(nn.Module):
    """Pre-norm residual MLP over each position."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm")(x)
        h = nn.gelu(nn.Dense(HIDDEN, name="fc_in")(h))
        return x + nn.Dense(WIDTH, name="fc_out")(h)


class TinyLM(nn.Module):
    """Token embedding, a stack of residual MLP blocks, and a vocabulary head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH, name="embed_tokens")(tokens)
        for i in range(LAYERS):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(VOCAB, use_bias=False, name="lm_head")(nn.LayerNorm(name="norm_f")(x))


def init(rng):
    return TinyLM().init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def loss(params, batch):
    logits = TinyLM().apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


#: (regex over parameter paths, logical axes): what a shardkit recipe needs to know.
ANNOTATIONS = [
    ("embed_tokens/embedding$", ("vocab", "embed")),
    ("fc_in/kernel$", ("embed", "mlp")),
    ("fc_in/bias$", ("mlp",)),
    ("fc_out/kernel$", ("mlp", "embed")),
    ("(fc_out/bias|norm(_f)?/(scale|bias))$", ("embed",)),
    ("lm_head/kernel$", ("embed", "vocab")),
]


def build():
    """The model for ``shardkit ... --model examples.my_model:build``."""
    return {
        "init": init,
        "loss": loss,
        "annotations": ANNOTATIONS,
        "vocab": VOCAB,
    }


if __name__ == "__main__":
    params = jax.eval_shape(init, jax.random.key(0))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        print(jax.tree_util.keystr(path), leaf.shape)
