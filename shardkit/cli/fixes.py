"""Every CLI error's fix is a command line: the user's own, with the flags that fix it.

The library's messages end in a fix for Python users (``Fix: sk.Plan(...)``, ``map
'heads' to other mesh axes in the rules``). On the command line the fix is the command
the user typed with a few flags changed, and it is checked before it is printed: the
edited command must pass the command's own checks (:func:`verify`, which runs
``args.check``, :func:`shardkit.cli.preflight.check` for the compiling commands):

  shardkit report: error: params/layers/attn/out/kernel: shape (2, 8, 8, 64), dimension
  1 ('heads') has size 8, which tensor=6 does not divide (...). Fix: shardkit report
  --recipe tp --devices 4

Where the edits come from: an error the CLI raises itself (:class:`FlagError`) carries
them; for the library's errors they follow from the error's type (a layout that does
not fit the mesh: ``--batch``, ``--seq``, ``--mesh``, ``--devices``; a pipeline: its
flags and the pipeline recipes). One edit is tried at a time, then two (an edit that
meets a second mistake, with that mistake's edits). An error no edit fixes, or one the
checks cannot judge (it comes from compiling), keeps the library's message.

Example:
  >>> edit(["report", "--devices", "6", "--recipe=tp"], {"--devices": "4", "--recipe": None})
  ['report', '--devices', '4']
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import math
import re
import shlex
import warnings
from collections.abc import Iterable, Mapping, Sequence

from shardkit.errors import (
    DeviceError,
    IndivisibleError,
    MeshError,
    ShardingError,
    UnknownMeshAxisError,
)

__all__ = [
    "Edit",
    "FlagError",
    "PIPELINE_FLAGS",
    "closest",
    "edit",
    "explain",
    "mesh_text",
    "problem_of",
    "suggest",
    "verify",
]

#: Flags to set (a value) or drop (``None``) in a command line.
Edit = Mapping[str, "str | None"]

#: The pipeline flags (``shardkit.parallel.cli``), dropped together.
PIPELINE_FLAGS = (
    "--microbatches",
    "--schedule",
    "--virtual-stages",
    "--unit",
    "--rolled",
    "--unrolled",
)

#: At most this many command lines are checked for one error (each may lay out a model).
_MAX_TRIES = 32


class FlagError(ShardingError):
    """A mistake in the command line's flags, with the edits that may fix it.

    Args:
      message: what is wrong, in flags (no "Fix:" line: :func:`explain` adds one).
      fixes: edits of the command line, best first; the first that passes the command's
        checks becomes the Fix.
    """

    def __init__(self, message: str, fixes: Iterable[Edit] = ()):
        super().__init__(message)
        self.fixes = [dict(f) for f in fixes]


def explain(error: ShardingError, argv: Sequence[str], args: argparse.Namespace) -> str:
    """The one line ``shardkit CMD: error:`` prints: what is wrong, and a command that works."""
    try:
        fixed = suggest(error, argv, args)
    except Exception:  # the search for a fix must never hide the error itself
        fixed = None
    if fixed is None:
        return " ".join(str(error).split())
    return " ".join(f"{problem_of(error)} Fix: shardkit {shlex.join(fixed)}".split())


def problem_of(error: ShardingError) -> str:
    """The error's message without its "Fix:" (the library's messages end with one)."""
    return re.split(r"\s*\bFix:", str(error), maxsplit=1)[0]


def suggest(error: ShardingError, argv: Sequence[str], args: argparse.Namespace):
    """The first edit of ``argv`` that passes the command's checks, or ``None``.

    Single edits are tried first; then, for the first few edits that fail on another
    mistake, the edits of that mistake (so two flags may change, e.g. ``--schedule`` and
    ``--batch``). At most :data:`_MAX_TRIES` command lines are checked in all.
    """
    argv = list(argv)
    if _failure(argv) is None:  # the checks pass: this error comes later, they cannot judge
        return None
    return _search(error, argv, args, [_MAX_TRIES], depth=2)


def _search(error, argv, args, budget, depth):
    then = []  # (the next mistake, its command line) of edits that fixed this one
    for change in _candidates(error, args):
        fixed = edit(argv, change)
        if fixed == argv:
            continue
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        failure = _failure(fixed)
        if failure is None:
            return fixed
        if isinstance(failure, tuple) and problem_of(failure[0]) != problem_of(error):
            then.append((failure, fixed))
    for (next_error, next_args), fixed in then[:3] if depth > 1 else ():
        found = _search(next_error, fixed, next_args, budget, depth - 1)
        if found is not None:
            return found
    return None


def verify(argv: Sequence[str]) -> bool:
    """True if ``argv`` parses and passes its command's checks (nothing is compiled)."""
    return _failure(argv) is None


def _failure(argv: Sequence[str]):
    """``None`` if ``argv`` passes its checks, else ``(error, args)`` for a mistake they
    name, else ``"unusable"`` (no parse, no checks, or anything else going wrong)."""
    from shardkit.cli import build_parser

    quiet, args = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
            args = build_parser().parse_args(list(argv))
            check = getattr(args, "check", None)
            if check is None:
                return "unusable"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check(args)
    except ShardingError as e:
        return e, args
    except (SystemExit, Exception):  # never a new error, never a fix
        return "unusable"
    return None


def edit(argv: Sequence[str], change: Edit) -> list[str]:
    """``argv`` with each flag of ``change`` set to its value (in place, else appended)
    or dropped (``None``)."""
    out: list[str] = []
    done: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, _ = token.partition("=")
        if token.startswith("--") and flag in change:
            i += 1 if eq else 1 + _values(argv[0], flag, argv[i + 1 :])
            if change[flag] is not None and flag not in done:
                out += [flag, change[flag]] if change[flag] != "" else [flag]
            done.add(flag)
            continue
        out.append(token)
        i += 1
    for flag, value in change.items():
        if flag not in done and value is not None:
            out += [flag, value] if value != "" else [flag]
    return out


