"""Readable ``a/b/c`` strings for pytree key paths.

Example:
  >>> import jax
  >>> from shardkit.paths import path_str
  >>> [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path({"a": [1, {"b": 2}]})]
  ['a/0', 'a/1/b']
"""

from __future__ import annotations

from typing import Any

__all__ = ["path_str", "key_name"]


def key_name(key: Any) -> str:
    """The readable name of one key-path entry (dict key, index, attribute)."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: Any) -> str:
    """``('params', 'Dense_0', 'kernel')`` key paths as ``'params/Dense_0/kernel'``."""
    if path is None:
        return "<array>"
    if isinstance(path, str):
        return path
    if isinstance(path, tuple):
        return "/".join(key_name(k) for k in path)
    return str(path)
