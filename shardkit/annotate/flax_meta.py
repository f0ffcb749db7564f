"""Reading and writing the logical axes Flax itself stores on parameters.

Linen boxes parameters in ``nn.LogicallyPartitioned`` / ``nn.Partitioned``
(``names``); NNX keeps them on the ``nnx.Variable`` as ``out_sharding`` metadata
(older spellings: ``sharding``, ``sharding_names``). shardkit reads both as
logical names, so models annotated the Flax way need no change.

Example:
  >>> import flax.linen as nn, jax.numpy as jnp
  >>> stored_axes(nn.LogicallyPartitioned(jnp.zeros((2, 3)), ("embed", "mlp")))
  ('embed', 'mlp')
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.core import meta

from shardkit import errors
from shardkit.annotate.logical_axes_type import LogicalAxes

__all__ = ["is_annotated_leaf", "stored_axes", "leaf_value", "NNX_KEYS"]

NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


def is_annotated_leaf(x: Any) -> bool:
    """True for a Flax box or NNX Variable: treat it as one leaf, not a node."""
    return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def leaf_value(x: Any) -> Any:
    """The array (or ``ShapeDtypeStruct``) inside a box or Variable, else ``x``."""
    if isinstance(x, nnx.Variable):
        return x.get_value() if hasattr(x, "get_value") else x.value
    if isinstance(x, meta.AxisMetadata):
        return x.unbox()
    return x


def _from_spec(spec: Any, where: str) -> LogicalAxes:
    names = tuple(spec)
    for n in names:
        if n is not None and not isinstance(n, str):
            raise errors.RuleError(
                f"{where}: Flax sharding metadata {names!r} holds {n!r}; shardkit reads these "
                "as logical names, one str or None per dimension."
            )
    return LogicalAxes(names)


def stored_axes(x: Any, where: str = "<leaf>") -> LogicalAxes | None:
    """The logical axes Flax stored on ``x``, or ``None`` if it carries none."""
    if isinstance(x, meta.AxisMetadata):
        names = getattr(x, "names", None)
        return None if names is None else _from_spec(names, where)
    if isinstance(x, nnx.Variable):
        metadata = x.get_metadata()
        for key in NNX_KEYS:
            spec = metadata.get(key)
            if spec:
                return _from_spec(spec, where)
    return None
