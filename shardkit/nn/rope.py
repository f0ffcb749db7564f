"""Rotary position embeddings (RoPE, half-split form): the tables and the rotation.

Shared by the Llama reference model and TSP's attention block (:mod:`shardkit.nn.tsp`).

Example:
  >>> import jax.numpy as jnp
  >>> cos, sin = rope_tables(4, 8)
  >>> apply_rope(jnp.ones((1, 4, 2, 8)), cos, sin).shape
  (1, 4, 2, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_rope", "rope_tables", "rope_tables_at"]

#: The base of the rotary angles' frequencies (Su et al. 2021; Llama's).
_ROPE_THETA = 10000.0


def rope_tables(seq: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of the rotary angles, each ``f32[seq, head_dim // 2]``.

    Example:
      >>> cos, sin = rope_tables(4, 8)
      >>> cos.shape, float(cos[0, 0]), float(sin[0, 0])
      ((4, 4), 1.0, 0.0)
    """
    inv_freq = 1.0 / _ROPE_THETA ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope_tables_at(positions: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` at given ``positions`` ``[batch, seq]`` (packed rows restart
    them per document): each ``f32[batch, seq, head_dim // 2]``.

    Example:
      >>> cos, sin = rope_tables_at(jnp.array([[0, 1, 0]]), 8)
      >>> cos.shape, bool((cos[0, 2] == rope_tables(1, 8)[0][0]).all())
      ((1, 3, 4), True)
    """
    inv_freq = 1.0 / _ROPE_THETA ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x[batch, seq, heads, head_dim]`` by position (half-split pairs), in f32.

    ``cos``/``sin``: ``[seq, head_dim // 2]`` (:func:`rope_tables`) or per row
    ``[batch, seq, head_dim // 2]`` (:func:`rope_tables_at`).

    Example:
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> bool(jnp.allclose(apply_rope(x, *rope_tables(4, 8))[:, 0], x[:, 0]))
      True
    """
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    if cos.ndim == 3:  # per row (rope_tables_at)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    else:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
