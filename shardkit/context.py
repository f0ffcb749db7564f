"""The one sharding context that code running inside a model reads.

``plan.jit`` enters it once around tracing a step: the parameter rules (``@sk.axes``
pins each sharded weight where it is read), the activation rules (``sk.constrain``, the
batch) and the attention strategy (``causal_attention``). Model code
reads it through :func:`current` and never names a rule or a mesh axis; the mesh is
JAX's own (``jax.set_mesh``), read by :func:`active_mesh`. It also carries the plan's
precision: :func:`compute_dtype` is the dtype a model computes its activations in
(``bfloat16`` under ``sk.Plan(..., precision="bf16")``; parameters stay as stored).

The context is immutable; :func:`using` replaces fields for the duration of a
``with`` block and restores the previous context on exit (a ``contextvars``
variable, so threads and async tasks each see their own).

Example:
  >>> import shardkit as sk
  >>> from shardkit import context
  >>> context.current().activation_rules is None
  True
  >>> with context.using(activation_rules=sk.Rules([("batch", "data")]), attention="ring"):
  ...     ctx = context.current()
  ...     ctx.activation_rules.spec(("batch",)), ctx.attention
  (P('data',), 'ring')
  >>> context.current().attention
  'dense'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from shardkit.errors import ShardingError
from shardkit.rules import Rules

__all__ = [
    "AttentionStrategy",
    "ExpertDispatch",
    "LayerSchedule",
    "PRECISIONS",
    "Precision",
    "ShardingContext",
    "active_mesh",
    "check_precision",
    "compute_dtype",
    "context_axes",
    "current",
    "using",
]

#: ``"usp"``: Ulysses × ring (Fang & Zhao 2024) over a pair of axes
#: ``(ulysses_axis, ring_axis)``; the others run over one axis.
AttentionStrategy = Literal["dense", "allgather", "ring", "ulysses", "usp"]
#: How the layers' matmuls treat weights sharded over ``attention_axis``: ``"gspmd"``
#: leaves them to XLA; ``"tsp"`` runs shardkit.nn.tsp's weight-shard ring.
LayerSchedule = Literal["gspmd", "tsp"]
#: How a mixture-of-experts layer reaches experts split over a mesh axis: ``"gspmd"``
#: leaves its one-hot einsums to XLA; ``"alltoall"`` dispatches and combines with
#: all-to-alls over the expert axis inside ``shard_map`` (``shardkit.nn.moe``).
ExpertDispatch = Literal["gspmd", "alltoall"]
#: ``"f32"``: everything in float32. ``"bf16"``: mixed precision, activations and matrix
#: products in bfloat16, parameters, gradients and optimizer state in float32.
Precision = Literal["f32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def check_precision(precision: Any, where: str = "precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a ``ShardingError``."""
    if precision not in PRECISIONS:
        raise ShardingError(
            f"{where}={precision!r}: precision is one of {list(PRECISIONS)}.\nFix: "
            "precision='bf16' for bfloat16 activations with float32 weights and Adam state."
        )
    return precision


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """What in-model code needs to know about the layout it is traced under.

    Attributes:
      param_rules: logical → mesh rules for parameters (``None``: weights unpinned).
      activation_rules: rules for activations and the batch (``None``: no constraints).
      attention: how ``causal_attention`` treats a sharded sequence.
      attention_axis: the mesh axis that splits the sequence for attention; for
        ``attention="usp"`` a pair ``(ulysses_axis, ring_axis)``: the sequence split over
        both (ring-major), heads exchanged over the first, K/V passed around the second.
      layer_schedule: how the models' projections run (``"tsp"``: weight shards
        circulate over ``attention_axis``, see ``shardkit.nn.tsp``).
      precision: ``"f32"`` or ``"bf16"`` (see :func:`compute_dtype`).
      expert_dispatch: how MoE layers reach their experts (``"alltoall"``: all-to-alls
        over the expert axis, see ``shardkit.nn.moe``).
      zigzag_ranks: ``0``: the rows ``causal_attention`` is given with segment ids may be
        packed and in any order, so the ring reads their masks at run time. ``n > 0``: a
        static promise that every such row is one causal document placed in the zigzag
        order over ``n`` ranks (:mod:`shardkit.balance`, ``Plan.shard_batch``'s
        placement), so the ring computes only the unmasked half blocks, statically.
        ``Model.loss`` sets it from the batch's ``"zigzag"`` entry.
    """

    param_rules: Rules | None = None
    activation_rules: Rules | None = None
    attention: AttentionStrategy = "dense"
    attention_axis: str | tuple[str, str] = "sequence"
    layer_schedule: LayerSchedule = "gspmd"
    precision: Precision = "f32"
    expert_dispatch: ExpertDispatch = "gspmd"
    zigzag_ranks: int = 0

    def __post_init__(self):
        check_precision(self.precision)
        z = self.zigzag_ranks
        if isinstance(z, bool) or not isinstance(z, int) or z < 0:
            raise ShardingError(
                f"zigzag_ranks={self.zigzag_ranks!r}: the number of context ranks the rows "
                "were placed in zigzag order over, or 0 for rows in any order.\nFix: "
                "zigzag_ranks=mesh.shape['sequence'], or 0."
            )
        if self.expert_dispatch not in get_args(ExpertDispatch):
            raise ShardingError(
                f"Unknown expert dispatch {self.expert_dispatch!r}.\nFix: use one of "
                f"{list(get_args(ExpertDispatch))}."
            )
        if self.attention not in get_args(AttentionStrategy):
            raise ShardingError(
                f"Unknown attention strategy {self.attention!r}.\nFix: use one of "
                f"{list(get_args(AttentionStrategy))}."
            )
        pair = not isinstance(self.attention_axis, str)
        if pair != (self.attention == "usp") and not (pair and self.attention == "dense"):
            raise ShardingError(
                f"attention={self.attention!r} over attention_axis={self.attention_axis!r}: "
                "'usp' runs over a pair of axes (ulysses_axis, ring_axis), every other "
                "strategy over one.\nFix: use_attention('usp', axis=('ulysses', 'sequence')) "
                "or use_attention('ring', axis='sequence')."
            )
        if pair and len(tuple(self.attention_axis)) != 2:
            raise ShardingError(
                f"attention_axis={self.attention_axis!r}: 'usp' takes two axes "
                "(ulysses_axis, ring_axis).\nFix: axis=('ulysses', 'sequence')."
            )
        if self.layer_schedule not in get_args(LayerSchedule):
            raise ShardingError(
                f"Unknown layer schedule {self.layer_schedule!r}.\nFix: use one of "
                f"{list(get_args(LayerSchedule))}."
            )


