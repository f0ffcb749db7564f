"""Logical axis → mesh axis rules, and the one resolver that turns them into specs.

A rule list has the Flax / MaxText / T5X format: ordered ``(logical, mesh_axes)``
pairs where ``mesh_axes`` is a mesh axis name, a tuple of names, or ``None``
(replicate). Existing lists import unchanged.

Resolution, used for every model (linen and NNX alike):

1. Rules are tried in order; a rule applies to the first not-yet-assigned
   dimension with its logical name (first match wins).
2. A rule whose mesh axes are already used by another dimension of the same
   array is skipped, so the next rule for that name applies (MaxText's two
   ``embed`` rules rely on this).
3. A logical name with no applicable rule is replicated (or, with
   ``strict=True`` and no rule at all, an error).
4. With a mesh, mesh axes of size 1 are dropped; with a shape too, every
   dimension must be divisible by the product of its mesh axis sizes.
5. With a shape, fewer names than dimensions name the leading dimensions (as
   ``nn.logical_to_mesh_axes`` does); the rest are replicated. More is an error.

Example:
  >>> import shardkit as sk
  >>> rules = sk.Rules([("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor"),
  ...                   ("embed", "tensor")])
  >>> rules.spec(("embed", "mlp"))
  P('fsdp', 'tensor')
  >>> rules.spec(("batch", "embed"), mesh={"data": 4, "fsdp": 1, "tensor": 2})
  P('data', None)
  >>> rules.spec(("embed", "mlp"), shape=(64, 8, 8))  # a prefix: the rest replicated
  P('fsdp', 'tensor', None)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from shardkit import errors
from shardkit.mesh import divisors as _divisors
from shardkit.paths import path_str

__all__ = ["Rules", "MeshAxes", "axis_sizes_of", "entry_axes"]

MeshAxes = str | tuple[str, ...] | None
_UNASSIGNED = object()


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (or one rule's target).

    Example:
      >>> entry_axes("fsdp"), entry_axes(("data", "fsdp")), entry_axes(None)
      (('fsdp',), ('data', 'fsdp'), ())
    """
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def axis_sizes_of(mesh: Any) -> dict[str, int]:
    """``{axis_name: size}`` of a ``Mesh``, ``AbstractMesh`` or plain mapping.

    Raises:
      ArgumentTypeError: ``mesh`` is none of those. MeshError: a size is not a
        positive integer, or a name not a non-empty string.
    """
    if mesh is None:
        return {}
    if isinstance(mesh, Mapping):
        sizes = dict(mesh)
    elif isinstance(getattr(mesh, "shape", None), Mapping):
        sizes = dict(mesh.shape)
    else:
        raise errors.ArgumentTypeError(
            f"mesh is a Mesh, an AbstractMesh or a mapping {{axis_name: size}}, got "
            f"{type(mesh).__name__} {mesh!r}.\nFix: mesh=sk.make_mesh({{'data': -1}}) or "
            "mesh={'data': 8}."
        )
    for name, size in sizes.items():
        if not isinstance(name, str) or not name:
            raise errors.MeshError(f"mesh axis names are non-empty strings, got {name!r}.")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise errors.MeshError(
                f"mesh axis {name!r} has size {size!r}; mesh sizes are positive integers "
                f"(mesh: {sizes}).\nFix: give {name!r} a size of 1 or more."
            )
    return {k: int(v) for k, v in sizes.items()}


def _check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise errors.ArgumentTypeError(
            f"{where}: shape is a tuple of dimension sizes, got {type(shape).__name__} {shape!r}."
        )
    shape = tuple(shape)
    bad = [d for d in shape if isinstance(d, bool) or not isinstance(d, (int, np.integer))]
    if bad:
        raise errors.ArgumentTypeError(
            f"{where}: shape {shape!r} holds {bad[0]!r}; dimension sizes are integers."
        )
    if any(d < 0 for d in shape):
        raise errors.RankMismatchError(
            f"{where}: shape {shape!r} has a negative dimension; sizes are >= 0."
        )
    return tuple(int(d) for d in shape)


