"""XLA's buffer assignment of one compiled program: every value, its bytes and live range.

``memory_analysis()`` gives one number for the temporaries (``temp_size_in_bytes``, the
size of the heap XLA lays them out in). To say *what* is in it, compile the program
once more with ``xla_dump_to`` (:func:`_buffer_assignment`, into a temporary directory)
and read three of the files XLA writes for it (:func:`_read_dump`):

- ``*-buffer-assignment.txt``: allocations (arguments, output, the preallocated temp
  heap, constants), and the values in each with their size and offset;
- ``*-buffer-assignment-values.txt``: each value's defining instruction, with its opcode
  and ``op_name`` metadata (transforms and Flax scopes, see
  :mod:`shardkit.report.provenance`), and the instructions that use it;
- ``*-live-range.txt``: the program order and each value's live range in it.

From those: the program point where the temp heap holds the most live bytes
(:attr:`BufferAssignment.peak_time`) and the values live there
(:meth:`BufferAssignment.live_temps`). Dumping costs one more compile of the step.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda x: jnp.sort(x @ x.T).sum()  # a sort stays an op of its own in XLA
  >>> ba = _buffer_assignment(jax.jit(f).lower(jnp.ones((64, 32))))
  >>> ba.temp_bytes == jax.jit(f).lower(jnp.ones((64, 32))).compile(
  ...     ).memory_analysis().temp_size_in_bytes
  True
  >>> max(ba.live_temps(), key=lambda v: v.size).shape
  'f32[64,64]'
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Any

from shardkit.report.provenance import metadata_of, named_after_use

__all__ = ["BufferAssignment", "Value", "compile_with_buffers"]

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(
    r"^ value: <(\d+) ([^\s{]+)(\{[\d,]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)"
)
_HEADER = re.compile(r"^<(\d+) ([^\s{]+)(\{[\d,]*\})?( \(phi\))? @\d+>")
_USE = re.compile(r"^  (\S+), operand (\d+)")
_DEFINED = re.compile(r"^ from instruction: %(\S+) = (.*)$")
_RANGE = re.compile(r"^    (\S+?)(\{[\d,]*\}):(\d+)-(\d+)$")
_SEQUENCE = re.compile(r"^    (\d+):(\S+)$")


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of the program: an instruction's output (or one tuple element of it).

    ``kind`` is the allocation it lives in: ``"temp"`` (the preallocated temp heap),
    ``"parameter"``, ``"output"``, ``"constant"``, ``"thread-local"`` or ``"other"``.
    ``start``/``end``: its live range in the program order (``None`` if not recorded).
    ``users``/``user_names``: the opcodes / names of the instructions that read it.
    ``frame_id``: its ``stack_frame_id`` (:func:`shardkit.report.provenance.frames_by_id`).
    ``dims``: the dimensions of ``shape`` (``None`` for a tuple).
    """

    id: int
    instruction: str
    index: str
    size: int
    offset: int
    shape: str
    kind: str
    phi: bool = False
    opcode: str = ""
    op_name: str = ""
    users: tuple[str, ...] = ()
    user_names: tuple[str, ...] = ()
    frame_id: int = 0
    start: int | None = None
    end: int | None = None
    dims: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        """``instruction{index}``, as the live-range file names it."""
        return f"{self.instruction}{self.index}"

    def live_at(self, t: int) -> bool:
        return self.start is not None and self.end is not None and self.start <= t <= self.end


