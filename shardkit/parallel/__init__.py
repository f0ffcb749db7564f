"""Pipeline parallelism: schedules (``gpipe``, ``1f1b``, ``interleaved``) and their engine.

Example:
  >>> from shardkit import parallel
  >>> parallel.schedules.make("gpipe", stages=4, microbatches=16).bubble
  0.15789473684210525
"""

from shardkit.parallel import pipeline, schedules, stages
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
from shardkit.parallel.stages import (
    NotPipelinableError,
    Stages,
    from_interleaved,
    head_post_grad,
    linen_layer,
    nnx_layer,
    reference_stages,
    to_interleaved,
    train_step,
)

__all__ = [
    "NotPipelinableError",
    "SCHEDULES",
    "Stages",
    "STAGE",
    "MicrobatchError",
    "PipelineError",
    "PipelineWarning",
    "StageDivisibilityError",
    "UnknownScheduleError",
    "bubble_fraction",
    "from_interleaved",
    "head_post_grad",
    "linen_layer",
    "nnx_layer",
    "pipeline",
    "reference_stages",
    "schedules",
    "stages",
    "to_interleaved",
    "train_step",
    "value_and_grad",
]
