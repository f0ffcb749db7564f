"""shardkit: shard Flax models by logical axis names, and see what it costs.

Example:
  >>> import shardkit as sk
  >>> sk.Rules([("batch", "data")]).spec(("batch", None))
  P('data', None)
"""

from shardkit.annotate import (
    LogicalAxes,
    PathAxes,
    activation_rules,
    axes,
    constrain,
    logical_axes,
    unbox,
)
from shardkit.context import compute_dtype
from shardkit.devices import emulate_devices
from shardkit.errors import ShardingError, ShardingWarning
from shardkit.mesh import make_mesh
from shardkit.nn import attention, loss, replicas
from shardkit.nn.attention import use_attention
from shardkit.nn.loss import chunked_cross_entropy
from shardkit.nn.replicas import ReplicaView, per_replica
from shardkit.plan import Plan
from shardkit.rules import Rules
from shardkit.state import AbstractState

# isort: split
# The packages above the core last: they import the core (shardkit.axes, ...) as they load.
from shardkit import autoplanner, checkpoint, distributed, nn, parallel, recipes, report
from shardkit.autoplanner import autoplan
from shardkit.report.estimator import estimate

__version__ = "0.1.0"

__all__ = [
    "AbstractState",
    "LogicalAxes",
    "PathAxes",
    "Plan",
    "ReplicaView",
    "Rules",
    "ShardingError",
    "ShardingWarning",
    "activation_rules",
    "attention",
    "autoplan",
    "autoplanner",
    "axes",
    "checkpoint",
    "chunked_cross_entropy",
    "compute_dtype",
    "constrain",
    "distributed",
    "emulate_devices",
    "estimate",
    "logical_axes",
    "loss",
    "make_mesh",
    "nn",
    "parallel",
    "per_replica",
    "recipes",
    "replicas",
    "report",
    "unbox",
    "use_attention",
]
