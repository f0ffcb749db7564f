"""shardkit: shard Flax models by logical axis names, and see what it costs.

Example:
  >>> import shardkit as sk
  >>> sk.Rules([("batch", "data")]).spec(("batch", None))
  P('data', None)
"""

from shardkit import recipes
from shardkit.annotate import (
    LogicalAxes,
    PathAxes,
    activation_rules,
    axes,
    constrain,
    logical_axes,
    unbox,
)
from shardkit.attention import use_attention
from shardkit.devices import emulate_devices
from shardkit.errors import ShardingError
from shardkit.loss import chunked_cross_entropy
from shardkit.mesh import make_mesh
from shardkit.plan import Plan
from shardkit.replicas import ReplicaView, per_replica
from shardkit.rules import Rules

__version__ = "0.1.0"

__all__ = [
    "LogicalAxes",
    "PathAxes",
    "Plan",
    "ReplicaView",
    "Rules",
    "ShardingError",
    "activation_rules",
    "axes",
    "chunked_cross_entropy",
    "constrain",
    "emulate_devices",
    "logical_axes",
    "make_mesh",
    "per_replica",
    "recipes",
    "unbox",
    "use_attention",
]
