"""The auto-planner: rank layouts for a model, a device count and a memory budget
from compiled evidence (see :mod:`shardkit.autoplanner.planner`).

Example:
  >>> import shardkit as sk
  >>> sk.autoplanner.hardware.get("a100").devices_per_node
  8
"""

from shardkit.autoplanner import hardware
from shardkit.autoplanner.candidates import Candidate
from shardkit.autoplanner.hardware import Hardware
from shardkit.autoplanner.planner import (
    AutoplanResult,
    NoLayoutFitsError,
    Ranked,
    Rejected,
    autoplan,
)

__all__ = [
    "AutoplanResult",
    "Candidate",
    "Hardware",
    "NoLayoutFitsError",
    "Ranked",
    "Rejected",
    "autoplan",
    "hardware",
]