_CURRENT: contextvars.ContextVar[ShardingContext] = contextvars.ContextVar(
    "shardkit_context",
    default=ShardingContext(),  # noqa: B039 (frozen: immutable)
)


def current() -> ShardingContext:
    """The active context (defaults when none was entered)."""
    return _CURRENT.get()


def _as_rules(rules: Rules | Sequence[Any] | None) -> Rules | None:
    if rules is None or isinstance(rules, Rules):
        return rules  # a Rules subclass (recipes.VocabRules) keeps its own resolution
    return Rules(rules)


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[ShardingContext]:
    """The current context with ``changes`` applied, for the duration of a ``with``.

    Rule fields accept ``Rules`` or a plain list of pairs (``None`` clears them).
    """
    for key in ("param_rules", "activation_rules"):
        if key in changes:
            changes[key] = _as_rules(changes[key])
    ctx = dataclasses.replace(current(), **changes)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def compute_dtype() -> Any:
    """The dtype the active plan computes activations in: ``jnp.bfloat16`` under
    ``precision="bf16"``, else ``jnp.float32``.

    The reference models read it; a model of your own reads it too to follow the plan
    (``nn.Dense(..., dtype=sk.compute_dtype())``, ``x.astype(sk.compute_dtype())``):
    a plan casts nothing by itself. Keep parameters in float32 (``param_dtype``) and
    compute the loss in float32.

    Example:
      >>> from shardkit import context
      >>> with context.using(precision="bf16"):
      ...     context.compute_dtype()
      <class 'jax.numpy.bfloat16'>
      >>> context.compute_dtype()
      <class 'jax.numpy.float32'>
    """
    return _DTYPES[current().precision]


def context_axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    """The mesh axes an ``attention_axis`` names, as a tuple.

    Example:
      >>> context_axes("sequence"), context_axes(("ulysses", "sequence"))
      (('sequence',), ('ulysses', 'sequence'))
    """
    return (axis,) if isinstance(axis, str) else tuple(axis)


def active_mesh() -> Any:
    """JAX's active (abstract) mesh, or ``None`` outside ``jax.set_mesh``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh
