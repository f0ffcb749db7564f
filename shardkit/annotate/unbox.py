"""``sk.unbox``: plain arrays from a tree of Flax boxes / NNX Variables.

Example:
  >>> import flax.linen as nn, jax.numpy as jnp, shardkit as sk
  >>> sk.unbox({"w": nn.LogicallyPartitioned(jnp.zeros(2), ("embed",))})["w"].shape
  (2,)
"""

from __future__ import annotations

from typing import Any

import jax

from shardkit.annotate.flax_meta import is_annotated_leaf, leaf_value

__all__ = ["unbox"]


def unbox(tree: Any) -> Any:
    """Replace every Flax box / NNX Variable in ``tree`` by the array it holds."""
    return jax.tree.map(leaf_value, tree, is_leaf=is_annotated_leaf)