def _normalize_rule(rule: Any, index: int) -> tuple[str, tuple[str, ...] | None]:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2:
        raise errors.RuleError(
            f"Rule #{index} is {rule!r}; each rule is a pair (logical_name, mesh_axes), "
            "e.g. ('embed', 'fsdp'), ('batch', ('data', 'fsdp')) or ('heads', None)."
        )
    logical, mesh_axes = rule
    if not isinstance(logical, str) or not logical:
        raise errors.RuleError(
            f"Rule #{index} {rule!r}: the logical name must be a non-empty string."
        )
    if mesh_axes is None:
        return logical, None
    if isinstance(mesh_axes, str):
        mesh_axes = (mesh_axes,)
    if not isinstance(mesh_axes, (tuple, list)) or not all(
        isinstance(a, str) and a for a in mesh_axes
    ):
        raise errors.RuleError(
            f"Rule #{index} {rule!r}: mesh axes must be a mesh axis name, a tuple of names, "
            f"or None, got {type(rule[1]).__name__} {rule[1]!r}.\n"
            f"Fix: ({logical!r}, 'data') or ({logical!r}, ('data', 'fsdp'))."
        )
    mesh_axes = tuple(mesh_axes)
    dupes = sorted({a for a in mesh_axes if mesh_axes.count(a) > 1})
    if dupes:
        raise errors.DuplicateMeshAxisError(
            f"Rule #{index} {rule!r} names mesh axis {dupes[0]!r} twice; a mesh axis can "
            f"shard one dimension only once.\nFix: ({logical!r}, {tuple(dict.fromkeys(mesh_axes))!r})."
        )
    return logical, mesh_axes


