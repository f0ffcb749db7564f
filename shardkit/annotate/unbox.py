"""``sk.unbox``: plain arrays from a tree of Flax boxes / NNX Variables.

NNX objects (``nnx.Module``, ``nnx.Optimizer``) are kept whole: their Variables
*are* their state. Variables in an ``nnx.State`` or a plain container are
replaced by their values, like linen's boxes.

Example:
  >>> import flax.linen as nn, jax.numpy as jnp, shardkit as sk
  >>> sk.unbox({"w": nn.LogicallyPartitioned(jnp.zeros(2), ("embed",))})["w"].shape
  (2,)
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from shardkit.annotate.flax_meta import is_annotated_leaf, leaf_value

__all__ = ["unbox"]


def _keep_or_unbox(x: Any) -> Any:
    return x if isinstance(x, nnx.Pytree) else leaf_value(x)


def unbox(tree: Any) -> Any:
    """Replace every Flax box / NNX Variable outside NNX objects by its array."""
    return jax.tree.map(
        _keep_or_unbox, tree, is_leaf=lambda x: is_annotated_leaf(x) or isinstance(x, nnx.Pytree)
    )
