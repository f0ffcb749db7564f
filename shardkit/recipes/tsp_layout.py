"""TSP's layout check: a recipe that splits weights and sequences over one axis, on a mesh.

``sk.Plan`` calls :func:`check_layout` when it is built, so a TSP recipe on a mesh its
rings cannot run on fails there, naming the rule and the fix.

Example:
  >>> from shardkit import recipes
  >>> check_layout(recipes.get("tsp"), {"tsp": 8})   # fine: returns None
"""

from __future__ import annotations

from typing import Any

from shardkit.errors import ShardingError
from shardkit.rules import entry_axes

__all__ = ["check_layout"]


def check_layout(recipe: Any, mesh_shape: Any) -> None:
    """Reject a TSP recipe on a mesh it cannot run on (``sk.Plan`` calls this).

    A recipe is TSP when one axis (its ``attention_axis``) splits both parameters and
    the activations' ``length``, or when it asks for ``layer_schedule="tsp"``.

    Raises:
      ShardingError: ``layer_schedule="tsp"`` without that axis on the mesh, or a rule
        that puts the TSP axis and another axis (``tensor``) on the same dimension.

    Example:
      >>> from shardkit import recipes
      >>> check_layout(recipes.get("tsp"), {"tsp": 8})   # fine: returns None
    """
    axis, shape = recipe.attention_axis, dict(mesh_shape)
    on_axis = lambda rules: {n for n, a in rules or () if axis in entry_axes(a)}  # noqa: E731
    is_tsp = bool(on_axis(recipe.rules)) and "length" in on_axis(recipe.activation_rules)
    if recipe.layer_schedule == "tsp" and axis not in shape:
        raise ShardingError(
            f"Recipe {recipe.name!r} runs TSP's schedules over mesh axis {axis!r}, but the "
            f"mesh has axes {shape}.\nFix: add a {axis!r} axis (e.g. sk.make_mesh("
            f"{{{axis!r}: -1}})), or use layer_schedule='gspmd'."
        )
    if not (is_tsp or recipe.layer_schedule == "tsp"):
        return
    if recipe.layer_schedule != "tsp" and getattr(recipe, "context_state", None) is not None:
        return  # context parallelism's ZeRO-3 (fsdp_cp): no rings, XLA gathers the weights
    for rules in (recipe.rules, recipe.activation_rules, recipe.optimizer_rules):
        for name, axes in rules or ():
            both = entry_axes(axes)
            others = [a for a in both if a != axis and shape.get(a, 1) > 1]
            if axis in both and others:
                sizes = ", ".join(f"{a}={shape.get(a, 1)}" for a in both)
                raise ShardingError(
                    f"Recipe {recipe.name!r} maps {name!r} to {tuple(both)} ({sizes}): the "
                    f"TSP axis {axis!r} and {others} on the same dimension. TSP already "
                    f"splits every weight and every sequence {shape.get(axis, 1)} ways "
                    f"over {axis!r}; splitting the same dimension again over {others} "
                    f"breaks its rings.\nFix: map {name!r} to {axis!r} alone and put "
                    f"{others} on another dimension or another recipe (e.g. dp_tsp "
                    "adds data parallelism)."
                )
