"""A minimal functional training loop for the reference models.

The pieces ``shardkit run``, the recipes and the tests share: a ``TrainState``,
an AdamW optimizer, an init function whose params come out annotated (so
``plan.init`` can shard them at birth) and an ordinary ``step(state, batch)``.

Example:
  >>> import jax, shardkit as sk
  >>> from shardkit import train
  >>> from shardkit.models import get
  >>> model, tx = get("gpt-tiny"), train.adamw()
  >>> plan = sk.Plan("dp")
  >>> state = plan.init(train.init_fn(model, tx), jax.random.key(0))
  >>> int(state.step)
  0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shardkit.annotate.unbox import unbox

__all__ = ["TrainState", "adamw", "clip_by_global_norm", "init_fn", "train_step"]


class TrainState(NamedTuple):
    """Step counter, parameters and optimizer state."""

    step: jax.Array
    params: Any
    opt_state: Any


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` as one scalar factor: ``g · max / max(‖g‖, max)``.

    optax writes the clip as ``select(‖g‖ < max, g, g / ‖g‖ · max)``, which XLA
    computes as a second full copy of the gradients before the optimizer reads them
    (475 MiB per device for GPT-2-small under ``dp``). One scalar multiply fuses into
    the optimizer's element-wise update instead: no copy. The result is the same
    (``max / max`` is exactly 1 below the threshold); the state is ``optax``'s (empty).

    Example:
      >>> import jax.numpy as jnp
      >>> tx = clip_by_global_norm(1.0)
      >>> g = {"a": jnp.array([3.0, 4.0])}
      >>> [float(x) for x in tx.update(g, tx.init(g))[0]["a"]]
      [0.6000000238418579, 0.800000011920929]
    """

    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, Any]:
        del params
        norm = optax.tree.norm(updates)
        scale = max_norm / jnp.maximum(norm, max_norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(init, update)


def adamw(
    learning_rate: float = 1e-2, weight_decay: float = 0.0, eps: float = 1e-5
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping at 1.0 (the optimizer every recipe uses).

    ``eps`` defaults to 1e-5 rather than optax's 1e-8: smaller, Adam divides the f32
    rounding noise of near-zero gradients by it, and a sharded run drifts from one
    device's (docs/explain/correctness.md: the equality claim and its conditions).

    The clip is :func:`clip_by_global_norm` (a scalar factor, no copy of the gradients).
    """
    return optax.chain(
        clip_by_global_norm(1.0),
        optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=eps, weight_decay=weight_decay),
    )


def init_fn(model: Any, tx: optax.GradientTransformation) -> Callable[[jax.Array], TrainState]:
    """``rng -> TrainState`` with *annotated* params, for ``plan.init``."""

    def init(rng: jax.Array) -> TrainState:
        params = model.init(rng)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(unbox(params)))

    return init


def train_step(
    model: Any, tx: optax.GradientTransformation, *, return_grads: bool = False
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """An ordinary ``step(state, batch) -> (state, {"loss": ...})``.

    With ``return_grads=True`` the metrics also hold the gradients (for tests
    that compare layouts).
    """

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(model.loss)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grads": grads} if return_grads else {"loss": loss}
        return TrainState(state.step + 1, params, opt_state), metrics

    return step
