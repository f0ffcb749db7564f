"""The analytic count of multi-head latent attention's K/V latent per device.

Each layer's latent is ``[batch, seq, d_c]`` (``d_c`` = :attr:`ModelDims.kv_latent`,
:mod:`shardkit.nn.mla`); a layout's activation rules split it over the mesh axes they
put ``batch``, ``length`` and ``kv_latent`` on. With the heads split over ``tensor`` the
latent has no rule and is whole on every tensor rank; ``Recipe.with_latent("split")``
splits it ``t`` ways. Per device: ``L · b · s · d_c · bytes / (product of those axes)``.

Example:
  >>> from shardkit import recipes
  >>> import shardkit as sk
  >>> dims = sk.models.get("deepseek-tiny").dims   # 2 layers, d_c 32
  >>> latent_bytes(dims, "tp", {"tensor": 8}, batch=8, seq=16)   # 2·8·16·32·4
  32768.0
  >>> latent_bytes(dims, recipes.get("tp").with_latent("split"), {"tensor": 8}, batch=8, seq=16)
  4096.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe

__all__ = ["latent_bytes", "latent_split"]

_LATENT = ("batch", "length", "kv_latent")


def latent_split(recipe: str | Recipe, mesh: Mapping[str, int]) -> int:
    """Devices the latent activation ``(batch, length, kv_latent)`` is split over.

    Example:
      >>> from shardkit import recipes
      >>> latent_split("ep_tp", {"expert": 4, "tensor": 2})
      4
      >>> latent_split(recipes.get("ep_tp").with_latent("split"), {"expert": 4, "tensor": 2})
      8
    """
    spec = get_recipe(recipe).activation_rules.spec(_LATENT)
    names = [a for e in spec for a in ((e,) if isinstance(e, str) else tuple(e or ()))]
    return math.prod(int(mesh.get(a, 1)) for a in names)


def latent_bytes(
    dims: ModelDims,
    recipe: str | Recipe,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    itemsize: int = 4,
) -> float:
    """Bytes per device of every layer's K/V latent: ``L·b·s·d_c·itemsize / split``.

    Raises:
      ShardingError: the model has no latent attention (``dims.kv_latent == 0``).
    """
    if not dims.kv_latent:
        raise ShardingError(
            "latent_bytes: the model's dims declare no latent attention (kv_latent=0).\n"
            "Fix: use a model with multi-head latent attention (deepseek-tiny, ...)."
        )
    full = dims.layers * batch * seq * dims.kv_latent * itemsize
    return full / latent_split(recipe, mesh)
