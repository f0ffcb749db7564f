"""A user's own model, for the command line and ``models.report``.

``shardkit report --model package.module:factory`` imports ``factory`` and calls
it with no arguments. It returns the model as any of:

- a :class:`UserModel`;
- a mapping with ``init`` and ``loss`` (and optionally ``annotations``, ``vocab``,
  ``dims``), so the model's file need not import shardkit;
- a pair ``(init, loss)``;
- an object with ``init(rng)`` and ``loss(params, batch)`` methods (and optionally
  the same attributes).

``init(rng)`` returns the parameters (annotated or not); ``loss(params, batch)``
takes the plain arrays and a ``{"inputs", "targets"}`` batch of ``int32[batch,
seq]`` tokens. ``annotations`` (a ``sk.PathAxes`` or its ``(regex, logical_axes)``
pairs) gives logical axes to a model nobody annotated.

Example:
  >>> from shardkit import models
  >>> m = models.load("examples.my_model:build")
  >>> m.name, m.vocab, m.annotations is not None
  ('examples.my_model:build', 256, True)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from shardkit.annotate.path_axes import PathAxes
from shardkit.errors import ShardingError

__all__ = ["UserModel", "load"]

_OPTIONAL = ("annotations", "vocab", "dims")


@dataclasses.dataclass(frozen=True)
class UserModel:
    """A model shardkit did not write: how to init it, its loss, and what it cannot guess.

    Attributes:
      init: ``rng -> params``.
      loss: ``(params, batch) -> scalar``.
      name: a label for reports (the ``module:factory`` it was loaded from).
      annotations: a ``sk.PathAxes`` for parameters Flax did not annotate.
      vocab: the token range of the model's inputs (``shardkit run`` draws synthetic
        tokens below it).
      dims: the model's sizes for the analytic activation terms, by
        :class:`~shardkit.workload.Workload` field (``layers``, ``d_model``,
        ``n_heads``, ``n_kv_heads``, ``vocab``).
    """

    init: Callable[[Any], Any]
    loss: Callable[[Any, Any], Any]
    name: str = "custom"
    annotations: PathAxes | None = None
    vocab: int | None = None
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not callable(self.init) or not callable(self.loss):
            raise ShardingError(
                f"{self.name}: init and loss must be callables, got "
                f"{type(self.init).__name__} and {type(self.loss).__name__}."
            )
        if self.annotations is not None and not isinstance(self.annotations, PathAxes):
            object.__setattr__(self, "annotations", PathAxes(self.annotations))
        unknown = sorted(set(self.dims) - {"layers", "d_model", "n_heads", "n_kv_heads", "vocab"})
        if unknown:
            raise ShardingError(
                f"{self.name}: dims {unknown} are not workload sizes.\nFix: use layers, "
                "d_model, n_heads, n_kv_heads, vocab."
            )


def load(spec: str) -> UserModel:
    """Import ``package.module:factory`` and build the model it returns.

    The current directory is importable, as with ``python -m``.

    Raises:
      ShardingError: a malformed spec, a module or factory that cannot be found, or a
        factory that returns something else than a model (the message says what).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ShardingError(
            f"--model {spec!r}: a model of your own is named package.module:factory.\n"
            "Fix: e.g. --model examples.my_model:build (a function returning the model)."
        )
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if (
            e.name is not None
            and module_name != e.name
            and not module_name.startswith(e.name + ".")
        ):  # the module was found, but something it imports was not
            raise ShardingError(
                f"--model {spec!r}: {module_name} imports {e.name!r}, which is not installed "
                f"({e}).\nFix: install it (pip install ...) in this environment."
            ) from None
        raise ShardingError(
            f"--model {spec!r}: cannot import {module_name!r} ({e}).\nFix: run from the "
            "directory that contains it, or install its package."
        ) from None
    finally:
        if added:
            sys.path.remove(cwd)
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = ", ".join(n for n in dir(module) if callable(getattr(module, n)) and n[0] != "_")
        what = "has no attribute" if factory is None else "has a non-callable"
        raise ShardingError(
            f"--model {spec!r}: {module_name} {what} {attr!r}; the factory is a function "
            f"returning the model.\nFix: one of: {found}."
        )
    return as_user_model(factory(), name=spec)


def as_user_model(obj: Any, *, name: str) -> UserModel:
    """``obj`` (any form a factory may return) as a :class:`UserModel`."""
    if isinstance(obj, UserModel):
        return obj if obj.name != "custom" else dataclasses.replace(obj, name=name)
    if isinstance(obj, Mapping):
        extra = sorted(set(obj) - {"init", "loss", *_OPTIONAL})
        if extra or "init" not in obj or "loss" not in obj:
            raise ShardingError(
                f"{name}: the factory's mapping has keys {sorted(obj)}; it needs 'init' and "
                f"'loss', and may have {', '.join(_OPTIONAL)}."
            )
        return UserModel(name=name, **obj)
    if isinstance(obj, tuple) and len(obj) == 2:
        return UserModel(obj[0], obj[1], name=name)
    if hasattr(obj, "init") and hasattr(obj, "loss"):
        options = {k: getattr(obj, k) for k in _OPTIONAL if getattr(obj, k, None) is not None}
        return UserModel(obj.init, obj.loss, name=name, **options)
    raise ShardingError(
        f"{name}: the factory returned {type(obj).__name__}; it should return the model: a "
        "mapping {'init': ..., 'loss': ...}, a pair (init, loss), or an object with init() "
        "and loss() methods."
    )
