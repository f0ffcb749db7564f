"""Named scopes of shardkit's building blocks: how the report tells whose op it is.

Each building block (attention, the loss and its head, TSP's rings, the pipeline's
transfers, per-replica views) runs inside ``jax.named_scope("shardkit.<block>")``. JAX
records the scope path in every op's ``op_name``, XLA keeps it through its passes, and
the report (:mod:`shardkit.report.provenance`) reads the block of each collective from
it, not from the name of a source file. Where a block calls the model's code back (the
head's ``project``), the call runs under :func:`model_code`: what it does is the
model's, not the block's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> @block("demo")
  ... def double(x):
  ...     return x * 2
  >>> hlo = jax.jit(double).lower(jnp.ones(2)).compile().as_text()
  >>> 'op_name="jit(double)/shardkit.demo/mul"' in hlo
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = ["MODEL", "PIPELINE_TICKS", "PREFIX", "block", "model_code", "scope"]

#: Every shardkit scope starts with this (``shardkit.attention.ring``).
PREFIX = "shardkit."
#: The scope a block opens when it calls the model's code back (``shardkit.model``).
MODEL = "model"
#: The rolled pipeline engine's loops over its ticks: what they carry (the residual rings,
#: the gradient sum, the stage's in-flight activations) is named by this scope.
PIPELINE_TICKS = "pipeline.ticks"

F = TypeVar("F", bound=Callable[..., Any])


def scope(name: str) -> Any:
    """``jax.named_scope("shardkit.<name>")``: a context manager."""
    return jax.named_scope(PREFIX + name)


def block(name: str) -> Callable[[F], F]:
    """A decorator running the function inside :func:`scope` ``(name)``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            with scope(name):
                return fn(*args, **kwargs)

        return scoped  # type: ignore[return-value]

    return wrap


def model_code(fn: F) -> F:
    """``fn`` (the model's code, called back by a block) inside the ``model`` scope."""
    return block(MODEL)(fn)