@dataclasses.dataclass(frozen=True)
class BufferAssignment:
    """The values of one compiled program and where its temp heap peaks.

    Attributes:
      values: every value XLA assigned a buffer.
      temp_bytes: size of the preallocated temp heap (``temp_size_in_bytes``).
      sequence: instruction names in program order (the live ranges index it).
      peak_time: the program point where the temp heap holds the most live bytes.
      peak_bytes: those bytes (values sharing space counted once); the rest of
        ``temp_bytes`` is space the heap could not pack (fragmentation).
    """

    values: tuple[Value, ...]
    temp_bytes: int
    sequence: tuple[str, ...]
    peak_time: int
    peak_bytes: int

    @property
    def peak_instruction(self) -> str:
        return self.sequence[self.peak_time] if 0 <= self.peak_time < len(self.sequence) else ""

    @property
    def top_value(self) -> Value | None:
        """The temp value laid out highest in the heap: it sets ``temp_bytes``."""
        temps = [v for v in self.values if v.kind == "temp"]
        return max(temps, key=lambda v: (v.offset + v.size, v.size), default=None)

    def live_temps(self, t: int | None = None) -> list[Value]:
        """The temp values live at ``t`` (default: the peak), each byte given to one value.

        Values that share heap space at ``t`` (a loop's carried value and its body's
        parameter, say) are trimmed to the bytes no earlier value covers, so the sizes
        add up to the live bytes: defining (non-phi) values first, then by offset.
        """
        t = self.peak_time if t is None else t
        live = sorted(
            (v for v in self.values if v.kind == "temp" and v.live_at(t)),
            key=lambda v: (v.phi, v.offset, -v.size, v.id),
        )
        out, covered = [], []  # covered: disjoint [lo, hi) intervals
        for v in live:
            own = _uncovered(v.offset, v.offset + v.size, covered)
            if own:
                out.append(dataclasses.replace(v, size=own))
        return out


def _uncovered(lo: int, hi: int, covered: list[list[int]]) -> int:
    """Bytes of [lo, hi) not in ``covered`` (disjoint intervals); adds [lo, hi) to it."""
    free = hi - lo
    for a, b in covered:
        free -= max(0, min(hi, b) - max(lo, a))
    covered.append([lo, hi])
    _merge(covered)
    return max(free, 0)


def _merge(intervals: list[list[int]]) -> None:
    intervals.sort()
    merged: list[list[int]] = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    intervals[:] = merged


def _kind(description: str) -> str:
    for kind in ("preallocated-temp", "parameter", "output", "constant", "thread-local"):
        if description.startswith(kind) or f", {kind}" in description:
            return "temp" if kind == "preallocated-temp" else kind
    return "other"


def _opcode(definition: str) -> str:
    """The opcode of ``SHAPE opcode(operands), ...`` (a tuple shape is parenthesised)."""
    if definition.startswith("("):
        depth, end = 0, len(definition)
        for j, ch in enumerate(definition):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = j + 1
                break
        rest = definition[end:].lstrip()
    else:
        rest = definition.split(" ", 1)[1] if " " in definition else ""
    return rest.split("(", 1)[0].strip()


def _shape(text: str) -> tuple[str, tuple[int, ...] | None]:
    """(``f32[2,8]``, ``(2, 8)``) of ``f32[2,8]{1,0}``; ``("tuple", None)`` for a tuple."""
    if text.startswith("("):
        return "tuple", None
    shape = text.split("{")[0]
    inside = shape[shape.find("[") + 1 : shape.rfind("]")] if "[" in shape else ""
    return shape, tuple(int(d) for d in inside.split(",") if d.isdigit())


def _one(directory: str, suffix: str) -> str:
    paths = sorted(glob.glob(os.path.join(directory, f"*{suffix}")))
    if len(paths) != 1:
        raise FileNotFoundError(f"expected one *{suffix} in {directory}, found {len(paths)}")
    with open(paths[0]) as f:
        return f.read()


