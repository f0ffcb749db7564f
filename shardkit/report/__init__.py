"""What a compiled program costs: memory per device and what crosses the wire.

Example:
  >>> from shardkit.report import parse_collectives, wire_bytes_by_kind
  >>> wire_bytes_by_kind(parse_collectives("HloModule empty"))
  {}
"""

from shardkit.report.hlo import Collective, bytes_by_kind, parse_collectives, wire_bytes_by_kind

__all__ = ["Collective", "bytes_by_kind", "parse_collectives", "wire_bytes_by_kind"]
