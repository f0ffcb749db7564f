"""Collective inventory of an optimized HLO module: what crosses the wire, and how often.

:func:`parse_collectives` reads the text of ``jax.jit(f).lower(...).compile().as_text()``
and returns one :class:`Collective` per collective op, with its buffer size, replica-group
size, ring-algorithm wire bytes per device and how many
times it runs per step (the product of the trip counts of the while loops around it).

Example:
  >>> hlo = '''
  ... ENTRY %main (p: f32[1024]) -> f32[1024] {
  ...   %p = f32[1024]{0} parameter(0)
  ...   ROOT %ar = f32[1024]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  ... }'''
  >>> [c] = parse_collectives(hlo)
  >>> c.kind, c.bytes, c.group_size, c.wire_bytes, c.count
  ('all-reduce', 4096, 4, 6144.0, 1)

Reduce-scatters that the CPU pipeline leaves unformed: a partitioned program that needs a
reduce-scatter is first emitted as an ``all-reduce`` whose result each device then cuts
down with a ``dynamic-slice`` at an offset derived from its partition id. The GPU and TPU
pipelines run XLA's ReduceScatterCreator, which rewrites exactly that pair into one
``reduce-scatter`` (moving (N-1)/N of the buffer instead of 2(N-1)/N); the CPU pipeline
does not, so the emulated-device programs this project measures still contain the pair.
:func:`parse_collectives` therefore reports, per all-reduce element (tuple all-reduces
are split by element), an element whose every use -- through ``get-tuple-element`` (or
the ``%x#k`` operand that jax 0.12's dumps print instead), ``bitcast``, ``copy`` and
``convert``, directly or inside the computation of a fusion (and on through the fusion's
users where its computation returns the values so moved) -- is a ``dynamic-slice``
keeping 1/N of it, as the ``reduce-scatter`` it is in effect, with
``lowered_as="all-reduce+dynamic-slice"`` recording what the CPU program really contains
(``lowered_as`` is empty for collectives reported as emitted). ``fuse_reduce_scatter=False``
reports every op as emitted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

import numpy as np

from shardkit.collectives import KINDS, Kind
from shardkit.report.provenance import (
    block_of,
    frames_by_id,
    metadata_of,
    module_path_of,
    named_after_use,
    pass_of,
    source_of,
)

__all__ = [
    "Collective",
    "KINDS",
    "LOWERED_RS",
    "bytes_by_kind",
    "collectives_of",
    "first_group",
    "parse_collectives",
    "wire_bytes_by_kind",
]


_BITS = {
    "pred": 8,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_COMP = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)")
_INSTR = re.compile(r"\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_NAME = re.compile(r"%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")
# An operand: %x, or %x#1 (element 1 of tuple x; %x#1#0 nests), the form that the XLA of
# jax >= 0.12 prints in its dumps in place of get-tuple-element instructions.
_REF = re.compile(r"%([\w.\-]+(?:#\d+)*)")
_INDEX = re.compile(r"\bindex=(\d+)")
LOWERED_RS = "all-reduce+dynamic-slice"

Shape = tuple[str, tuple[int, ...], int] | list["Shape"]  # (dtype, dims, bits) | tuple


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective op of a compiled program, built with keywords.

    ``bytes`` is the buffer the ring formula uses (the result for all-gather, the
    operand otherwise; summed over tuple elements), for one execution. ``wire_bytes``
    is the ring-algorithm traffic per device, already multiplied by ``count`` (the
    executions per step). ``shape`` is the dimensions of that buffer (a tuple of ints);
    ``shapes`` holds one such tuple per element of a tuple-combined op (``(shape,)``
    otherwise) and ``shape`` is then its first element. ``count_exact`` is False when an
    enclosing while loop had no ``known_trip_count`` and was counted once. ``lowered_as``
    says how the program really implements a collective reported as another kind
    (``"all-reduce+dynamic-slice"`` for a reduce-scatter the CPU pipeline left
    unformed); empty when reported as emitted. ``group`` holds the device ids of the
    first replica group (for a collective-permute, every device that sends or receives);
    empty when the program does not say. ``logical`` and ``rule``: the logical axes of
    the parameter the op moves and the plan's rules that shard them, where one matches
    (:func:`shardkit.report.wire_terms.attach_layouts`). ``source`` is the model's line
    that asked for the op and ``block`` the shardkit building block that made it
    (``attention.ring``; ``""`` for the model's own ops), see
    :mod:`shardkit.report.provenance`.

    Example:
      >>> c = Collective(kind="all-gather", bytes=256, group_size=4, wire_bytes=192.0,
      ...                count=1, dtype="f32", shape=(8, 8))
      >>> c.shapes, c.shape_text, c.elements
      (((8, 8),), '[8,8]', 64)
    """

    kind: Kind
    bytes: int
    group_size: int
    wire_bytes: float
    count: int = 1
    op_name: str = ""
    computation: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    count_exact: bool = True
    lowered_as: str = ""
    module_path: str = ""
    pass_: str = ""
    source: str = ""
    function: str = ""
    block: str = ""
    group: tuple[int, ...] = ()
    logical: tuple[str | None, ...] = ()
    rule: str = ""

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if not shapes and self.shape:
            shapes = (tuple(self.shape),)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "shape", shapes[0] if shapes else tuple(self.shape))

    @property
    def where(self) -> str:
        """The model path of the op, else the function of the model code that asked for it."""
        return self.module_path or self.function

    @property
    def shape_text(self) -> str:
        """``[64,16]``, or ``([64], [256,64])`` for a tuple-combined op (for display)."""
        text = ["[" + ",".join(map(str, s)) + "]" for s in self.shapes] or ["[]"]
        return text[0] if len(text) == 1 else "(" + ", ".join(text) + ")"

    @property
    def elements(self) -> int:
        """Elements of ``shape`` (the first array)."""
        return math.prod(self.shape)


