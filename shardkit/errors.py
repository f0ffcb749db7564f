"""Every user mistake shardkit detects is a :class:`ShardingError`.

Messages follow one shape: what is wrong (path, shape, logical axes, mesh axis
sizes), why, and a fix written as something the user can type.

Example:
  >>> import shardkit as sk
  >>> try:
  ...     sk.Rules([("embed", 3)])
  ... except sk.ShardingError as e:
  ...     print(type(e).__name__)
  RuleError
"""

from __future__ import annotations

__all__ = [
    "ShardingError",
    "RuleError",
    "UnknownMeshAxisError",
    "DuplicateMeshAxisError",
    "IndivisibleError",
    "RankMismatchError",
    "AmbiguousAxesError",
    "UnmatchedPathError",
    "UnknownLogicalAxisError",
    "MeshError",
    "DeviceError",
    "ShardingWarning",
    "ArgumentTypeError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptError",
    "PeerFailedError",
    "PipelineError",
    "NotPipelinableError",
    "NoCutError",
]


class ShardingError(ValueError):
    """Base class of every error shardkit raises for a user mistake."""


class ArgumentTypeError(ShardingError, TypeError):
    """A public argument has the wrong type (also a ``TypeError``)."""


class RuleError(ShardingError):
    """A rule list is malformed (not ``(logical, mesh_axes)`` pairs)."""


class UnknownMeshAxisError(ShardingError):
    """A rule names a mesh axis the mesh does not have."""


class DuplicateMeshAxisError(ShardingError):
    """The same mesh axis appears twice in one PartitionSpec."""


class IndivisibleError(ShardingError):
    """A dimension is not divisible by the mesh axes it is mapped onto."""


class RankMismatchError(ShardingError):
    """A leaf has a different number of dimensions than its logical axes."""


class AmbiguousAxesError(ShardingError):
    """Several annotations match one leaf and disagree."""


class UnmatchedPathError(ShardingError):
    """A leaf matched no annotation and the policy is ``"error"``."""


class UnknownLogicalAxisError(ShardingError):
    """A logical axis has no rule and the rules are strict."""


class MeshError(ShardingError):
    """Mesh axis sizes do not factor the device count."""


class DeviceError(ShardingError):
    """Devices cannot be set up as asked (e.g. the backend already started)."""


class ShardingWarning(UserWarning):
    """A layout that works but is probably not what was meant (e.g. mostly replicated)."""


class CheckpointError(ShardingError):
    """A checkpoint cannot be saved or restored as asked."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint (or not the asked-for step) under a directory."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's leaves differ from the restore target (names, shapes, dtypes)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are unreadable or its values fail their checksums."""


class PeerFailedError(ShardingError):
    """Another process of a multi-process run died or stopped responding."""


class PipelineError(ShardingError):
    """A pipeline cannot run as asked."""


class NotPipelinableError(PipelineError):
    """A model or recipe that cannot run as a pipeline (no scanned stack, no stage axis, no cut)."""


class NoCutError(NotPipelinableError):
    """A model that gives no pipeline cut (``stages``), or whose parameters have no stack of
    identical layers to cut: the fix is in the model, not in the recipe."""
