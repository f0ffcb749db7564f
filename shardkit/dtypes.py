"""Element sizes and names of array dtypes, typed PRNG keys included.

A typed key array (``jax.random.key``, what ``nnx.Rngs`` holds) has an extended dtype
(``key<fry>``) that NumPy cannot interpret; each key is stored as its key data
(``jax.random.key_data``: two ``uint32`` for threefry, four for rbg), so that is what
it costs in memory, on the wire and in a checkpoint.

Example:
  >>> import jax, numpy as np
  >>> itemsize(np.float32), itemsize(jax.random.key(0).dtype)
  (4, 8)
  >>> itemsize(jax.random.key(0, impl="rbg").dtype), dtype_name(jax.random.key(0).dtype)
  (16, 'key<fry>')
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

__all__ = ["dtype_name", "is_key", "itemsize", "key_data_struct"]


#: Key dtypes by the name :func:`dtype_name` gave them (reports keep dtypes as names).
_KEYS_BY_NAME: dict[str, Any] = {}


def _as_dtype(dtype: Any) -> Any:
    return _KEYS_BY_NAME.get(dtype, dtype) if isinstance(dtype, str) else dtype


def is_key(dtype: Any) -> bool:
    """True for a typed PRNG key dtype (``key<fry>``, ``key<rbg>``, ...)."""
    try:
        return bool(jax.dtypes.issubdtype(_as_dtype(dtype), jax.dtypes.prng_key))
    except TypeError:
        return False


@functools.cache
def _key_data(dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))


def key_data_struct(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of ``jax.random.key_data`` of keys of this shape."""
    data = _key_data(_as_dtype(dtype))
    return jax.ShapeDtypeStruct((*shape, *data.shape), data.dtype)


def itemsize(dtype: Any) -> int:
    """Bytes of one element: NumPy's itemsize, or a key's key data (``dtype`` may be a
    name :func:`dtype_name` gave)."""
    if is_key(dtype):
        data = _key_data(_as_dtype(dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize


def dtype_name(dtype: Any) -> str:
    """``'float32'``, ``'bfloat16'``, ``'key<fry>'``: a dtype's name as JAX prints it."""
    if not is_key(dtype):
        return str(np.dtype(dtype))
    _KEYS_BY_NAME[str(dtype)] = _as_dtype(dtype)
    return str(dtype)