_BRACKETS = {"(": re.compile(r"[()]"), "{": re.compile(r"[{}]"), "[": re.compile(r"[\[\]]")}


def _skip_balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at ``s[i]``."""
    depth = 0
    for m in _BRACKETS[s[i]].finditer(s, i):
        depth += 1 if m.group() == s[i] else -1
        if depth == 0:
            return m.end()
    return len(s)


def _shape_arrays(text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """Arrays (dtype, dims, bits) of the shape that ``text`` starts with."""
    return _arrays(_parse_shape(_COMMENT.sub("", text))[0])


def _parse_shape(s: str, i: int = 0) -> tuple[Shape, int]:
    """Parse an HLO shape (``f32[8,16]{1,0}`` or a nested tuple) starting at ``s[i]``."""
    while s[i] == " ":
        i += 1
    if s[i] == "(":
        elems: list[Shape] = []
        i += 1
        while i < len(s) and s[i] != ")":
            e, i = _parse_shape(s, i)
            elems.append(e)
            while i < len(s) and s[i] in ", ":
                i += 1
        return elems, i + 1
    m = _ARRAY.match(s, i)
    if m is None:
        raise ValueError(f"not an HLO shape: {s[i : i + 40]!r}")
    dims = tuple(
        int(d.lstrip("<=")) if d.strip("<=").isdigit() else 0 for d in m.group(2).split(",") if d
    )
    bits = 8 if m.group(1).startswith("f8") else _BITS.get(m.group(1), 8)
    j = m.end()
    if j < len(s) and s[j] == "{":  # layout; E(n) gives packed sub-byte element bits
        end = _skip_balanced(s, j)
        e = re.search(r"E\((\d+)\)", s[j:end])
        bits, j = (int(e.group(1)) if e else bits), end
    return (m.group(1), dims, bits), j


def _arrays(shape: Shape) -> list[tuple[str, tuple[int, ...], int]]:
    if isinstance(shape, list):
        return [a for e in shape for a in _arrays(e)]
    return [shape]


def _nbytes(arrays: list[tuple[str, tuple[int, ...], int]]) -> int:
    return sum((math.prod(dims) * bits + 7) // 8 for _, dims, bits in arrays)


def _dtypes(arrays: list[tuple[str, tuple[int, ...], int]]) -> str:
    return ",".join(dict.fromkeys(a[0] for a in arrays))


def _group_size(attrs: str, kind: str, default: int) -> int:
    """Replica-group size N from explicit, iota or mesh-axes replica groups."""
    if kind == "collective-permute":  # largest connected set of source/target devices
        m = _PAIRS.search(attrs)
        if m is None:
            return default
        parent: dict[str, str] = {}

        def root(x: str) -> str:
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)):
            parent[root(a)] = root(b)
        sizes = defaultdict(int)
        for x in parent:
            sizes[root(x)] += 1
        return max(sizes.values(), default=1)
    i = attrs.find("replica_groups=")
    if i < 0:
        return default
    s = attrs[i + len("replica_groups=") :]
    if s.startswith("{{"):  # {{0,1,2,3},{4,5,6,7}}
        return s[2 : s.index("}")].count(",") + 1
    if s.startswith("{}"):
        return default
    if s.startswith("["):  # iota: [groups,size]<=[...]...
        return int(s[1 : s.index("]")].split(",")[-1])
    if s.startswith("maximal_mesh"):
        return 1
    if s.startswith("mesh["):  # mesh['a'=2,'b'=4](, device_ids=(...))? {'b', 'a':(1)2}
        end = _skip_balanced(s, 4)
        sizes = {}
        for item in s[5 : end - 1].split(","):
            name, _, size = item.rpartition("=")
            sizes[name.strip(" '\"")] = int(size)
        if s.startswith(", device_ids=", end):
            end = _skip_balanced(s, s.index("(", end))
        lo = s.index("{", end)
        n = 1
        for ax in s[lo + 1 : s.index("}", lo)].split(","):
            name, _, sub = ax.partition(":(")
            n *= int(sub.partition(")")[2]) if sub else sizes.get(name.strip(" '\""), 1)
        return n
    return default


def first_group(attrs: str, kind: str) -> tuple[int, ...]:
    """Device ids of an op's first replica group (explicit or iota form); for a
    collective-permute, every device of its source/target pairs. ``()`` if unknown.

    Example:
      >>> first_group("replica_groups=[2,4]<=[4,2]T(1,0)", "all-gather")
      (0, 2, 4, 6)
      >>> first_group("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}", "")
      (0, 1)
    """
    if kind == "collective-permute":
        m = _PAIRS.search(attrs)
        ids = {int(x) for x in re.findall(r"\d+", m.group(1))} if m else set()
        return tuple(sorted(ids))
    i = attrs.find("replica_groups=")
    if i < 0:
        return ()
    s = attrs[i + len("replica_groups=") :]
    if s.startswith("{{"):
        return tuple(int(x) for x in s[2 : s.index("}")].split(","))
    if s.startswith("mesh["):
        return _mesh_first_group(s)
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
    if m is None:
        return ()
    ids = _iota(m.group(3), m.group(4))
    return tuple(int(x) for x in ids.reshape(int(m.group(1)), int(m.group(2)))[0])


def _iota(dims: str, perm: str | None):
    """``arange`` reshaped to ``dims`` and transposed by ``perm`` (HLO's iota lists)."""
    shape = [int(x) for x in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _mesh_first_group(s: str) -> tuple[int, ...]:
    """First group of ``mesh['a'=2,'b'=4](, device_ids=(...))? {'b', 'a':(1)2}``."""
    end = _skip_balanced(s, 4)
    axes = [
        (n.strip(" '\""), int(v))
        for n, _, v in (item.rpartition("=") for item in s[5 : end - 1].split(","))
    ]
    ids = np.arange(int(np.prod([v for _, v in axes])))
    if s.startswith(", device_ids=", end):
        close = _skip_balanced(s, s.index("(", end))
        inner = s[s.index("(", end) + 1 : close - 1]
        m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", inner.strip())
        ids = (
            _iota(m.group(1), m.group(2)).ravel()
            if m
            else np.array([int(x) for x in re.findall(r"\d+", inner)])
        )
        end = close
    lo = s.index("{", end)
    wanted: dict[str, tuple[int, int] | None] = {}
    for item in s[lo + 1 : s.index("}", lo)].split(","):
        name, _, sub = item.partition(":(")
        pre, _, size = sub.partition(")")
        wanted[name.strip(" '\"")] = (int(pre), int(size)) if sub else None
    shape, index = [], []
    for name, size in axes:
        if name in wanted and wanted[name] is not None:
            pre, sub = wanted[name]
            shape += [pre, sub, size // (pre * sub)]
            index += [0, slice(None), 0]
        else:
            shape.append(size)
            index.append(slice(None) if name in wanted else 0)
    return tuple(int(x) for x in ids.reshape(shape)[tuple(index)].ravel())


def _wire(kind: str, nbytes: int, n: int) -> float:
    if kind == "collective-permute":
        return float(nbytes)
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes


def _element_text(text: str, index: int) -> str:
    """The shape text of element ``index`` of the tuple shape that ``text`` starts with."""
    s = _COMMENT.sub("", text)
    i = s.index("(")
    if s[:i].strip():
        raise ValueError(f"not a tuple shape: {text[:40]!r}")
    i += 1
    for _ in range(index + 1):
        while s[i] in ", ":
            i += 1
        if s[i] == ")":
            raise ValueError(f"no element {index} in {text[:40]!r}")
        start = i
        _, i = _parse_shape(s, i)
    return s[start:i]


def _add_tuple_elements(ref: str, shapes: dict[str, str], users: dict[str, list[str]]) -> None:
    """Give ``%x#i#j`` (newer XLA's tuple-element operand) the ``get-tuple-element``
    chain older XLA prints: ``x#i`` is element ``i`` of ``x``, used by ``x#i#j``.

    Example:
      >>> shapes, users = {"ar": "(f32[8]{0}, (bf16[4], s32[])) all-reduce(%a, %b, %c)"}, {}
      >>> _add_tuple_elements("ar#1#0", shapes, users)
      >>> shapes["ar#1"], shapes["ar#1#0"], users
      ('(bf16[4], s32[]) get-tuple-element(%ar), index=1', 'bf16[4] get-tuple-element(%ar#1), index=0', {'ar': ['ar#1'], 'ar#1': ['ar#1#0']})
    """
    name, *indices = ref.split("#")
    for k in indices:
        element = f"{name}#{k}"
        if element not in shapes:
            try:
                shape = _element_text(shapes.get(name, ""), int(k))
            except (ValueError, IndexError):  # the tuple is not in the text: shape unknown
                shape = ""
            shapes[element] = f"{shape} get-tuple-element(%{name}), index={k}"
            users.setdefault(name, []).append(element)
        name = element


def _split(rest: str) -> tuple[str, int, int] | None:
    """(opcode, start, end) of the operand list of an instruction's text after ``=``."""
    j = _skip_balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    op = _OPCODE.match(rest, j)
    if op is None:
        return None
    return op.group(1), op.end(), _skip_balanced(rest, op.end() - 1) - 1


@dataclasses.dataclass
class _Graph:
    """Who uses what, for following all-reduce results to their dynamic-slices."""

    text: dict[str, str]  # instruction name -> its text after "="
    users: dict[str, list[str]]
    params: dict[tuple[str, int], str]  # (computation, parameter number) -> name
    fusion_calls: dict[str, str]  # fusion instruction -> its fused computation
    roots: dict[str, str]  # a computation's ROOT instruction -> the computation

    def uses(self, name: str) -> list[tuple[str, str, list[str], str]]:
        """(user, opcode, operand names, attributes) of every distinct user of ``name``."""
        out = []
        for u in dict.fromkeys(self.users.get(name, ())):
            rest = self.text[u]
            opcode, a, b = _split(rest) or ("", 0, 0)
            out.append((u, opcode, _REF.findall(rest, a, b), rest[b + 1 :]))
        return out

    def only_sliced(self, name: str | None, elements: int, n: int, via: str | None = None) -> bool:
        """Whether every use of ``name`` is a dynamic-slice of 1/n of its ``elements``.

        Element-wise moves and casts (``bitcast``, ``copy``, ``convert``) pass the values
        on; so does a fusion whose computation returns them so moved (``via``: the fusion
        the walk entered its computation by, whose users are then followed): XLA:CPU's
        float normalisation all-reduces bfloat16 partial sums in float32 and converts
        the result back before the slice."""
        if name is None:
            return False
        if name in self.roots:
            entered = via is not None and self.fusion_calls.get(via) == self.roots[name]
            return entered and self.only_sliced(via, elements, n)
        uses = self.uses(name)
        for user, opcode, operands, _ in uses:
            if opcode in ("bitcast", "copy", "convert"):
                ok = self.only_sliced(user, elements, n, via)
            elif opcode == "dynamic-slice":
                ok = operands[:1] == [name] and name not in operands[1:]
                ok = ok and _nelems(self.text[user]) * n == elements
            elif opcode == "fusion" and user in self.fusion_calls:
                comp = self.fusion_calls[user]
                ok = all(
                    self.only_sliced(self.params.get((comp, i)), elements, n, user)
                    for i, o in enumerate(operands)
                    if o == name
                )
            else:
                ok = False
            if not ok:
                return False
        return bool(uses)

    def uses_named(self, name: str) -> list[tuple[str, str, str, int]]:
        """(user, opcode, user's op_name, user's frame) of every user of ``name``."""
        return [(u, op, *metadata_of(self.text[u])) for u, op, _, _ in self.uses(name)]

    def sliced_elements(self, name: str, opcode: str, shape: Shape, n: int) -> set[int]:
        """Indices of the elements of all-reduce ``name`` that are only used 1/n-sliced."""
        values = [name]
        if opcode != "all-reduce":  # all-reduce-start: the values are its -done's
            values = [u for u, op, _, _ in self.uses(name) if op == "all-reduce-done"]
        elems = shape if isinstance(shape, list) else [shape]
        if n <= 1 or not values or any(isinstance(e, list) for e in elems):
            return set()
        sizes = [math.prod(e[1]) for e in elems]
        if not isinstance(shape, list):
            return {0} if all(self.only_sliced(v, sizes[0], n) for v in values) else set()
        by_index: dict[int, list[str]] = defaultdict(list)
        for v in values:
            if v in self.roots:
                return set()
            for user, op, _, attrs in self.uses(v):
                i = _INDEX.search(attrs)
                if op != "get-tuple-element" or i is None:
                    return set()  # the whole tuple escapes: every element is used
                by_index[int(i.group(1))].append(user)
        return {
            k
            for k, gtes in by_index.items()
            if k < len(sizes) and all(self.only_sliced(g, sizes[k], n) for g in gtes)
        }


def _nelems(text: str) -> int:
    return sum(math.prod(a[1]) for a in _shape_arrays(text))


def collectives_of(compiled: Any, *, fuse_reduce_scatter: bool = True) -> list[Collective]:
    """:func:`parse_collectives` of a compiled program, with each op's Python stack.

    The stacks come from the executable's ``HloModuleProto`` (the text lacks the links
    between frames); without them ``source`` and ``function`` stay empty.
    """
    stacks: dict[int, tuple] = {}
    try:
        modules = compiled.runtime_executable().hlo_modules()
        stacks = frames_by_id(modules[0].as_serialized_hlo_module_proto())
    except (AttributeError, IndexError, ValueError):  # a backend without HLO modules
        pass
    return parse_collectives(
        compiled.as_text(), fuse_reduce_scatter=fuse_reduce_scatter, stacks=stacks
    )


def parse_collectives(
    hlo_text: str, *, fuse_reduce_scatter: bool = True, stacks: dict[int, tuple] | None = None
) -> list[Collective]:
    """Every collective in an optimized HLO module, weighted by its executions per step.

    Handles tuple-combined collectives, async ``*-start``/``*-done`` pairs and
    ``async-start`` wrappers (counted once, at the start), explicit/iota/mesh replica
    groups, and ``known_trip_count`` of while loops along the call path from ENTRY.
    With ``fuse_reduce_scatter`` (the default), all-reduce elements that are only used
    through dynamic-slices of 1/N of them are reported as ``reduce-scatter`` with
    ``lowered_as="all-reduce+dynamic-slice"`` (see the module docstring); the other
    elements of the same op stay one ``all-reduce``. A ``conditional`` runs one branch:
    the collectives of its costliest one (by wire bytes) are counted, the others' come
    with ``count=0`` unless something else calls them.

    Example:
      >>> hlo = '''
      ... %body (p: f32[8]) -> f32[8] {
      ...   %p = f32[8]{0} parameter(0)
      ...   ROOT %ag = f32[64]{0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
      ... }
      ... ENTRY %main (x: f32[8]) -> f32[8] {
      ...   %x = f32[8]{0} parameter(0)
      ...   ROOT %w = f32[8]{0} while(%x), body=%body, backend_config={"known_trip_count":{"n":"12"}}
      ... }'''
      >>> [(c.kind, c.bytes, c.count, c.wire_bytes) for c in parse_collectives(hlo)]
      [('all-gather', 256, 12, 2688.0)]
    """
    header = hlo_text[: hlo_text.find("\n")] if hlo_text.startswith("HloModule") else ""
    default_n = 1
    for key in ("replica_count", "num_partitions"):
        m = re.search(key + r"=(\d+)", header)
        default_n *= int(m.group(1)) if m else 1

    shapes: dict[str, str] = {}  # instruction name -> text from its shape on (lazy parse)
    found: list[tuple[str, ...]] = []  # (comp, kind, opcode, rest, args, attrs, name)
    track = fuse_reduce_scatter and "all-reduce" in hlo_text
    link = track or "all-gather" in hlo_text  # record who uses what
    graph = _Graph(shapes, defaultdict(list), {}, {}, {})
    edges: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)  # caller -> callees
    async_parent: dict[str, tuple[str, str, int]] = {}  # wrapped comp -> (caller, op_name, frame)
    # each conditional's computation and its branches (callee, index in edges[comp])
    conditionals: list[tuple[str, list[tuple[str, int]]]] = []
    comps: list[str] = [""]  # "": instructions outside any computation (a fragment)
    comp = ""
    for line in hlo_text.splitlines():
        if not line or line[0] == "}":
            continue
        if line[0] != " ":
            if line.endswith("{") and not line.startswith("HloModule"):
                m = _COMP.match(line)
                if m:
                    comp = m.group(1)
                    comps.append(comp)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        name, rest = m.group(1), line[m.end() :]
        shapes[name] = rest
        split = _split(rest)
        if split is None:
            continue
        opcode, args_at, attrs_at = split
        attrs = rest[attrs_at + 1 :]
        base = opcode[:-6] if opcode.endswith("-start") else opcode
        if base in KINDS:
            found.append((comp, base, opcode, rest, rest[args_at:attrs_at], attrs, name))
        if "#" in rest[args_at:attrs_at]:  # tuple elements referred to as %x#k
            for a in _REF.findall(rest, args_at, attrs_at):
                if "#" in a:
                    _add_tuple_elements(a, shapes, graph.users)
        if link:
            for a in _REF.findall(rest, args_at, attrs_at):
                graph.users[a].append(name)
            if opcode == "parameter" and rest[args_at:attrs_at].isdigit():
                graph.params[comp, int(rest[args_at:attrs_at])] = name
            if "ROOT" in line[: m.start(1)]:
                graph.roots[name] = comp
        if "=" not in attrs or opcode.endswith(("-done", "-update")):
            continue
        trip, exact = 1, True
        if opcode == "while":
            t = _TRIP.search(attrs)
            trip, exact = (int(t.group(1)), True) if t else (1, False)
        branches: list[tuple[str, int]] = []
        for key, val in _CALLS.findall(attrs):
            for callee in _NAME.findall(val):
                if opcode == "conditional" and key != "to_apply":
                    branches.append((callee, len(edges[comp])))
                if opcode == "fusion" and key == "calls":
                    graph.fusion_calls[name] = callee
                loop = key in ("body", "condition")
                edges[comp].append((callee, trip if loop else 1, exact or not loop))
                if opcode == "async-start":
                    async_parent[callee] = (comp, *metadata_of(attrs))
        if len(branches) > 1:
            conditionals.append((comp, branches))

    stacks = stacks or {}
    records: list[tuple[str, float, dict]] = []  # (computation, wire per run, fields)
    for comp, kind, opcode, rest, args, attrs, instr in found:
        shape = _parse_shape(_COMMENT.sub("", rest))[0]
        n = _group_size(attrs, kind, default_n)
        operands = None
        start = opcode != kind and isinstance(shape, list) and len(shape) >= 2
        if start and (isinstance(shape[0], list) or kind != "all-reduce"):
            # async start: (operand(s), result(s), context...)
            operands, result = _arrays(shape[0]), _arrays(shape[1])
            value_shape = shape[1]
        else:
            result, value_shape = _arrays(shape), shape
        if kind == "all-gather":
            buf = result
        elif kind != "reduce-scatter":
            buf = operands or result  # same size as the result for these kinds
        else:
            names = _REF.findall(args)
            if operands is None and names and all(a in shapes for a in names):
                try:
                    operands = [x for a in names for x in _shape_arrays(shapes[a])]
                except ValueError:  # an operand's shape is not in the text
                    operands = None
            if operands is None:  # not in the text: the scatter dimension times N
                d = re.search(r"dimensions=\{(\d+)", attrs)
                k = int(d.group(1)) if d else 0
                operands = [(t, s[:k] + (s[k] * n,) + s[k + 1 :], b) for t, s, b in result]
            buf = operands
        name, frame = metadata_of(attrs)
        if kind == "all-gather":
            name, frame = named_after_use(name, frame, instr, graph.uses_named)
        shown = comp
        if comp in async_parent:
            shown, parent_name, parent_frame = async_parent[comp]
            name, frame = name or parent_name, frame or parent_frame
        origin = source_of(stacks.get(frame, ())) if frame else None
        parts = [(kind, buf, "")]
        if track and kind == "all-reduce":
            sliced = graph.sliced_elements(instr, opcode, value_shape, n)
            if sliced and len(buf) == (len(value_shape) if isinstance(value_shape, list) else 1):
                rs = [a for k, a in enumerate(buf) if k in sliced]
                ar = [a for k, a in enumerate(buf) if k not in sliced]
                parts = [("reduce-scatter", rs, LOWERED_RS)] + ([(kind, ar, "")] if ar else [])
        for part_kind, arrays, lowered in parts:
            nbytes = _nbytes(arrays)
            fields = dict(
                kind=part_kind,
                bytes=nbytes,
                group_size=n,
                op_name=name,
                computation=shown,
                dtype=_dtypes(arrays),
                shapes=tuple(a[1] for a in arrays),
                lowered_as=lowered,
                module_path=module_path_of(name),
                pass_=pass_of(name),
                source=origin.where if origin else "",
                function=origin.function if origin else "",
                block=block_of(name),
                group=first_group(attrs, kind),
            )
            records.append((comp, _wire(part_kind, nbytes, n), fields))

    _drop_cheaper_branches(records, conditionals, edges)
    # Executions per step of each computation: sum over call sites, in topological order.
    indeg: dict[str, int] = defaultdict(int)
    for outs in edges.values():
        for callee, _, _ in outs:
            indeg[callee] += 1
    mult: dict[str, int] = defaultdict(int)
    known: dict[str, bool] = defaultdict(lambda: True)
    stack = [c for c in comps if indeg[c] == 0]
    for c in stack:
        mult[c] = 1
    while stack:
        c = stack.pop()
        for callee, factor, exact in edges.get(c, ()):
            mult[callee] += mult[c] * factor
            known[callee] = known[callee] and known[c] and exact
            indeg[callee] -= 1
            if indeg[callee] == 0:
                stack.append(callee)

    return [
        Collective(
            **fields, wire_bytes=wire * mult[comp], count=mult[comp], count_exact=known[comp]
        )
        for comp, wire, fields in records
    ]


def _drop_cheaper_branches(
    records: list[tuple[str, float, dict]],
    conditionals: list[tuple[str, list[tuple[str, int]]]],
    edges: dict[str, list[tuple[str, int, bool]]],
) -> None:
    """A conditional runs one of its branches: give the call edges of all but the branch
    that moves the most wire bytes a factor of 0 (the FLOPs count a conditional's
    costliest branch alike), so that their collectives run 0 times from there; a
    computation also called from elsewhere keeps those calls' counts. A branch's bytes
    are its own collectives' and its callees' (loops by their trip counts, a nested
    conditional by its costliest branch). The rolled pipeline engine's zbv picks each
    tick's send direction by the tick's parity: one of two permutes runs."""
    if not conditionals:
        return
    local: dict[str, float] = defaultdict(float)
    for comp, wire, _ in records:
        local[comp] += wire
    branch_edges = {(comp, i) for comp, branches in conditionals for _, i in branches}
    by_comp = defaultdict(list)
    for comp, branches in conditionals:
        by_comp[comp].append(branches)
    cost: dict[str, float] = {}

    def total(comp: str) -> float:  # bytes of one run of comp (the call graph is a DAG)
        if comp not in cost:
            cost[comp] = 0.0  # a guard: a cycle counts once
            x = local[comp] + sum(
                factor * total(callee)
                for i, (callee, factor, _) in enumerate(edges.get(comp, ()))
                if (comp, i) not in branch_edges
            )
            x += sum(max(total(b) for b, _ in branches) for branches in by_comp[comp])
            cost[comp] = x
        return cost[comp]

    for comp, branches in conditionals:
        wires = [total(b) for b, _ in branches]
        keep = wires.index(max(wires))
        for k, (callee, i) in enumerate(branches):
            if k != keep:
                edges[comp][i] = (callee, 0, edges[comp][i][2])


def _by_kind(collectives: list[Collective], value) -> dict:
    totals: dict = {}
    for k in KINDS:
        for c in collectives:
            if c.kind == k:
                totals[k] = totals.get(k, 0) + value(c)
    return totals


def wire_bytes_by_kind(collectives: list[Collective]) -> dict[str, float]:
    """Total wire bytes per device per step, by kind (kinds that occur, in KINDS order).

    Example:
      >>> c = Collective(kind="all-reduce", bytes=100, group_size=2, wire_bytes=200.0,
      ...                count=2, dtype="f32", shape=(25,))
      >>> wire_bytes_by_kind([c, c])
      {'all-reduce': 400.0}
    """
    return _by_kind(collectives, lambda c: c.wire_bytes)


def bytes_by_kind(collectives: list[Collective]) -> dict[str, int]:
    """Total collective buffer bytes per step (``bytes * count``), by kind.

    Example:
      >>> c = Collective(kind="all-gather", bytes=64, group_size=8, wire_bytes=112.0,
      ...                count=2, dtype="f32", shape=(16,))
      >>> bytes_by_kind([c])
      {'all-gather': 128}
    """
    return _by_kind(collectives, lambda c: c.bytes * c.count)
