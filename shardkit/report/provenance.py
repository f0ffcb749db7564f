"""Where a collective comes from: the model path, the pass, the block and the model's line.

XLA keeps, for every instruction, the ``op_name`` JAX traced it under (transforms,
Flax module scopes and named scopes: ``jit(step)/transpose(jvp(GPT))/layers/attn/
shardkit.attention/shardkit.attention.ring/ppermute``) and a ``stack_frame_id`` into the
module's index of Python frames (read from the serialized ``HloModuleProto``, where each
frame links to its caller). From those this module gives each collective:

- ``module_path``: the Flax module scopes in the op name (``layers/mlp/down``); for code
  without name scopes (NNX), the function of the innermost model frame
  (``LlamaMLP.__call__``);
- ``pass``: ``forward``, ``backward`` (under ``transpose``), ``remat`` (a forward
  recomputed in the backward pass) or ``update`` (outside the differentiated function:
  the optimizer step);
- ``block``: the innermost of shardkit's building blocks that made the op, from the
  ``shardkit.<block>`` named scopes (:mod:`shardkit.scopes`): ``attention.ring``,
  ``loss.chunked``, ``tsp.ring``, ``pipeline.send``; ``""`` for the model's own ops
  (a block calling the model back opens ``shardkit.model``);
- ``source``: ``file.py:line`` of the innermost frame outside JAX, Flax, optax,
  shardkit's plumbing and its building blocks: the line of the model that asked for
  the op, whatever its files are called.

Example:
  >>> module_path_of("jit(traced)/transpose(jvp(GPT))/while/body/layers/mlp/down/dot_general")
  'layers/mlp/down'
  >>> pass_of("jit(traced)/transpose(jvp())/while/body/checkpoint/rematted_computation/mul")
  'remat'
  >>> pass_of("jit(traced)/jvp(GPT)/wte/gather"), pass_of("jit(traced)/mul")
  ('forward', 'update')
  >>> op = "jit(s)/jvp(GPT)/layers/attn/shardkit.attention/shardkit.attention.ring/ppermute"
  >>> block_of(op), module_path_of(op)
  ('attention.ring', 'layers/attn')
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable

from shardkit.scopes import MODEL, PREFIX

__all__ = [
    "Frame",
    "block_of",
    "blocks_in",
    "frames_by_id",
    "metadata_of",
    "module_path_of",
    "named_after_use",
    "pass_of",
    "source_of",
    "without_blocks",
]

#: The two fields of an HLO instruction's ``metadata={...}`` this module reads (the one
#: home of these patterns: :mod:`~shardkit.report.hlo` and :mod:`~shardkit.report.buffers`
#: read instruction text through :func:`metadata_of`).
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")

_EINSUM = re.compile(r"^[\w.]*,[\w.,]*->[\w.]*$|^[\w.]+->[\w.]+$")
_TRANSFORMS = (
    "jit",
    "jvp",
    "transpose",
    "pjit",
    "vmap",
    "remat",
    "checkpoint",
    "custom_jvp",
    "custom_vjp",
    "shard_map",
    "xla_call",
)
_NOT_MODULES = {
    "while",
    "body",
    "cond",
    "closed_call",
    "eval_jaxpr",  # what jax 0.12 names a scan body's call (closed_call before)
    "checkpoint",
    "rematted_computation",
    "remat",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "shmap_body",
    "branch_0_fun",
    "branch_1_fun",
    "scan",
    "jit",
    "traced",
}
#: Frames in these places are machinery, not the line that asked for a collective.
_LIBRARIES = (
    f"{os.sep}jax{os.sep}",
    f"{os.sep}jaxlib{os.sep}",
    f"{os.sep}flax{os.sep}",
    f"{os.sep}optax{os.sep}",
    f"{os.sep}contextlib.py",
    "<frozen ",
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shardkit/
#: shardkit's plumbing and building blocks, by path inside the package (never by a base
#: name: a model's own ``attention.py`` is the model's): frames here are not the
#: model's line. The blocks name themselves in the op's scopes instead (``block``).
_SHARDKIT = tuple(
    os.path.join(_ROOT, p)
    for p in (
        "plan.py",
        "state.py",
        "context.py",
        "scopes.py",
        f"annotate{os.sep}",
        f"nn{os.sep}",  # the building blocks: attention, loss, replicas, TSP's rings
        os.path.join("parallel", "pipeline.py"),
    )
)
#: A shardkit named scope in an op name (also inside a transform's parentheses).
_SCOPE = re.compile(r"(?:^|[/(])" + re.escape(PREFIX) + r"([\w.]+)")
_SCOPE_NAME = re.compile(re.escape(PREFIX) + r"[\w.]+")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame XLA recorded: file, function and line."""

    file: str
    function: str
    line: int

    @property
    def where(self) -> str:
        """``file.py:line`` (the file's base name)."""
        return f"{os.path.basename(self.file)}:{self.line}"


