"""What any model gives shardkit: ``init``, ``loss``, and optionally its cut and its sizes.

A model is any object with these members (:class:`Model`). The reference models
(``shardkit.models.get``) have them all; a model of your own gets them from
``shardkit.models.load`` / ``UserModel``, whose factory may give only ``init`` and
``loss``:

- ``init(rng) -> params`` and ``loss(params, batch) -> scalar``: any recipe can train it;
- ``stages() -> Stages``: its cut for a pipeline (``pre`` / one layer of a stack of
  identical layers / ``post``, and optionally ``post_grad``, the head's gradient written
  in place); the pipeline recipes (``pp``, ``dp_pp``, ``zeropp``, ``dp_tp_sp_pp``) need it;
- ``dims``: its :class:`~shardkit.dims.ModelDims` (``None`` when undeclared); the
  report's analytic column and the planner read them;
- ``name``, ``vocab`` (the token range), ``annotations`` (a ``sk.PathAxes`` for
  parameters nobody annotated), ``remat`` (what it rematerialises; ``None``: its own
  code decides) and ``precision`` (``"f32"``/``"bf16"`` when the model fixes its
  compute dtype; ``None``: the plan's).

Nothing here imports a model or an engine: the engines take a :class:`Stages`, the
report takes ``ModelDims``.

Example:
  >>> import jax.numpy as jnp
  >>> st = Stages(pre=lambda r, mb: mb["x"] * r["a"], layer=lambda w, x: x * w,
  ...             post=lambda r, y, mb: jnp.mean(y))
  >>> params = {"layers": jnp.array([2.0, 3.0]), "a": jnp.array(1.0)}
  >>> float(st.loss(params, {"x": jnp.ones(4)}))
  6.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from shardkit.dims import ModelDims
from shardkit.errors import NoCutError

__all__ = ["Model", "Stages"]


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model as ``pre(rest, mb) -> x``, ``layer(layer_params, x) -> x``, ``post(rest, y, mb)
    -> mean loss``, with its layers stacked under ``params[key]`` (a leading axis, what
    linen ``nn.scan`` and NNX ``nnx.vmap`` give a module called ``layers``).

    ``post_grad`` (optional): ``post``'s loss and gradients added into a running sum,
    ``(rest, y, mb, d_rest, scale) -> (scale·loss, d_rest + scale·∂loss/∂rest,
    scale·∂loss/∂y)``; the pipeline's last stage calls it instead of
    ``jax.value_and_grad(post)`` plus an add (``shardkit.nn.loss.head_post_grad``: a
    vocabulary head's gradient written in place).
    """

    pre: Callable[[Any, Any], jax.Array]
    layer: Callable[[Any, jax.Array], jax.Array]
    post: Callable[[Any, jax.Array, Any], jax.Array]
    key: str = "layers"
    post_grad: Callable[..., tuple[jax.Array, Any, jax.Array]] | None = None

    def split(self, params: Any) -> tuple[Any, Any]:
        """``(params[key], the rest)``.

        Raises:
          NoCutError: no ``key`` in the parameters, or a stack whose leaves do
            not share one leading (layers) axis.
        """
        try:
            stack = params[self.key]
        except (KeyError, TypeError):
            keys = list(params) if hasattr(params, "keys") else type(params).__name__
            raise NoCutError(
                f"No stacked layers under {self.key!r} in the parameters (top-level keys: "
                f"{keys}). A pipeline cuts a stack of identical layers with a leading "
                "'layers' axis.\nFix: build the layers with nn.scan / nnx.vmap (reference "
                "models: scan=True), or Stages(..., key=<the stack's key>)."
            ) from None
        leading = {  # arrays (or their shapes); a tree of PartitionSpecs is not checked
            jax.tree_util.keystr(p): (x.shape[0] if x.shape else None)
            for p, x in jax.tree_util.tree_leaves_with_path(stack)
            if hasattr(x, "shape")
        }
        if leading and (None in leading.values() or len(set(leading.values())) != 1):
            shown = ", ".join(f"{k or '.'}: {v}" for k, v in list(leading.items())[:4])
            raise NoCutError(
                f"params[{self.key!r}] is not a stack of identical layers: its leaves' "
                f"leading axes are {{{shown}}} (a pipeline needs one leading 'layers' axis "
                "of the same size on every leaf).\nFix: build the layers with nn.scan / "
                "nnx.vmap so every parameter of the stack is [layers, ...]."
            )
        return stack, {k: params[k] for k in params if k != self.key}

    def merge(self, stack: Any, rest: Any) -> Any:
        """The inverse of :meth:`split`."""
        out = {k: rest[k] for k in rest}
        out[self.key] = stack
        return out

    def loss(self, params: Any, batch: Any) -> jax.Array:
        """The un-pipelined loss: ``post(rest, scan(layer)(pre(rest, batch)), batch)``."""
        stack, rest = self.split(params)
        x = self.pre(rest, batch)
        x = jax.lax.scan(lambda h, w: (self.layer(w, h), None), x, stack)[0]
        return self.post(rest, x, batch)


@runtime_checkable
class Model(Protocol):
    """What shardkit reads of a model (the module docstring says what each member is).

    Example:
      >>> from shardkit import models
      >>> isinstance(models.get("gpt-tiny"), Model), isinstance(object(), Model)
      (True, False)
    """

    name: str
    vocab: int | None
    annotations: Any
    remat: str | None
    precision: str | None

    @property
    def dims(self) -> ModelDims | None: ...

    def init(self, rng: jax.Array) -> Any: ...

    def loss(self, params: Any, batch: Any) -> jax.Array: ...

    def stages(self) -> Stages: ...
