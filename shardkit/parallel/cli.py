"""The pipeline flags of ``shardkit run`` and ``shardkit report``, and the step they build.

``--microbatches M --schedule gpipe|1f1b|interleaved [--virtual-stages V] [--unit U]``.
A recipe with a ``stage`` axis trains with the pipelined step (``M`` defaults to the
number of stages); the flags with any other recipe are an error that names the fix.

Under ``interleaved`` (``V > 1``) and ``zbv`` the step takes the layer stack stored in
the schedule's order (``stack_order="interleaved"``): in layer order it would reorder the
stack and its gradient across stages every step (2.6x the analytic wire on gpt-small
under interleaved, 3.3x under zbv). The
step (``shardkit.step.PipelinedStep``) carries ``to_stored`` / ``to_layers``, run once on
the state as it enters the loop and wherever it leaves it (a checkpoint stays in layer
order, for any schedule or recipe).

Example:
  >>> import argparse
  >>> p = argparse.ArgumentParser()
  >>> add_arguments(p)
  >>> options(p.parse_args(["--microbatches", "8", "--schedule", "gpipe"]))
  {'microbatches': 8, 'schedule': 'gpipe', 'virtual_stages': 1, 'unit': None}
"""

from __future__ import annotations

import argparse
from typing import Any

from shardkit.errors import NotPipelinableError
from shardkit.parallel.schedules import SCHEDULES, SPLIT
from shardkit.step import PIPELINE_DEFAULTS

__all__ = ["add_arguments", "for_plan", "options"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--microbatches``, ``--schedule``, ``--virtual-stages``, ``--unit``,
    ``--rolled`` / ``--unrolled``."""
    g = p.add_argument_group(
        "pipeline (recipes with a 'stage' axis: pp, dp_pp, zeropp, dp_tp_sp_pp)"
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per step (default: the number of stages)",
    )
    g.add_argument(
        "--schedule",
        default=None,
        help=f"one of {', '.join(SCHEDULES)} (default 1f1b); interleaved trains the layer "
        "stack stored in the schedule's order (checkpoints stay in layer order); zb1 and zbv "
        "(zero-bubble: weight gradients deferred into the bubble) run rolled",
    )
    g.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per stage (interleaved: default 2; zbv: 2)",
    )
    g.add_argument(
        "--unit",
        type=int,
        default=None,
        help="ZeroPP: micro-batches per weight gather (default: one per step)",
    )
    g.add_argument(
        "--rolled",
        action="store_true",
        default=None,
        help="a stage's layers (and runs of like ticks) in rolled loops (the default): "
        "compile time flat in depth and micro-batches, one layer rematerialised at a time",
    )
    g.add_argument(
        "--unrolled",
        dest="rolled",
        action="store_false",
        help="a stage's layers and the schedule's ticks unrolled (the engine before rolled "
        "loops: compile time grows with (m + p)·L/p)",
    )


def options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The pipeline options the flags ask for, or ``None`` when no flag is given."""
    keys = ("microbatches", "schedule", "virtual_stages", "unit", "rolled")
    if all(getattr(args, k, None) is None for k in keys):
        return None
    schedule = args.schedule or PIPELINE_DEFAULTS["schedule"]
    default_v = 2 if schedule in ("interleaved", "zbv") else 1
    out = {
        "microbatches": args.microbatches,
        "schedule": schedule,
        "virtual_stages": args.virtual_stages or default_v,
        "unit": args.unit,
    }
    if getattr(args, "rolled", None) is not None:
        out["rolled"] = args.rolled
    return out


def for_plan(plan: Any, opts: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pipeline options of ``shardkit.train.train_step`` for ``plan``, or ``None`` (no
    ``stage`` axis: the plain step).

    Fills what the flags leave out from ``shardkit.step.PIPELINE_DEFAULTS`` (one
    micro-batch per stage, ``1f1b``); under ``interleaved`` with ``virtual_stages > 1``
    and under ``zbv`` the stack stored in the schedule's order (the step's ``to_stored``
    / ``to_layers`` convert the state). ``opts`` may name
    ``stack_order="layers"`` to keep the layer order (to measure what it costs).

    Raises:
      NotPipelinableError: pipeline flags with a recipe that has no ``stage`` axis.

    Example:
      >>> import jax, shardkit as sk
      >>> plan = sk.Plan("pp", devices=jax.devices()[:2])
      >>> for_plan(plan, {"schedule": "interleaved", "virtual_stages": 2})["stack_order"]
      'interleaved'
    """
    stages = dict(plan.mesh.shape).get("stage")
    if stages is None:
        if opts is not None:
            raise NotPipelinableError(
                f"--microbatches/--schedule/--unit need a recipe with a 'stage' axis; "
                f"{plan.recipe.name!r} has {dict(plan.mesh.shape)}.\nFix: --recipe pp, dp_pp, "
                "zeropp or dp_tp_sp_pp, or drop the pipeline flags."
            )
        return None
    given = {k: v for k, v in (opts or {}).items() if v is not None}
    opts = {**PIPELINE_DEFAULTS, "microbatches": int(stages), **given}
    opts["virtual_stages"] = int(opts["virtual_stages"])
    if opts["schedule"] in SPLIT and "rolled" not in given:
        opts["rolled"] = True  # zb1 / zbv split each layer's backward: the rolled engine
    if opts["schedule"] == "zbv" and "virtual_stages" not in given:
        opts["virtual_stages"] = 2
    chunked = opts["schedule"] in ("interleaved", "zbv") and opts["virtual_stages"] > 1
    if not chunked:
        opts["stack_order"] = "layers"
    elif "stack_order" not in given:
        opts["stack_order"] = "interleaved"
    return opts