def metadata_of(text: str) -> tuple[str, int]:
    """(``op_name``, ``stack_frame_id``) of an HLO instruction's text; ``("", 0)`` if absent.

    Example:
      >>> metadata_of('%x = f32[2] add(%a, %b), metadata={op_name="jit(f)/add" stack_frame_id=3}')
      ('jit(f)/add', 3)
    """
    op, frame = _OP_NAME.search(text), _FRAME_ID.search(text)
    return (op.group(1) if op else ""), (int(frame.group(1)) if frame else 0)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(b: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one protobuf message (wire format)."""
    out, i = [], 0
    while i < len(b):
        key, i = _varint(b, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = b[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {i}")
        out.append((number, value))
    return out


#: Field numbers in XLA's ``HloModuleProto`` (xla/service/hlo.proto): the module's
#: ``stack_frame_index``, and within it names, file locations and frames (1-based ids).
_STACK_FRAME_INDEX, _FILE_NAMES, _FUNCTION_NAMES, _LOCATIONS, _FRAMES = 17, 1, 2, 3, 4


def frames_by_id(module_proto: bytes) -> dict[int, tuple[Frame, ...]]:
    """``stack_frame_id`` → its Python stack, innermost frame first.

    Reads the stack frame index of a serialized ``HloModuleProto``
    (``compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()``).
    The text form prints these tables too, but without the parent links, so the
    structured form is the one to read. Empty when the module records no frames.
    """
    index = b""
    for number, value in _fields(module_proto):
        if number == _STACK_FRAME_INDEX and isinstance(value, bytes):
            index = value
    entries = _fields(index)
    files = [v.decode() for n, v in entries if n == _FILE_NAMES]
    functions = [v.decode() for n, v in entries if n == _FUNCTION_NAMES]
    locations = []
    for n, v in entries:
        if n == _LOCATIONS:
            f = dict(_fields(v))
            function = _at(functions, f.get(2)).replace(".<locals>", "")
            locations.append(Frame(_at(files, f.get(1)), function, f.get(3, 0)))
    frames = [dict(_fields(v)) for n, v in entries if n == _FRAMES]
    stacks: dict[int, tuple[Frame, ...]] = {}
    for k in range(1, len(frames) + 1):
        stack, cur, seen = [], k, set()
        while 0 < cur <= len(frames) and cur not in seen:
            seen.add(cur)
            loc = frames[cur - 1].get(1, 0)
            if 0 < loc <= len(locations):
                stack.append(locations[loc - 1])
            cur = frames[cur - 1].get(2, 0)
        stacks[k] = tuple(stack)
    return stacks


def _at(names: list[str], one_based: int | None) -> str:
    return names[one_based - 1] if one_based and one_based <= len(names) else "?"


def _segments(op_name: str) -> list[str]:
    """``op_name`` split at ``/`` outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(op_name):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "/" and depth == 0:
            out.append(op_name[start:i])
            start = i + 1
    out.append(op_name[start:])
    return out


def module_path_of(op_name: str) -> str:
    """The Flax module scopes in an op name (``layers/mlp/down``), ``""`` if none."""
    parts = []
    for seg in _segments(op_name)[:-1]:  # the last segment is the primitive
        if seg.startswith(("(", PREFIX)) or _EINSUM.match(seg) or seg in _NOT_MODULES:
            continue
        if any(seg.startswith(t + "(") for t in _TRANSFORMS):
            continue
        parts.append(seg)
    return "/".join(parts)


#: Primitives that move or pin a value without computing with it: an all-gather named
#: after one of them is named after the op that uses what it gathered instead.
_MOVES = frozenset(
    {
        "sharding_constraint",
        "squeeze",
        "dynamic_slice",
        "slice",
        "reshape",
        "copy",
        "convert_element_type",
        "broadcast_in_dim",
    }
)
_PASS_THROUGH = ("bitcast", "copy", "get-tuple-element", "all-gather-done")


def named_after_use(
    op_name: str, frame: int, start: str, uses: Callable[[str], Iterable[tuple[str, ...]]]
) -> tuple[str, int]:
    """``(op_name, frame)`` of a gathered value, named after the layer that uses it.

    jax 0.12's XLA names a weight's all-gather after the op that sliced or pinned the
    weight (``.../jit(dynamic_index_in_dim)/squeeze``), 0.10's after the layer's op that
    uses it (``.../layers/mlp/up/dot_general``); the report needs the layer. When
    ``op_name`` ends in a :data:`_MOVES` primitive, this follows ``uses(name)`` (``(user,
    opcode, user's op_name, user's frame)`` tuples) from ``start``, past bitcasts, copies,
    tuple elements and ops themselves named after a move, to the first op whose model
    path lies deeper inside ``op_name``'s, and gives its name; else ``(op_name, frame)``.

    Example:
      >>> uses = {"ag": [("dot", "fusion", "jit(f)/jvp(M)/layers/up/dot_general", 9)]}
      >>> named_after_use("jit(f)/jvp(M)/layers/sharding_constraint", 3, "ag", uses.get)
      ('jit(f)/jvp(M)/layers/up/dot_general', 9)
    """
    if op_name.rpartition("/")[2] not in _MOVES:
        return op_name, frame
    own = module_path_of(op_name)
    todo, seen = [start], {start}
    while todo:
        for user, opcode, used_as, used_frame in uses(todo.pop(0)) or ():
            if opcode in _PASS_THROUGH or used_as.rpartition("/")[2] in _MOVES:
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
                continue
            path = module_path_of(used_as)
            if path and path != own and path.startswith(own):
                return used_as, int(used_frame)
    return op_name, frame


def pass_of(op_name: str) -> str:
    """``forward``, ``backward``, ``remat`` or ``update`` (see the module docstring)."""
    if "rematted_computation" in op_name:
        return "remat"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"


def blocks_in(op_name: str) -> tuple[str, ...]:
    """Every shardkit scope in an op name, outermost first (``model`` included).

    Example:
      >>> blocks_in("jit(s)/jvp(shardkit.loss.chunked)/shardkit.model/wte/dot_general")
      ('loss.chunked', 'model')
    """
    return tuple(_SCOPE.findall(_primary(op_name)))


def _primary(op_name: str) -> str:
    """The first of the ops XLA combined into one (``jit(f)/(a/x:b/y)`` → ``jit(f)/a/x``):
    the one whose stack frame the combined op keeps, so its block and its source agree.

    Example:
      >>> _primary("jit(s)/(reduce_sum:jvp(shardkit.loss.chunked)/while/reduce_sum)")
      'jit(s)/reduce_sum'
    """
    out = []
    for seg in _segments(op_name):
        if seg.startswith("(") and seg.endswith(")"):
            inner, depth = seg[1:-1], 0
            for i, ch in enumerate(inner):
                depth += ch == "("
                depth -= ch == ")"
                if ch == ":" and depth == 0:
                    inner = inner[:i]
                    break
            seg = inner
        out.append(seg)
    return "/".join(out)


def without_blocks(op_name: str) -> str:
    """``op_name`` without shardkit's scopes: the model's transforms and module scopes.

    Example:
      >>> without_blocks("jit(s)/jvp(shardkit.attention)/shardkit.attention.ring/ppermute")
      'jit(s)/jvp()//ppermute'
    """
    return _SCOPE_NAME.sub("", op_name)


def block_of(op_name: str) -> str:
    """The innermost shardkit block that made the op; ``""`` where the model's own code
    made it (no block, or a block called the model back: ``shardkit.model``)."""
    blocks = blocks_in(op_name)
    return "" if not blocks or blocks[-1] == MODEL else blocks[-1]


def source_of(stack: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame of ``stack`` outside the libraries and shardkit's plumbing and
    building blocks: the model's line."""
    for frame in stack:
        if not frame.file.endswith(".py") and not frame.file.startswith("<"):
            continue
        if any(p in frame.file for p in _LIBRARIES) or os.path.abspath(frame.file).startswith(
            _SHARDKIT
        ):
            continue
        return frame
    return None
