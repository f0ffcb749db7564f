"""What a compiled program costs: memory per device and what crosses the wire.

``sk.report`` is this module. :func:`build_report` is the one way to make a
:class:`Report`: ``sk.report.build_report(plan, step, state, batch)`` for a step of your
own, ``build_report(plan, compiled, state)`` for a compiled one,
``build_report(plan, model=model, batch=8, seq=32)`` for a model's train step.
``print(report)`` renders it, ``report.to_json()`` gives the data.

Example:
  >>> from shardkit.report import parse_collectives, wire_bytes_by_kind
  >>> wire_bytes_by_kind(parse_collectives("HloModule empty"))
  {}
"""

from shardkit.report.analytic import AnalyticMemory, AnalyticModel, analytic_costs
from shardkit.report.build import build_report
from shardkit.report.estimator import Estimate, estimate
from shardkit.report.hlo import Collective, bytes_by_kind, parse_collectives, wire_bytes_by_kind
from shardkit.report.memory import MemoryStats
from shardkit.report.records import ParamRow
from shardkit.report.report import Report, param_rows
from shardkit.workload import Workload

__all__ = [
    "AnalyticMemory",
    "AnalyticModel",
    "Collective",
    "Estimate",
    "MemoryStats",
    "ParamRow",
    "Report",
    "Workload",
    "analytic_costs",
    "build_report",
    "bytes_by_kind",
    "estimate",
    "param_rows",
    "parse_collectives",
    "wire_bytes_by_kind",
]
