"""``PipelinedStep``: a train step that runs as a pipeline, typed.

``shardkit.train.train_step`` returns one for a plan with a ``stage`` axis: call it as
``step(state, batch)``; it carries its schedule, the options the analytic model counts
(``sk.report.build_report`` reads :attr:`PipelinedStep.options`), and, under ``interleaved`` with the
stack stored in the schedule's order, the converters of the state between that order and
layer order (run ``to_stored`` once before the first step, ``to_layers`` to save or read
the state per layer; ``None`` when the state is used as is).

Example:
  >>> step = PipelinedStep(lambda s, b: (s, {}), schedule=None, microbatches=4,
  ...                      schedule_name="1f1b")
  >>> step.options, step.to_stored is None
  ({'microbatches': 4, 'schedule': '1f1b', 'virtual_stages': 1, 'unit': None}, True)
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

__all__ = ["PIPELINE_DEFAULTS", "PipelinedStep"]

#: A pipeline's options where none are given (``microbatches``: one per stage). The one
#: definition: ``train.train_step``, the command line's flags and ``build_report`` read it.
PIPELINE_DEFAULTS = types.MappingProxyType(
    {
        "schedule": "1f1b",
        "virtual_stages": 1,
        "unit": None,
        "stack_order": "layers",
        "rolled": True,
    }
)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jax.jit keys a function
class PipelinedStep:
    """A pipelined ``step(state, batch) -> (state, metrics)``.

    Attributes:
      fn: the step.
      schedule: the ``shardkit.parallel.schedules.Schedule`` it runs (its timeline,
        bubble and buffer slots).
      microbatches, schedule_name, virtual_stages, unit: the pipeline's options.
      stack_order: ``"layers"`` or ``"interleaved"`` (the state's layer stacks stored in
        the schedule's order).
      to_stored, to_layers: ``state -> state`` between layer order and the stored order
        (``None`` in layer order).
    """

    fn: Callable[[Any, Any], tuple[Any, dict]]
    schedule: Any
    microbatches: int
    schedule_name: str
    virtual_stages: int = 1
    unit: int | None = None
    stack_order: str = "layers"
    to_stored: Callable[[Any], Any] | None = None
    to_layers: Callable[[Any], Any] | None = None

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        return self.fn(state, batch)

    @property
    def options(self) -> dict[str, Any]:
        """What the analytic model of a pipelined step reads."""
        return {
            "microbatches": self.microbatches,
            "schedule": self.schedule_name,
            "virtual_stages": self.virtual_stages,
            "unit": self.unit,
        }
