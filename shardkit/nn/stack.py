"""One layer of a stack of identical layers as a function, for a pipeline's ``Stages``.

A pipeline (``shardkit.protocol.Stages``) runs ``layer(layer_params, x) -> x`` once per
slice of the stacked parameters:

- linen: the block you ``nn.scan`` (``layer = linen_layer(Block(...))``);
- NNX: the module you built with ``nnx.vmap`` (``layer = nnx_layer(model.layers)``).

Example:
  >>> import flax.linen as nn, jax, jax.numpy as jnp
  >>> w = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  >>> linen_layer(nn.Dense(4))(w, jnp.ones((2, 4))).shape
  (2, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

__all__ = ["linen_layer", "nnx_layer"]


def linen_layer(block: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``layer(params, x)`` for a linen block (the module ``nn.scan`` stacks).

    The block may return ``x`` or ``(x, carry_out)`` (the ``nn.scan`` convention).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> layer = linen_layer(nn.Dense(4))
      >>> w = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 4)))["params"]
      >>> layer(w, jnp.ones((2, 4))).shape
      (2, 4)
    """

    def layer(params: Any, x: jax.Array) -> jax.Array:
        out = block.apply({"params": params}, x)
        return out[0] if isinstance(out, tuple) else out

    return layer


def nnx_layer(layers: Any, *args: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``layer(state, x)`` for an NNX module built with ``nnx.vmap`` (one slice of its state).

    ``args`` are passed after ``x`` (e.g. rotary tables).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import jax.numpy as jnp
      >>> @nnx.vmap(in_axes=0, out_axes=0)
      ... def make(key):
      ...     return nnx.Linear(4, 4, rngs=nnx.Rngs(key))
      >>> stack = make(jax.random.split(jax.random.key(0), 3))
      >>> layer = nnx_layer(stack)
      >>> state = nnx.state(stack, nnx.Param)
      >>> layer(jax.tree.map(lambda a: a[0], state), jnp.ones((2, 4))).shape
      (2, 4)
    """
    graphdef, _ = nnx.split(layers)

    def layer(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x, *args)

    return layer
