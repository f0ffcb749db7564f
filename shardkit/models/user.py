"""A user's own model, for the command line and ``sk.report.build_report``.

``shardkit report --model package.module:factory`` imports ``factory`` and calls
it with no arguments. It returns the model as any of:

- a :class:`UserModel`;
- a mapping with ``init`` and ``loss`` (and optionally ``annotations``, ``vocab``,
  ``dims``, ``stages``), so the model's file need not import shardkit;
- a pair ``(init, loss)``;
- an object with ``init(rng)`` and ``loss(params, batch)`` methods (and optionally
  the same attributes).

``init(rng)`` returns the parameters (annotated or not); ``loss(params, batch)``
takes the plain arrays and a ``{"inputs", "targets"}`` batch of ``int32[batch,
seq]`` tokens. ``annotations`` (a ``sk.PathAxes`` or its ``(regex, logical_axes)``
pairs) gives logical axes to a model nobody annotated. ``dims`` (a
``shardkit.dims.ModelDims`` or a mapping of its fields) gives the report its analytic
column; ``stages`` (a ``shardkit.protocol.Stages`` or a mapping with ``pre``, ``layer``,
``post`` and optionally ``key``, ``post_grad``) lets the pipeline recipes run it. What
can be derived is: ``loss`` from ``stages`` (``Stages.loss``), ``vocab`` from ``dims``.
Declared ``dims`` are checked against the parameters ``init`` gives (their count and
the stack's layers).

Example:
  >>> from shardkit import models
  >>> m = models.load("examples.my_model:build")
  >>> m.name, m.vocab, m.annotations is not None
  ('examples.my_model:build', 256, True)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax

from shardkit.annotate.path_axes import PathAxes
from shardkit.annotate.unbox import unbox
from shardkit.dims import ModelDims
from shardkit.errors import NoCutError, ShardingError
from shardkit.protocol import Model, Stages

__all__ = ["UserModel", "as_user_model", "load"]

_OPTIONAL = ("annotations", "vocab", "dims", "stages")
_HOWTO = "docs/howto/your_own_model.md"


@dataclasses.dataclass(frozen=True, init=False)
class UserModel:
    """A model shardkit did not write: how to init it, its loss, and what it cannot guess.

    It implements :class:`shardkit.protocol.Model`.

    Attributes:
      init: ``rng -> params``.
      loss: ``(params, batch) -> scalar``; ``None`` when ``stages`` gives it.
      name: a label for reports (the ``module:factory`` it was loaded from).
      annotations: a ``sk.PathAxes`` for parameters Flax did not annotate.
      vocab: the token range of the model's inputs (``shardkit run`` draws synthetic
        tokens below it); default ``dims.vocab``.
      dims: the model's :class:`~shardkit.dims.ModelDims` (or a mapping of its fields;
        ``n_kv_heads`` defaults to ``n_heads``), for the report's analytic column.
      stages: its cut for the pipeline recipes (:class:`~shardkit.protocol.Stages`, or a
        mapping of its fields).

    Raises:
      ShardingError: ``init`` or ``loss`` not callable (and no ``stages`` to give the
        loss), dims that are not a ``ModelDims``, or dims that contradict the parameters.
    """

    init: Callable[[Any], Any]
    loss: Callable[[Any, Any], Any] | None = None
    name: str = "custom"
    annotations: PathAxes | None = None
    vocab: int | None = None
    dims: ModelDims | None = None
    stages_: Stages | None = dataclasses.field(default=None, repr=False)

    #: A model of your own decides in its own code what it rematerialises, and follows the
    #: plan's precision (``sk.compute_dtype()``).
    remat = None
    precision = None

    def __init__(
        self,
        init: Callable[[Any], Any],
        loss: Callable[[Any, Any], Any] | None = None,
        *,
        name: str = "custom",
        annotations: Any = None,
        vocab: int | None = None,
        dims: ModelDims | Mapping[str, int] | None = None,
        stages: Stages | Mapping[str, Any] | None = None,
    ):
        fields = {"init": init, "name": name, "vocab": vocab, "annotations": annotations}
        fields["stages_"] = _as_stages(stages, name)
        fields["loss"] = loss if loss is not None or stages is None else fields["stages_"].loss
        fields["dims"] = _as_dims(dims, name)
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not callable(self.init) or not callable(self.loss):
            raise ShardingError(
                f"{self.name}: init and loss must be callables, got "
                f"{type(self.init).__name__} and {type(self.loss).__name__}.\nFix: return "
                "'init': rng -> params and 'loss': (params, batch) -> scalar (or 'stages', "
                f"whose loss is derived) from the factory; see {_HOWTO}."
            )
        if self.annotations is not None and not isinstance(self.annotations, PathAxes):
            object.__setattr__(self, "annotations", PathAxes(self.annotations))
        if self.dims is not None:
            if self.vocab is None:
                object.__setattr__(self, "vocab", self.dims.vocab)
            _check_dims(self)

    def stages(self) -> Stages:
        """The model's cut for a pipeline, checked against its parameters.

        Raises:
          NoCutError: the factory gave no ``stages``, or the parameters have no
            stack of identical layers under ``stages.key`` (the message says how to
            provide them).
        """
        if self.stages_ is None:
            raise NoCutError(
                f"{self.name} gives no pipeline cut, so the pipeline recipes cannot run it.\n"
                "Fix: return 'stages': sk.parallel.Stages(pre, layer, post) from the factory:"
                " pre(rest, batch) -> x, layer(layer_params, x) -> x (one layer of a stack "
                "built with nn.scan / nnx.vmap under params['layers']), post(rest, y, batch) "
                f"-> loss; see {_HOWTO}."
            )
        self.stages_.split(_abstract_params(self))  # raises if there is no such stack
        return self.stages_


def _abstract_params(model: UserModel) -> Any:
    # The key made inside the trace: nothing runs, and JAX's backend does not start (the
    # command line sets the number of devices after loading the model).
    return unbox(jax.eval_shape(lambda: model.init(jax.random.key(0))))


def _as_stages(stages: Any, name: str) -> Stages | None:
    if stages is None or isinstance(stages, Stages):
        return stages
    if isinstance(stages, Mapping):
        try:
            return Stages(**stages)
        except TypeError:
            pass
    raise ShardingError(
        f"{name}: stages is a {type(stages).__name__} "
        f"{sorted(stages) if isinstance(stages, Mapping) else ''}; it should be an "
        "sk.parallel.Stages or a mapping with 'pre', 'layer', 'post' (and optionally 'key', "
        f"'post_grad').\nFix: 'stages': sk.parallel.Stages(pre, layer, post); see {_HOWTO}."
    )


def _as_dims(dims: Any, name: str) -> ModelDims | None:
    if dims is None or isinstance(dims, ModelDims):
        return dims
    if isinstance(dims, Mapping):
        fields = {f.name for f in dataclasses.fields(ModelDims)}
        unknown = sorted(set(dims) - fields)
        required = ("layers", "d_model", "n_heads", "d_ff", "vocab")
        missing = [k for k in required if k not in dims]
        if not unknown and not missing:
            return ModelDims(**{"n_kv_heads": dims["n_heads"], **dims})
        what = f"{unknown} are not ModelDims fields" if unknown else f"it lacks {missing}"
        raise ShardingError(
            f"{name}: dims {dict(dims)}: {what}.\nFix: declare 'dims': ModelDims(layers=..., "
            "d_model=..., n_heads=..., n_kv_heads=..., d_ff=..., vocab=..., ...) "
            f"(shardkit.dims), or a mapping of those fields; see {_HOWTO}."
        )
    raise ShardingError(
        f"{name}: dims is a {type(dims).__name__}; it should be a shardkit.dims.ModelDims "
        f"or a mapping of its fields.\nFix: 'dims': ModelDims(...); see {_HOWTO}."
    )


def _check_dims(model: UserModel) -> None:
    """Declared dims that the parameters contradict: their count, the stack's layers."""
    dims, params = model.dims, _abstract_params(model)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    key = model.stages_.key if model.stages_ is not None else "layers"
    stack = params.get(key) if isinstance(params, Mapping) else None
    leading = {x.shape[0] for x in jax.tree.leaves(stack) if x.shape} if stack else set()
    if leading and leading != {dims.layers}:
        raise ShardingError(
            f"{model.name}: dims declare layers={dims.layers}, but the stack params[{key!r}] "
            f"has {sorted(leading)} layers (its leading axis).\nFix: declare "
            f"ModelDims(layers={min(leading)}, ...), or build the stack with that many layers."
        )
    if count != dims.param_count:
        raise ShardingError(
            f"{model.name}: dims declare {dims.param_count:,} parameters "
            f"(ModelDims.param_count), but init gives {count:,}.\nFix: declare the model's "
            "real sizes (layers, d_model, n_heads, n_kv_heads, d_ff, vocab; tied_embedding, "
            "position_table, gated_mlp, biases, norm), or drop 'dims' (the report then has "
            "no analytic activation terms)."
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


def as_user_model(obj: Any, *, name: str) -> Model:
    """``obj`` (any form a factory may return) as a model of the protocol: a
    :class:`UserModel`, or ``obj`` itself when it has every member of
    :class:`shardkit.protocol.Model` already (its cut is then read when a pipeline asks)."""
    if isinstance(obj, UserModel):
        if obj.name == "custom":
            obj = copy.copy(obj)
            object.__setattr__(obj, "name", name)
        return obj
    if isinstance(obj, Model):  # it speaks the protocol: its remat, precision, cut as it has them
        return obj
    if isinstance(obj, Mapping):
        extra = sorted(set(obj) - {"init", "loss", *_OPTIONAL})
        if extra or "init" not in obj or ("loss" not in obj and "stages" not in obj):
            raise ShardingError(
                f"{name}: the factory's mapping has keys {sorted(obj)}; it needs 'init' and "
                f"'loss' (or 'stages', whose loss is derived), and may have "
                f"{', '.join(_OPTIONAL)}.\nFix: return {{'init': init, 'loss': loss, ...}}; "
                f"see {_HOWTO}."
            )
        return UserModel(name=name, **obj)
    if isinstance(obj, tuple) and len(obj) == 2:
        return UserModel(obj[0], obj[1], name=name)
    if hasattr(obj, "init") and (hasattr(obj, "loss") or hasattr(obj, "stages")):
        options = {k: getattr(obj, k) for k in _OPTIONAL if getattr(obj, k, None) is not None}
        if callable(options.get("stages")):  # a method, as the protocol has it
            options["stages"] = obj.stages()
        return UserModel(obj.init, getattr(obj, "loss", None), name=name, **options)
    missing = [k for k in ("init", "loss") if not hasattr(obj, k)]
    raise ShardingError(
        f"{name}: the factory returned {type(obj).__name__} (no {' or '.join(missing)}); it "
        "should return the model: a mapping {'init': ..., 'loss': ...}, a pair (init, "
        f"loss), or an object with init() and loss() methods.\nFix: see {_HOWTO}."
    )