def _or_list(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


class Rules:
    """An ordered list of ``(logical, mesh_axes)`` rules; plain, comparable data.

    Args:
      rules: pairs in the Flax/MaxText format; another ``Rules`` is accepted too.
      strict: raise ``UnknownLogicalAxisError`` for a logical name with no rule
        instead of replicating that dimension.

    Example:
      >>> Rules([("batch", ("data", "fsdp")), ("heads", "tensor")]).spec(("batch", "heads"))
      P(('data', 'fsdp'), 'tensor')
    """

    __slots__ = ("_rules", "strict")

    def __init__(self, rules: Iterable[Any] = (), *, strict: bool = False):
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise errors.RuleError(
                f"Rules takes a list of (logical, mesh_axes) pairs, got {rules!r}."
            )
        items = list(rules.pairs() if isinstance(rules, Rules) else rules)
        self._rules = tuple(_normalize_rule(r, i) for i, r in enumerate(items))
        self.strict = bool(strict)

    # -- data protocol -------------------------------------------------------------
    def pairs(self) -> tuple[tuple[str, MeshAxes], ...]:
        """The rules in Flax's format (single mesh axes as plain strings)."""
        return tuple(
            (name, axes[0] if axes is not None and len(axes) == 1 else axes)
            for name, axes in self._rules
        )

    def __iter__(self) -> Iterator[tuple[str, MeshAxes]]:
        return iter(self.pairs())

    def __len__(self) -> int:
        return len(self._rules)

    def __add__(self, other: Iterable[Any]) -> Rules:
        return Rules([*self.pairs(), *Rules(other).pairs()], strict=self.strict)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Rules) and self._rules == other._rules and self.strict == other.strict
        )

    def __hash__(self) -> int:
        return hash((self._rules, self.strict))

    def __repr__(self) -> str:
        strict = ", strict=True" if self.strict else ""
        return f"Rules({list(self.pairs())!r}{strict})"

    @property
    def logical_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self._rules)

    @property
    def mesh_axis_names(self) -> frozenset[str]:
        return frozenset(a for _, axes in self._rules for a in (axes or ()))

    def validate(self, mesh: Any) -> None:
        """Raise ``UnknownMeshAxisError`` if any rule names an axis ``mesh`` lacks."""
        sizes = axis_sizes_of(mesh)
        for name, axes in self._rules:
            for a in axes or ():
                if a not in sizes:
                    raise errors.UnknownMeshAxisError(
                        f"Rule ({name!r}, {a!r}) names mesh axis {a!r}, but the mesh has axes "
                        f"{sizes}.\nFix: rename it to one of {list(sizes)}, or add {a!r} to "
                        f"the mesh (size 1 is allowed)."
                    )

    # -- resolution ----------------------------------------------------------------
    def spec(
        self,
        logical_axes: Sequence[str | None],
        shape: Sequence[int] | None = None,
        mesh: Any = None,
        path: Any = None,
    ) -> PartitionSpec:
        """The ``PartitionSpec`` for an array with these logical axes.

        Args:
          logical_axes: one logical name (or ``None``) per dimension; with ``shape``,
            fewer names than dimensions name the leading ones and the rest are
            replicated (Flax's rule for the kernels its layers reshape).
          shape: the array's shape; enables the rank and divisibility checks.
          mesh: a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``; enables the
            unknown-axis check, dropping of size-1 axes and divisibility.
          path: where the array lives (for error messages).

        Raises:
          ShardingError: a rank mismatch, an unknown mesh axis, an indivisible
            dimension, or (strict) a logical name with no rule.
        """
        where = path_str(path)
        if not isinstance(logical_axes, (tuple, list, str)):
            raise errors.ArgumentTypeError(
                f"{where}: logical axes are a tuple of names (or None), one per dimension, "
                f"got {type(logical_axes).__name__} {logical_axes!r}.\nFix: e.g. "
                "('batch', 'embed')."
            )
        if isinstance(logical_axes, str) or not all(
            a is None or (isinstance(a, str) and a) for a in logical_axes
        ):
            raise errors.RuleError(
                f"{where}: logical axes must be a tuple of names (or None), one per dimension, "
                f"got {logical_axes!r}.\nFix: write ({logical_axes!r},) for one dimension."
                if isinstance(logical_axes, str)
                else f"{where}: logical axes {tuple(logical_axes)!r} may only hold names or None."
            )
        logical_axes = tuple(logical_axes)
        if shape is not None:
            shape = _check_shape(shape, where)
        sizes = axis_sizes_of(mesh)
        if shape is not None and len(shape) < len(logical_axes):
            raise errors.RankMismatchError(
                f"{where}: shape {tuple(shape)} has {len(shape)} dimension(s) but logical axes "
                f"{logical_axes} name {len(logical_axes)}.\nFix: give one logical name (or "
                "None) per dimension in the annotation of this parameter, at most."
            )
        if shape is not None:  # fewer names than dimensions: a prefix, as Flax reads it
            logical_axes += (None,) * (len(shape) - len(logical_axes))
        if self.strict:
            missing = [n for n in logical_axes if n is not None and n not in self.logical_names]
            if missing:
                raise errors.UnknownLogicalAxisError(
                    f"{where}: logical axis {missing[0]!r} (axes {logical_axes}"
                    f"{'' if shape is None else f', shape {tuple(shape)}'}) has no rule and the "
                    f"rules are strict.\nFix: add ({missing[0]!r}, None) to replicate it, or "
                    f"({missing[0]!r}, '<mesh axis>') to shard it."
                )
        resolved: list[Any] = [_UNASSIGNED] * len(logical_axes)
        used: set[str] = set()
        for name, axes in self._rules:
            pos = next(
                (i for i, n in enumerate(logical_axes) if n == name and resolved[i] is _UNASSIGNED),
                None,
            )
            if pos is None:
                continue
            if axes is None:
                resolved[pos] = None
            elif not used.intersection(axes):
                resolved[pos] = axes
                used.update(axes)
        entries = [None if r is _UNASSIGNED else r for r in resolved]
        if mesh is not None:
            entries = self._fit_to_mesh(entries, logical_axes, shape, sizes, where)
        return PartitionSpec(
            *(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)
        )

    def _fit_to_mesh(self, entries, logical_axes, shape, sizes, where):
        fitted = []
        for dim, axes in enumerate(entries):
            if axes is None:
                fitted.append(None)
                continue
            for a in axes:
                if a not in sizes:
                    raise errors.UnknownMeshAxisError(
                        f"{where}: logical axis {logical_axes[dim]!r} maps to mesh axis {a!r}, "
                        f"but the mesh has axes {sizes}.\nFix: map {logical_axes[dim]!r} to one "
                        f"of {list(sizes)} in the rules, or add {a!r} to the mesh."
                    )
            axes = tuple(a for a in axes if sizes[a] > 1)
            if shape is not None and axes:
                self._check_divisible(dim, axes, logical_axes, tuple(shape), sizes, where)
            fitted.append(axes or None)
        return fitted

    @staticmethod
    def _check_divisible(dim, axes, logical_axes, shape, sizes, where):
        size = shape[dim]
        product = math.prod(sizes[a] for a in axes)
        if size % product == 0:
            return
        name = logical_axes[dim]
        over = " × ".join(f"{a}={sizes[a]}" for a in axes)
        label = axes[0] if len(axes) == 1 else "×".join(axes)
        devices = math.prod(sizes.values())  # a size must also factor the mesh's devices
        options = [d for d in _divisors(size) if 1 < d < product and devices % d == 0]
        use = f"use {label} {_or_list(options)}, or " if options else ""
        bigger = -(-size // product) * product
        raise errors.IndivisibleError(
            f"{where}: shape {shape}, dimension {dim} ({name!r}) has size {size}, which "
            f"{over} does not divide (mesh axis sizes: {sizes}).\n"
            f"Fix: {use}make {name!r} a multiple of {product} (e.g. {bigger}), or map "
            f"{name!r} to other mesh axes (or None) in the rules."
        )
