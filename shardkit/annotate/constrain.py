"""``sk.constrain``: pin an activation's sharding by logical axes.

Works inside ``jit`` under Auto meshes (``with_sharding_constraint``) and
Explicit meshes (``reshard``, where Flax's ``with_logical_constraint`` fails an
assertion), and is a no-op when no mesh or no rules are active.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> sk.constrain(jnp.ones((4, 8)), ("batch", "embed")).shape   # no mesh: no-op
  (4, 8)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AxisType

from shardkit.rules import Rules

__all__ = [
    "activation_rules",
    "constrain",
    "constrain_param",
    "current_activation_rules",
    "current_param_rules",
    "param_rules",
]

_STATE = threading.local()


def _stack(kind: str) -> list[Rules | None]:
    stack = getattr(_STATE, kind, None)
    if stack is None:
        stack = []
        setattr(_STATE, kind, stack)
    return stack


@contextlib.contextmanager
def _using(kind: str, rules: Rules | Sequence[Any] | None) -> Iterator[None]:
    stack = _stack(kind)
    stack.append(None if rules is None else Rules(rules))
    try:
        yield
    finally:
        stack.pop()


def current_activation_rules() -> Rules | None:
    """The rules set by the innermost ``activation_rules`` context, if any."""
    stack = _stack("activations")
    return stack[-1] if stack else None


def current_param_rules() -> Rules | None:
    """The rules set by the innermost ``param_rules`` context, if any."""
    stack = _stack("params")
    return stack[-1] if stack else None


def activation_rules(rules: Rules | Sequence[Any] | None):
    """Make ``rules`` the ones ``sk.constrain`` resolves with, restoring on exit.

    ``sk.Plan`` enters this around tracing, so model code never names rules.
    """
    return _using("activations", rules)


def param_rules(rules: Rules | Sequence[Any] | None):
    """Make ``rules`` the ones parameters are constrained with where they are used.

    ``sk.Plan`` enters this around tracing. ``@sk.axes`` linen modules then pin
    each parameter they read (inside a layer scan: each layer's slice) to its
    planned sharding, so XLA gathers weights just in time and reduce-scatters
    their gradients instead of all-reducing them.
    """
    return _using("params", rules)


def _active_mesh() -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh


def constrain(
    x: jax.Array, logical: Sequence[str | None], *, rules: Rules | Sequence[Any] | None = None
) -> jax.Array:
    """Constrain ``x`` to the sharding its logical axes map to.

    Args:
      x: an array (usually an activation inside a jitted step).
      logical: one logical name or ``None`` per dimension of ``x``.
      rules: rules to resolve with; default: the active ``activation_rules``.

    Returns:
      ``x`` with a sharding constraint (Auto axes) or resharded (Explicit axes);
      ``x`` unchanged when no mesh or no rules are active.
    """
    rules = Rules(rules) if rules is not None else current_activation_rules()
    return _pin(x, logical, rules, "activation")


def constrain_param(
    x: jax.Array, logical: Sequence[str | None], *, path: Any = "param"
) -> jax.Array:
    """``constrain`` with the active ``param_rules`` (a no-op without them)."""
    return _pin(x, logical, current_param_rules(), path)


def is_explicit(mesh: Any) -> bool:
    """True when every axis of ``mesh`` is ``AxisType.Explicit``."""
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def _pin(x: jax.Array, logical: Sequence[str | None], rules: Rules | None, path: Any) -> jax.Array:
    mesh = _active_mesh()
    if rules is None or mesh is None:
        return x
    spec = rules.spec(tuple(logical), shape=x.shape, mesh=mesh, path=path)
    if is_explicit(mesh):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)
