"""Pipeline parallelism: schedules (``gpipe``, ``1f1b``, ``interleaved``) and their engine.

Example:
  >>> from shardkit import parallel
  >>> parallel.schedules.make("gpipe", stages=4, microbatches=16).bubble
  0.15789473684210525
"""

from shardkit.parallel import pipeline, schedules
from shardkit.parallel.pipeline import STAGE, value_and_grad
from shardkit.parallel.schedules import (
    SCHEDULES,
    MicrobatchError,
    PipelineError,
    PipelineWarning,
    StageDivisibilityError,
    UnknownScheduleError,
    bubble_fraction,
)

__all__ = [
    "SCHEDULES",
    "STAGE",
    "MicrobatchError",
    "PipelineError",
    "PipelineWarning",
    "StageDivisibilityError",
    "UnknownScheduleError",
    "bubble_fraction",
    "pipeline",
    "schedules",
    "value_and_grad",
]