def _values(command: str, flag: str, rest: Sequence[str]) -> int:
    """How many of the tokens after ``flag`` are its value (0 or 1)."""
    from shardkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = sub.choices[command]._option_string_actions.get(flag)
    if action is None or action.nargs == 0:
        return 0
    if action.nargs == "?":
        return int(bool(rest) and not rest[0].startswith("-"))
    return 1


def closest(name: str, known: Sequence[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``known``, the most like ``name`` first (always at least one).

    Example:
      >>> closest("ddp", ["dp", "fsdp", "tp"])
      ['dp', 'fsdp', 'tp']
    """
    close = difflib.get_close_matches(name, known, n=n, cutoff=0.0)
    return close or list(known[:n])


def mesh_text(sizes: Mapping[str, int]) -> str:
    """``{"data": 2, "tensor": 4}`` → ``"data=2,tensor=4"`` (the ``--mesh`` spelling)."""
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())


# -- edits for the library's errors, by type --------------------------------------------


def _candidates(error: ShardingError, args: argparse.Namespace) -> list[Edit]:
    from shardkit.errors import NoCutError, NotPipelinableError, PipelineError

    if isinstance(error, FlagError):
        return error.fixes
    if isinstance(error, NoCutError):  # the fix is in the model: the library's message says it
        return []
    if isinstance(error, NotPipelinableError):
        return _pipeline_recipes(args)
    if isinstance(error, PipelineError):
        return [*_pipeline_edits(args), *_layout_edits(args)]
    if isinstance(error, (IndivisibleError, MeshError, UnknownMeshAxisError, DeviceError)):
        return _layout_edits(args)
    return []


def _device_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(the devices the command asked for, the devices this process can have)."""
    from shardkit.cli.devices_arg import select_devices

    with contextlib.suppress(ShardingError):  # starts the backend as the command would
        select_devices(getattr(args, "devices", None))
    import jax

    available = len(jax.devices())
    return getattr(args, "devices", None) or available, available


def _layout_edits(args: argparse.Namespace) -> list[Edit]:
    """A batch, sequence, mesh or device count that the layout may fit."""
    n, available = _device_counts(args)
    out: list[Edit] = []
    if hasattr(args, "batch"):
        batch = args.batch or n
        micro = getattr(args, "microbatches", None) or 1
        for k in (n, n * micro):
            out.append({"--batch": str(max(1, -(-batch // k)) * k)})
    if getattr(args, "seq", None):
        out.append({"--seq": str(-(-args.seq // n) * n)})
    out += _mesh_edits(args, n)
    out += [{"--devices": str(d)} for d in _nearby_counts(n, available)]
    return out


def _mesh_edits(args: argparse.Namespace, n: int) -> list[Edit]:
    from shardkit import recipes

    name = getattr(args, "recipe", None)
    if name not in recipes.names() or not hasattr(args, "mesh"):
        return []
    given = dict(args.mesh or {})
    axes = {**dict(recipes.get(name).mesh_axes), **given}
    out: list[Edit] = []
    flexible = [a for a, s in axes.items() if s == -1]
    for keep in flexible[:1]:  # more than one -1: the others get a size
        out.append({"--mesh": mesh_text({**given, **{a: 1 for a in flexible if a != keep}})})
    for axis in sorted(axes, key=lambda a: a not in given):  # the user's axes first
        for size in sorted(_divisors(n), reverse=True):
            if size != axes[axis]:
                out.append({"--mesh": mesh_text({**given, axis: size})})
    return out


def _nearby_counts(n: int, available: int) -> list[int]:
    """Device counts to try instead of ``n``: powers of two first, the nearest first."""
    counts = {2**k for k in range(int(math.log2(available)) + 1)} | set(_divisors(n))
    counts = {c for c in counts if c != n and c <= available}
    return sorted(counts, key=lambda c: (c & (c - 1) != 0, abs(c - n), c))[:8]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipeline_recipes(args: argparse.Namespace) -> list[Edit]:
    """A recipe with a stage axis for the pipeline flags, or the flags dropped, or a
    recipe without one (a model of one's own does not pipeline from the command line)."""
    from shardkit import recipes

    staged = [r for r in recipes.names() if "stage" in dict(recipes.get(r).mesh_axes)]
    flat = sorted((r for r in recipes.names() if r not in staged), key=lambda r: r != "fsdp")
    return [
        *({"--recipe": r} for r in staged),
        dict.fromkeys(PIPELINE_FLAGS),
        *({"--recipe": r} for r in flat[:3]),
    ]


def _pipeline_edits(args: argparse.Namespace) -> list[Edit]:
    """Another schedule, batch, micro-batch count or virtual-stage count."""
    from shardkit.parallel.schedules import SCHEDULES

    out: list[Edit] = []
    schedule = getattr(args, "schedule", None)
    if schedule is not None and schedule not in SCHEDULES:
        out += [{"--schedule": s} for s in closest(schedule, SCHEDULES)]
    n, _ = _device_counts(args)
    micro = getattr(args, "microbatches", None)
    if micro:
        batch = getattr(args, "batch", None) or n
        out += [{"--batch": str(-(-batch // (n * micro)) * n * micro)}]
        out += [
            {"--microbatches": str(m)} for m in sorted(_divisors(batch), reverse=True) if m != micro
        ]
    if getattr(args, "virtual_stages", None):
        out += [{"--virtual-stages": None}, {"--schedule": "1f1b", "--virtual-stages": None}]
    return out
