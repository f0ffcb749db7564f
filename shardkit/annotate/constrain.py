"""``sk.constrain``: pin an activation's sharding by logical axes.

Works inside ``jit`` under Auto meshes (``with_sharding_constraint``) and
Explicit meshes (``reshard``, where Flax's ``with_logical_constraint`` fails an
assertion), outside ``jit`` on arrays of any sharding (``device_put`` onto the active
mesh), and is a no-op when no mesh or no rules are active.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> sk.constrain(jnp.ones((4, 8)), ("batch", "embed")).shape   # no mesh: no-op
  (4, 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType

from shardkit import context, errors
from shardkit.rules import Rules

__all__ = [
    "activation_rules",
    "constrain",
    "constrain_param",
    "current_activation_rules",
    "current_param_rules",
    "is_explicit",
    "param_rules",
]


def current_activation_rules() -> Rules | None:
    """The activation rules of the active sharding context, if any."""
    return context.current().activation_rules


def current_param_rules() -> Rules | None:
    """The parameter rules of the active sharding context, if any."""
    return context.current().param_rules


def activation_rules(rules: Rules | Sequence[Any] | None):
    """Make ``rules`` the ones ``sk.constrain`` resolves with, restoring on exit.

    ``sk.Plan`` enters them (with the rest of the sharding context) around tracing,
    so model code never names rules.
    """
    return context.using(activation_rules=rules)


def param_rules(rules: Rules | Sequence[Any] | None):
    """Make ``rules`` the ones parameters are constrained with where they are used.

    ``sk.Plan`` enters them around tracing. ``@sk.axes`` linen modules then pin
    each sharded parameter they read (inside a layer scan: each layer's slice) to its
    planned sharding, so XLA gathers weights just in time and reduce-scatters
    their gradients instead of all-reducing them (see :func:`constrain_param`).
    """
    return context.using(param_rules=rules)


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
    _check_logical(x, logical)
    return _pin(x, logical, rules, "activation")


def _check_logical(x: Any, logical: Any) -> None:
    """``logical`` names each dimension of ``x`` once (a str or ``None``)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise errors.ArgumentTypeError(
            f"sk.constrain takes an array, got {type(x).__name__} {x!r}."
        )
    if not isinstance(logical, (tuple, list)) or not all(
        a is None or (isinstance(a, str) and a) for a in logical
    ):
        fix = f"({logical!r},)" if isinstance(logical, str) else "('batch', 'embed')"
        raise errors.ArgumentTypeError(
            f"sk.constrain: logical axes are a tuple with one name (or None) per dimension, "
            f"got {logical!r}.\nFix: e.g. {fix}."
        )
    if len(logical) != len(shape):
        raise errors.RankMismatchError(
            f"sk.constrain: an array of shape {tuple(shape)} needs {len(shape)} logical axes, "
            f"got {len(logical)}: {tuple(logical)}.\nFix: one name (or None) per dimension."
        )


def constrain_param(
    x: jax.Array, logical: Sequence[str | None], *, path: Any = "param"
) -> jax.Array:
    """``constrain`` with the active ``param_rules`` (a no-op without them).

    Inside ``jit`` on Auto axes (the reference models' layers run on Auto axes under an
    Explicit mesh too), a parameter whose planned layout is replicated is left as read:
    the step's arguments already place it there, so the pin would gather nothing and
    shard no gradient, and inside a layer scan without remat the forward would save its
    output, a second copy of the layer's weights, for the backward.
    """
    return _pin(x, logical, current_param_rules(), path, skip_replicated=True)


def is_explicit(mesh: Any) -> bool:
    """True when every axis of ``mesh`` is ``AxisType.Explicit``."""
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def _pin(
    x: jax.Array,
    logical: Sequence[str | None],
    rules: Rules | None,
    path: Any,
    skip_replicated: bool = False,
) -> jax.Array:
    mesh = context.active_mesh()
    if rules is None or mesh is None:
        return x
    spec = rules.spec(tuple(logical), shape=x.shape, mesh=mesh, path=path)
    traced = isinstance(x, jax.core.Tracer)
    if skip_replicated and traced and not is_explicit(mesh) and all(not s for s in spec):
        return x  # a replicated parameter on Auto axes: see constrain_param
    if not traced:
        return _place(x, spec, path)  # an eager array: its sharding may be of any kind
    if is_explicit(mesh):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _place(x: Any, spec: Any, path: Any) -> jax.Array:
    """Outside ``jit``, put ``x`` (on the host, on one device, or on another mesh) in
    ``spec``."""
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        where = getattr(x, "sharding", "none: a host array")
        raise errors.ShardingError(
            f"sk.constrain ({path}): an array outside jit, of shape {tuple(x.shape)} with "
            f"sharding {where}, under an abstract mesh only "
            f"({dict(context.active_mesh().shape)}): there are no devices to place it on.\n"
            "Fix: call it inside jax.jit (plan.jit), or under jax.set_mesh(mesh) with a "
            "concrete Mesh."
        )
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
