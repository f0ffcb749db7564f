"""FLOPs of a compiled program with every while loop counted as often as it runs.

XLA's ``cost_analysis()`` visits a while loop's body (and condition) once, whatever its
trip count, so a ``lax.scan`` over L layers reports one layer's FLOPs: a scanned model,
and the rolled pipeline engine, are under-counted by their loops' trip counts.
:func:`compiled_flops` keeps XLA's own per-instruction costs (its
``HloCostAnalysis``, the same figures as ``cost_analysis()``) and weights each loop by
the ``known_trip_count`` XLA attached to it: a body by its trip count ``n``, a
condition by ``n + 1`` (it runs once more, to exit); loops inside loops multiply. A
conditional keeps XLA's rule (the most expensive branch), now of the branches' weighted
costs. A loop without a known trip count is counted once, as XLA does, and makes the
count inexact (:class:`LoopFlops` ``.exact``).

How: each computation that holds a loop (directly or below) is made the entry of a
module of its own, cut from the program's text, and costed by XLA; the loops' costs are
then replaced by their weighted costs from the innermost out:
``weighted(c) = xla(c) + Σ_loops [n·weighted(body) + (n+1)·weighted(cond)
− xla(body) − xla(cond)] + Σ_other calls [weighted(callee) − xla(callee)]``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def stack(ws, x):  # 12 layers of a [16, 32] @ [32, 32] matmul, in a scan
  ...     return jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0]
  >>> compiled = jax.jit(stack).lower(jnp.ones((12, 32, 32)), jnp.ones((16, 32))).compile()
  >>> f = compiled_flops(compiled)
  >>> f.exact, f.flops / (2 * 16 * 32 * 32 * 12) > 0.999, f.xla / f.flops < 0.1
  (True, True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

from jax._src.lib import xla_client
from jaxlib import _hlo

from shardkit.report.hlo import _CALLS, _INSTR, _NAME, _TRIP, _split

__all__ = ["LoopFlops", "compiled_flops", "weighted_flops"]

_FRAME = re.compile(r",?\s*stack_frame_id=\d+")


@dataclasses.dataclass(frozen=True)
class LoopFlops:
    """A program's FLOPs per device: ``flops`` with loops weighted by their trip counts,
    ``xla`` as ``cost_analysis()`` reports them (each loop body once), and whether every
    loop had a known trip count (``exact``)."""

    flops: float
    xla: float
    exact: bool = True


@dataclasses.dataclass
class _Computation:
    header: str  # the line that opens it, without "ENTRY "
    lines: list[str]  # its instructions and closing brace
    # (opcode, trip count or None, callees by attribute key) of each instruction that calls
    calls: list[tuple[str, int | None, dict[str, list[str]]]]


def _computations(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    """The program's computations by name, in text order, and the entry's name."""
    comps: dict[str, _Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if line[0] not in " }":
            if not line.rstrip().endswith("{"):
                continue
            header = line.removeprefix("ENTRY ")
            name = _NAME.match(header).group(1)
            if header is not line:
                entry = name
            current = comps[name] = _Computation(header, [], [])
            continue
        if current is None:
            continue
        # The text's stack frames are not in it: XLA would warn of each id it cannot find.
        current.lines.append(_FRAME.sub("", line))
        m = _INSTR.match(line)
        if m is None:
            continue
        rest = line[m.end() :]
        split = _split(rest)
        if split is None:
            continue
        opcode, _, attrs_at = split
        attrs = rest[attrs_at + 1 :]
        callees: dict[str, list[str]] = {}
        for key, val in _CALLS.findall(attrs):
            callees.setdefault(key, []).extend(_NAME.findall(val))
        if callees:
            trip = _TRIP.search(attrs) if opcode == "while" else None
            current.calls.append((opcode, int(trip.group(1)) if trip else None, callees))
    return comps, entry


def weighted_flops(hlo_text: str, cost: Callable[[str], float]) -> LoopFlops:
    """:class:`LoopFlops` of an optimized HLO module's text; ``cost(module_text)`` is
    XLA's FLOPs of a module (:func:`compiled_flops` passes the backend's cost analysis).

    Example (a stand-in cost: 10 per computation, its callees' included):
      >>> hlo = '''
      ... %body (p: f32[8]) -> f32[8] {
      ...   ROOT %p = f32[8]{0} parameter(0)
      ... }
      ... %cond (p: f32[8]) -> pred[] {
      ...   ROOT %c = pred[] constant(true)
      ... }
      ... ENTRY %main (x: f32[8]) -> f32[8] {
      ...   %x = f32[8]{0} parameter(0)
      ...   ROOT %w = f32[8]{0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
      ... }'''
      >>> weighted_flops(hlo, lambda text: 10.0 * text.count(") -> "))
      LoopFlops(flops=120.0, xla=30.0, exact=True)
    """
    comps, entry = _computations(hlo_text)

    @functools.cache
    def closure(name: str) -> frozenset[str]:
        out = {name}
        for _, _, callees in comps[name].calls:
            for callee in (c for cs in callees.values() for c in cs):
                if callee in comps and callee not in out:
                    out |= closure(callee)
        return frozenset(out)

    @functools.cache
    def has_loop(name: str) -> bool:
        return any(
            op == "while" or any(has_loop(c) for cs in callees.values() for c in cs if c in comps)
            for op, _, callees in comps[name].calls
        )

    @functools.cache
    def xla(name: str) -> float:
        keep = closure(name)
        parts = ["HloModule flops_of_" + name.replace(".", "_").replace("-", "_")]
        for n, comp in comps.items():
            if n in keep:
                head = ("ENTRY " if n == name else "") + comp.header
                parts.append("\n".join([head, *comp.lines]))
        return cost("\n\n".join(parts) + "\n")

    exact = True

    @functools.cache
    def weighted(name: str) -> float:
        nonlocal exact
        total = xla(name)
        for opcode, trip, callees in comps[name].calls:
            if opcode != "while" and not any(
                has_loop(c) for cs in callees.values() for c in cs if c in comps
            ):
                continue  # XLA's own count is the weighted count
            if opcode == "while":
                exact = exact and trip is not None
                n = 1 if trip is None else trip
                for key, weight in (("body", n), ("condition", n + 1)):
                    for c in callees.get(key, ()):
                        total += weight * weighted(c) - xla(c)
            elif opcode == "conditional":
                branches = [c for cs in callees.values() for c in cs if c in comps]
                total += max(map(weighted, branches)) - max(map(xla, branches))
            else:
                for c in (c for cs in callees.values() for c in cs if c in comps):
                    total += weighted(c) - xla(c)
        return total

    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    flops = weighted(entry)
    return LoopFlops(flops, xla(entry), exact)


def compiled_flops(compiled: Any) -> LoopFlops | None:
    """:class:`LoopFlops` of a ``jax.jit(...).lower(...).compile()`` result, costed by its
    backend's ``HloCostAnalysis``; ``None`` for a backend without a cost model."""
    try:
        compiled.cost_analysis()
        client = compiled.runtime_executable().client
        text = compiled.as_text()
    except Exception:  # a backend without a cost model or without HLO text
        return None

    def cost(module_text: str) -> float:
        module = _hlo.hlo_module_from_text(module_text)
        return float(xla_client._xla.hlo_module_cost_analysis(client, module).get("flops", 0.0))

    return weighted_flops(text, cost)
