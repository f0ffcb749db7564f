"""Annotate: path → logical axes (owned by the model, never by a recipe)."""

from shardkit.annotate.constrain import activation_rules, constrain
from shardkit.annotate.decorator import axes
from shardkit.annotate.logical import LeafInfo, describe_leaves, logical_axes
from shardkit.annotate.logical_axes_type import LogicalAxes
from shardkit.annotate.path_axes import PathAxes
from shardkit.annotate.unbox import unbox

__all__ = [
    "LeafInfo",
    "LogicalAxes",
    "PathAxes",
    "activation_rules",
    "axes",
    "constrain",
    "describe_leaves",
    "logical_axes",
    "unbox",
]
