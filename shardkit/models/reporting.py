"""Compile-only reports of a model's training step.

``models.report(plan, model, batch=..., seq=...)`` is ``plan.report`` with the
pieces a reference model brings: its init, its loss, an AdamW train step, an
abstract token batch and its workload. Nothing is allocated.

Example:
  >>> import shardkit as sk
  >>> from shardkit import models
  >>> r = models.report(sk.Plan("fsdp"), models.get("gpt-tiny"), batch=8, seq=32)
  >>> r.workload.model, r.ratios()["state_memory"] < 1.1
  ('gpt-tiny', True)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardkit import train
from shardkit.parallel.cli import for_plan
from shardkit.workload import Workload

__all__ = ["report", "token_batch"]


def token_batch(batch: int, seq: int, plan: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
    """An abstract ``{"inputs", "targets"}`` batch of ``int32[batch, seq]`` tokens, and
    ``"positions"`` and ``"segment_ids"`` where ``plan`` places its batches in a balanced
    order (:meth:`shardkit.Plan.shard_batch`)."""
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)
    out = {"inputs": tokens, "targets": tokens}
    if plan is not None and plan.balance_order(seq) is not None:
        out["positions"] = out["segment_ids"] = tokens
    return out


def report(
    plan: Any,
    model: Any,
    tx: Any = None,
    *,
    batch: int,
    seq: int,
    seed: int = 0,
    pipeline: dict | None = None,
    **kwargs: Any,
):
    """A compile-only ``Report`` of ``model``'s AdamW train step under ``plan``.

    Args:
      plan: an ``sk.Plan``.
      model: a model (:class:`shardkit.protocol.Model`): a reference ``Model``
        (``models.get``) or a user's loaded by ``models.load``.
      tx: the optimizer (default: ``train.adamw()``).
      batch, seq: global batch and sequence length.
      seed: the PRNG seed of the (abstract) init.
      pipeline: for a plan with a ``stage`` axis, the pipeline's options
        (``{"microbatches": m, "schedule": "gpipe"|"1f1b"|"interleaved", ...}``; default
        1F1B with one micro-batch per stage).
      **kwargs: passed to ``plan.report`` (e.g. lint thresholds).
    """
    tx = train.adamw() if tx is None else tx
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(seed))
    workload = Workload.of_model(model, batch=batch, seq=seq, precision=plan.precision)
    stages = dict(plan.mesh.shape).get("stage")
    if stages:  # a pipeline runs its own step (1F1B, one micro-batch per stage by default)
        opts = {
            "microbatches": stages,
            "schedule": "1f1b",
            "virtual_stages": 1,
            "unit": None,
            **(pipeline or {}),
        }
        step = train.train_step(
            model, tx, plan=plan, abstract=abstract, pipeline=for_plan(plan, opts)
        )
        return plan.report(step, abstract, token_batch(batch, seq), workload=workload, **kwargs)
    return plan.report(
        train.train_step(model, tx),
        abstract,
        token_batch(batch, seq, plan),
        workload=workload,
        dims=model.dims,
        **kwargs,
    )
