"""Pipeline parallelism: schedules (``gpipe``, ``1f1b``, ``interleaved``) and their engine.

The engine runs a model's cut (:class:`Stages`, from ``model.stages()``); it never names
a model. ``shardkit.train.train_step`` is the training step around it.

Example:
  >>> from shardkit import parallel
  >>> parallel.schedules.make("gpipe", stages=4, microbatches=16).bubble
  0.15789473684210525
"""

from shardkit.errors import NotPipelinableError, PipelineError
from shardkit.nn.loss import head_post_grad
from shardkit.nn.stack import linen_layer, nnx_layer
from shardkit.parallel import pipeline, schedules, stages
from shardkit.parallel.pipeline import STAGE, PipelinedGrad, mesh_value_and_grad, stored_order
from shardkit.parallel.schedules import (
    SCHEDULES,
    MicrobatchError,
    PipelineWarning,
    StageDivisibilityError,
    UnitError,
    UnknownScheduleError,
    bubble_fraction,
)
from shardkit.parallel.stages import (
    from_interleaved,
    order_converters,
    pipeline_value_and_grad,
    to_interleaved,
)
from shardkit.protocol import Stages
from shardkit.step import PipelinedStep

__all__ = [
    "NotPipelinableError",
    "SCHEDULES",
    "Stages",
    "STAGE",
    "MicrobatchError",
    "PipelineError",
    "PipelineWarning",
    "PipelinedGrad",
    "PipelinedStep",
    "StageDivisibilityError",
    "UnitError",
    "UnknownScheduleError",
    "bubble_fraction",
    "from_interleaved",
    "head_post_grad",
    "linen_layer",
    "mesh_value_and_grad",
    "nnx_layer",
    "order_converters",
    "pipeline",
    "pipeline_value_and_grad",
    "schedules",
    "stages",
    "stored_order",
    "to_interleaved",
]
