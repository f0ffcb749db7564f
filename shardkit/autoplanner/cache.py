"""An on-disk cache of compiled evidence, so asking twice is instant.

The key hashes everything the compiled program depends on: the model (its config, or
its ``module:factory`` name), the batch and sequence, the device count, the candidate,
and the shardkit and jax versions. The hardware is not in the key: the roofline is
recomputed from the cached evidence for any hardware.

The directory is ``$SHARDKIT_CACHE_DIR/autoplan`` (default ``~/.cache/shardkit``).

Example:
  >>> import tempfile
  >>> cache = Cache(tempfile.mkdtemp())
  >>> cache.get({"a": 1}) is None
  True
  >>> cache.put({"a": 1}, {"pruned": "why"}); cache.get({"a": 1})
  {'pruned': 'why'}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax

import shardkit

__all__ = ["Cache", "versions"]


def versions() -> dict[str, str]:
    return {"shardkit": shardkit.__version__, "jax": jax.__version__}


class Cache:
    """JSON files named by the hash of their key."""

    def __init__(self, root: str | Path | None = None):
        base = root or os.environ.get("SHARDKIT_CACHE_DIR") or Path.home() / ".cache" / "shardkit"
        self.root = Path(base) / "autoplan"

    def _path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        return self.root / f"{digest[:32]}.json"

    def get(self, key: dict) -> dict | None:
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: dict, value: dict) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(value))
            tmp.replace(path)
        except OSError:  # a read-only home: plan without the cache
            pass
