"""A small transformer of your own, in plain Flax, that shardkit pipelines from the command line.

Not a shardkit reference model: its own attention, MLP and norms, its layers stacked by
``nn.scan`` (a leading layers axis under ``params["layers"]``), no shardkit annotations
and no shardkit import. ``build()`` hands shardkit what it cannot guess:

- ``annotations``: each parameter's logical axes, by path (the stack's leading axis is
  ``"layers"``, which the pipeline recipes lay over ``stage``);
- ``stages``: the model cut into ``pre`` (embedding) / ``layer`` (one block) / ``post``
  (final norm, head and loss), so the pipeline recipes can run it;
- ``dims``: its sizes (the fields of ``shardkit.dims.ModelDims``), so the report has an
  analytic column; shardkit checks them against the parameters ``init`` gives.

::

    shardkit run --model examples.scanned_lm:build --recipe zeropp --steps 20 --seq 32
    shardkit report --model examples.scanned_lm:build --recipe dp_pp --seq 32
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

VOCAB, WIDTH, HEADS, HIDDEN, LAYERS, MAX_SEQ = 256, 64, 4, 256, 4, 128
HEAD_DIM = WIDTH // HEADS


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, in the ``nn.scan`` form ``(x, _) -> (x, None)``."""

    @nn.compact
    def __call__(self, x, _):
        h = nn.RMSNorm(name="norm_attn")(x)
        proj = lambda name: nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, name=name)  # noqa: E731
        q, k, v = proj("q")(h), proj("k")(h), proj("v")(h)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM).astype(x.dtype)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + nn.DenseGeneral(WIDTH, axis=(-2, -1), use_bias=False, name="o")(y)
        h = nn.RMSNorm(name="norm_mlp")(x)
        h = nn.gelu(nn.Dense(HIDDEN, use_bias=False, name="up")(h))
        return x + nn.Dense(WIDTH, use_bias=False, name="down")(h), None


Stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)


class ScannedLM(nn.Module):
    """Token and position tables, the scanned stack, a final norm and an untied head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
        x = x + nn.Embed(MAX_SEQ, WIDTH, name="pos")(jnp.arange(tokens.shape[-1]))[None]
        x, _ = Stack(name="layers")(x, None)
        return nn.Dense(VOCAB, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm_f")(x))


def embed(rest, tokens):
    """The embedding: token and position tables."""
    positions = jnp.arange(tokens.shape[-1])[None]
    return rest["embed"]["embedding"][tokens] + rest["pos"]["embedding"][positions]


def init(rng):
    return ScannedLM().init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss(params, batch):
    return cross_entropy(ScannedLM().apply({"params": params}, batch["inputs"]), batch["targets"])


# The cut for a pipeline: the same operations as ``loss``, one block at a time.
def pre(rest, batch):
    return embed(rest, batch["inputs"])


def layer(layer_params, x):
    return Block().apply({"params": layer_params}, x, None)[0]


def post(rest, y, batch):
    y = nn.RMSNorm().apply({"params": rest["norm_f"]}, y)
    logits = nn.Dense(VOCAB, use_bias=False).apply({"params": rest["lm_head"]}, y)
    return cross_entropy(logits, batch["targets"])


#: (regex over parameter paths, logical axes); the stack's leaves lead with "layers".
ANNOTATIONS = [
    ("embed/embedding$", ("vocab", "embed")),
    ("pos/embedding$", (None, "embed")),
    ("layers/(q|k|v)/kernel$", ("layers", "embed", "heads", "kv")),
    ("layers/o/kernel$", ("layers", "heads", "kv", "embed")),
    ("layers/up/kernel$", ("layers", "embed", "mlp")),
    ("layers/down/kernel$", ("layers", "mlp", "embed")),
    ("layers/norm_(attn|mlp)/scale$", ("layers", "embed")),
    ("norm_f/scale$", ("embed",)),
    ("lm_head/kernel$", ("embed", "vocab")),
]

#: The model's sizes, as ``shardkit.dims.ModelDims`` fields (q, k, v and up are its four
#: column-parallel input projections).
DIMS = {
    "layers": LAYERS,
    "d_model": WIDTH,
    "n_heads": HEADS,
    "n_kv_heads": HEADS,
    "d_ff": HIDDEN,
    "vocab": VOCAB,
    "max_seq": MAX_SEQ,
    "position_table": True,
    "norm": "rmsnorm",
    "in_projections": 4,
}


def build():
    """The model for ``shardkit ... --model examples.scanned_lm:build``."""
    return {
        "init": init,
        "loss": loss,
        "annotations": ANNOTATIONS,
        "dims": DIMS,
        "stages": {"pre": pre, "layer": layer, "post": post},
    }


if __name__ == "__main__":
    params = jax.eval_shape(init, jax.random.key(0))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        print(jax.tree_util.keystr(path), leaf.shape)
