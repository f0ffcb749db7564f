"""Recipes: logical → mesh axes (owned by the layout, never by the model).

Example:
  >>> import shardkit as sk
  >>> sk.recipes.names()
  ['dp', 'fsdp', 'zero1', 'tp', 'tp_sp', 'dp_fsdp', 'fsdp_tp', 'dp_tp_sp', 'cp', 'fsdp_cp', 'cp_usp', 'tsp',
   'dp_tsp', 'tsp_gspmd', 'dp_tsp_gspmd', 'pp', 'dp_pp', 'zeropp',
   'dp_tp_sp_pp', 'ep', 'ep_gspmd', 'fsdp_ep', 'ep_tp']
"""

from __future__ import annotations

from collections.abc import Callable

from shardkit.errors import ShardingError
from shardkit.recipes import catalogue
from shardkit.recipes.recipe import LogitsLayout, Recipe, VocabRules

__all__ = ["LogitsLayout", "Recipe", "VocabRules", "get", "names", "register"]

_REGISTRY: dict[str, Callable[[], Recipe]] = {
    "dp": catalogue.dp,
    "fsdp": catalogue.fsdp,
    "zero1": catalogue.zero1,
    "tp": catalogue.tp,
    "tp_sp": catalogue.tp_sp,
    "dp_fsdp": catalogue.dp_fsdp,
    "fsdp_tp": catalogue.fsdp_tp,
    "dp_tp_sp": catalogue.dp_tp_sp,
    "cp": catalogue.cp,
    "fsdp_cp": catalogue.fsdp_cp,
    "cp_usp": catalogue.cp_usp,
    "tsp": catalogue.tsp,
    "dp_tsp": catalogue.dp_tsp,
    "tsp_gspmd": catalogue.tsp_gspmd,
    "dp_tsp_gspmd": catalogue.dp_tsp_gspmd,
    "pp": catalogue.pp,
    "dp_pp": catalogue.dp_pp,
    "zeropp": catalogue.zeropp,
    "dp_tp_sp_pp": catalogue.dp_tp_sp_pp,
    "ep": catalogue.ep,
    "ep_gspmd": catalogue.ep_gspmd,
    "fsdp_ep": catalogue.fsdp_ep,
    "ep_tp": catalogue.ep_tp,
}


def names() -> list[str]:
    """Names of the registered recipes, in catalogue order."""
    return list(_REGISTRY)


def get(name: str) -> Recipe:
    """The recipe called ``name``.

    Raises:
      ShardingError: no recipe has that name (the message lists them).
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise ShardingError(
            f"A recipe is named by a string, got {name!r}. Known: {', '.join(_REGISTRY)}."
        )
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ShardingError(
            f"Unknown recipe {name!r}. Known recipes: {', '.join(_REGISTRY)}.\n"
            "Fix: pick one of those, or sk.recipes.register(name, factory) your own."
        ) from None


def register(name: str, factory: Callable[[], Recipe]) -> None:
    """Add a recipe factory under ``name`` (replacing any recipe of that name)."""
    _REGISTRY[name] = factory
