"""A minimal functional training loop for any model, pipelined or not.

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

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardkit.annotate.unbox import unbox
from shardkit.balance import ZIGZAG, zigzag_marker
from shardkit.errors import NotPipelinableError, ShardingError
from shardkit.parallel.stages import order_converters, pipeline_value_and_grad
from shardkit.protocol import Stages
from shardkit.step import PIPELINE_DEFAULTS, PipelinedStep

__all__ = ["TrainState", "adamw", "clip_by_global_norm", "init_fn", "token_batch", "train_step"]


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


def token_batch(batch: int, seq: int, plan: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
    """An abstract ``{"inputs", "targets"}`` batch of ``int32[batch, seq]`` tokens, what
    :func:`train_step`'s step takes (to compile it without data); with ``"positions"``
    and ``"segment_ids"`` too where ``plan`` places its batches in a balanced order
    (``plan.balance_order``: the context-parallel recipes' zigzag, :mod:`shardkit.balance`),
    and the ``"zigzag"`` mark of its one-document rows (the ring's static half blocks).

    Example:
      >>> token_batch(8, 32)["inputs"]
      ShapeDtypeStruct(shape=(8, 32), dtype=int32)
    """
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)
    out = {"inputs": tokens, "targets": tokens}
    if plan is not None and plan.balance_order(seq) is not None:
        out["positions"] = out["segment_ids"] = tokens
        ranks = plan.mesh.shape[plan.recipe.balance_axis]
        out[ZIGZAG] = jax.ShapeDtypeStruct(zigzag_marker(ranks).shape, np.int32)
    return out


def train_step(
    model: Any,
    tx: optax.GradientTransformation,
    *,
    plan: Any = None,
    abstract: Any = None,
    pipeline: Mapping[str, Any] | None = None,
    return_grads: bool = False,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]] | PipelinedStep:
    """The training step ``step(state, batch) -> (state, {"loss": ...})`` of any model.

    Under a plan with a ``stage`` axis (``pp``, ``dp_pp``, ``zeropp``, ``dp_tp_sp_pp``) the
    loss and gradients come from the pipeline engine
    (:func:`shardkit.parallel.stages.pipeline_value_and_grad`) run on the model's cut
    (``model.stages()``, :mod:`shardkit.protocol`; or ``model`` itself when it is a
    ``Stages``), and the step is a :class:`~shardkit.step.PipelinedStep`. Otherwise the
    step is ``jax.value_and_grad(model.loss)`` and an optimizer update.

    Args:
      model: a model (:class:`shardkit.protocol.Model`) or a ``Stages``.
      tx: the optimizer.
      plan, abstract: the plan and its abstract state (``plan.abstract_init``); a
        pipelined step reads the layout from them.
      pipeline: ``{"microbatches", "schedule", "virtual_stages", "unit", "stack_order",
        "rolled"}`` (defaults, ``shardkit.step.PIPELINE_DEFAULTS``: one micro-batch per
        stage, ``"1f1b"``, 1, one weight gather per step, ``"layers"``, ``True``: a
        stage's layers in rolled loops; ``False`` unrolls them). ``stack_order="interleaved"`` (``interleaved`` schedule): the
        state's layer stacks are stored in the schedule's order; the step's
        ``to_stored`` / ``to_layers`` convert the state once each way.
      return_grads: the metrics also hold the gradients (tests that compare layouts).

    Raises:
      NotPipelinableError: pipeline options under a plan with no ``stage`` axis, or a
        model without a cut (what to provide is in the message).

    Example:
      >>> import jax, shardkit as sk
      >>> from shardkit.models import get
      >>> model, tx = get("gpt-tiny", n_layers=4), adamw()
      >>> plan = sk.Plan("pp", devices=jax.devices()[:4])
      >>> abstract = plan.abstract_init(init_fn(model, tx), jax.random.key(0))
      >>> step = train_step(model, tx, plan=plan, abstract=abstract,
      ...                   pipeline={"microbatches": 8, "schedule": "gpipe"})
      >>> step.options["microbatches"], round(step.schedule.bubble, 3)
      (8, 0.273)
    """
    stages = None if plan is None else dict(plan.mesh.shape).get("stage")
    if stages is None:
        if pipeline is not None:
            where = "no plan" if plan is None else f"recipe {plan.recipe.name!r} has "
            where += "" if plan is None else str(dict(plan.mesh.shape))
            raise NotPipelinableError(
                f"train_step(pipeline={dict(pipeline)}): a pipeline needs a plan with a "
                f"'stage' axis; {where}.\nFix: plan=sk.Plan('pp' | 'dp_pp' | 'zeropp' | "
                "'dp_tp_sp_pp', ...), or drop pipeline=."
            )
        return _step(jax.value_and_grad(model.loss), tx, return_grads)
    if abstract is None:
        raise ShardingError(
            f"train_step(plan=<{plan.recipe.name}>): a pipelined step reads the layout from "
            "the abstract state.\nFix: pass abstract=plan.abstract_init(init_fn(model, tx), "
            "key)."
        )
    opts = dict(PIPELINE_DEFAULTS)
    unknown = sorted(set(pipeline or {}) - {*opts, "microbatches"})
    if unknown:
        raise ShardingError(
            f"train_step(pipeline=...): {unknown} are not pipeline options.\nFix: use "
            "microbatches, schedule, virtual_stages, unit, stack_order, rolled."
        )
    cut = model if isinstance(model, Stages) else model.stages()
    opts.update({k: v for k, v in (pipeline or {}).items() if v is not None})
    opts["microbatches"] = int(opts.get("microbatches") or stages)
    grad_fn = pipeline_value_and_grad(cut, plan, abstract, **opts)
    to_stored = to_layers = None
    if opts["stack_order"] == "interleaved":
        to_stored, to_layers = order_converters(
            plan, abstract, int(stages), grad_fn.schedule.virtual, grad_fn.schedule.name
        )
    return PipelinedStep(
        _step(grad_fn, tx, return_grads, packed=False),
        schedule=grad_fn.schedule,
        microbatches=opts["microbatches"],
        schedule_name=opts["schedule"],
        virtual_stages=int(opts["virtual_stages"]),
        unit=opts["unit"],
        stack_order=opts["stack_order"],
        to_stored=to_stored,
        to_layers=to_layers,
    )


def _step(
    value_and_grad: Callable[[Any, dict], tuple[jax.Array, Any]],
    tx: optax.GradientTransformation,
    return_grads: bool,
    *,
    packed: bool = True,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if not packed and isinstance(batch, Mapping) and "segment_ids" in batch:
            raise NotPipelinableError(
                "train_step: a packed batch (segment_ids "
                f"{tuple(batch['segment_ids'].shape)}) under a pipeline: the pipeline's "
                "stages read inputs and targets only, so the documents' mask and positions "
                "would be ignored.\nFix: train packed rows under a recipe without a 'stage' "
                "axis (cp, fsdp_cp, tsp, ...), or drop segment_ids and positions."
            )
        loss, grads = value_and_grad(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grads": grads} if return_grads else {"loss": loss}
        return TrainState(state.step + 1, params, opt_state), metrics

    return step