def _read_dump(directory: str) -> BufferAssignment:
    """Read the buffer assignment XLA dumped for one program into ``directory``."""
    base = "cpu_after_optimizations" if glob.glob(os.path.join(directory, "*cpu_after*")) else ""
    assignment = _one(directory, f"{base}-buffer-assignment.txt")
    details = _one(directory, f"{base}-buffer-assignment-values.txt")
    ranges = _one(directory, f"{base}-live-range.txt")

    defined: dict[int, tuple[str, str, tuple[str, ...], int]] = {}
    instructions: dict[str, tuple[str, str, int]] = {}  # name -> (opcode, op_name, frame)
    used_by: dict[str, list[str]] = {}  # instruction -> the instructions reading its values
    vid, users, in_uses = None, [], False
    for line in details.splitlines():
        if m := _HEADER.match(line):
            vid, users, in_uses = int(m.group(1)), [], False
        elif line.startswith(" uses:"):
            in_uses = True
        elif line.startswith(" positions:"):
            in_uses = False
        elif in_uses and (m := _USE.match(line)):
            users.append(m.group(1))
        elif vid is not None and (m := _DEFINED.match(line)):
            op_name, frame_id = metadata_of(m.group(2))
            defined[vid] = (_opcode(m.group(2)), op_name, tuple(users), frame_id)
            instructions[m.group(1)] = (_opcode(m.group(2)), op_name, frame_id)
            used_by.setdefault(m.group(1), []).extend(users)

    def uses(name: str) -> list[tuple[str, str, str, int]]:
        """(user, opcode, op_name, frame) of the instructions reading ``name``'s values."""
        return [
            (u, *instructions.get(u, ("", "", 0))) for u in dict.fromkeys(used_by.get(name, ()))
        ]

    sequence: list[str] = []
    live: dict[str, tuple[int, int]] = {}
    for line in ranges.splitlines():
        if m := _SEQUENCE.match(line):
            sequence.append(m.group(2))
        elif m := _RANGE.match(line):
            live[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))

    values: list[Value] = []
    temp_bytes, kind = 0, "other"
    for line in assignment.splitlines():
        if m := _ALLOCATION.match(line):
            kind = _kind(m.group(3))
            temp_bytes += int(m.group(2)) if kind == "temp" else 0
        elif m := _VALUE.match(line):
            vid = int(m.group(1))
            opcode, op_name, users_of, frame_id = defined.get(vid, ("", "", (), 0))
            if opcode.startswith("all-gather"):  # named after the layer that uses it
                op_name, frame_id = named_after_use(op_name, frame_id, m.group(2), uses)
            index = m.group(3) or "{}"
            start, end = live.get(m.group(2) + index, (None, None))
            shape, dims = _shape(m.group(7))
            values.append(
                Value(
                    id=vid,
                    instruction=m.group(2),
                    index=index,
                    size=int(m.group(5)),
                    offset=int(m.group(6)),
                    shape=shape,
                    dims=dims,
                    kind=kind,
                    phi=bool(m.group(4)),
                    opcode=opcode,
                    op_name=op_name,
                    start=start,
                    end=end,
                    users=users_of,
                    user_names=users_of,
                    frame_id=frame_id,
                )
            )
    opcodes = {v.instruction: v.opcode for v in values if v.opcode}
    values = [
        dataclasses.replace(v, users=tuple(opcodes.get(u, u) for u in v.users)) for v in values
    ]
    peak_time, peak_bytes = _peak([v for v in values if v.kind == "temp"], len(sequence))
    return BufferAssignment(
        values=tuple(values),
        temp_bytes=temp_bytes,
        sequence=tuple(sequence),
        peak_time=peak_time,
        peak_bytes=peak_bytes,
    )


def _peak(temps: list[Value], length: int) -> tuple[int, int]:
    """(program point, bytes) where the live temp values cover the most heap bytes.

    The covered bytes change only where a value's live range starts or ends, and grow
    only where one starts: the earliest peak is at a start, so only the starts are
    scored, each over the values live there (a sweep in program order).
    """
    ranged = sorted(
        (v for v in temps if v.start is not None and v.end is not None),
        key=lambda v: v.start,
    )
    best_t, best = 0, 0
    live: list[Value] = []
    for i, v in enumerate(ranged):
        t = v.start
        if t >= length:
            break
        live = [u for u in live if u.end >= t]
        live.append(v)
        if i + 1 < len(ranged) and ranged[i + 1].start == t:
            continue  # score t once, with every value starting there
        covered = [[u.offset, u.offset + u.size] for u in live]
        _merge(covered)
        total = sum(b - a for a, b in covered)
        if total > best:
            best_t, best = t, total
    return best_t, best


def compile_with_buffers(lowered: Any, **compiler_options: Any) -> tuple[Any, BufferAssignment]:
    """Compile ``lowered`` (a ``jax.stages.Lowered``) with XLA's dump on: (compiled, its
    buffer assignment).

    The dump goes to a temporary directory, removed afterwards; only the files of this
    one program are read. ``compiler_options`` are passed to ``lowered.compile`` too.
    """
    with tempfile.TemporaryDirectory(prefix="shardkit-xla-dump-") as directory:
        options = {**compiler_options, "xla_dump_to": directory}
        compiled = lowered.compile(compiler_options=options)
        return compiled, _read_dump(directory)


def _buffer_assignment(lowered: Any, **compiler_options: Any) -> BufferAssignment:
    """The buffer assignment of ``lowered`` compiled (see :func:`compile_with_buffers`)."""
    return compile_with_buffers(lowered, **compiler_options)[1]
