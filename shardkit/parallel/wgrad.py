"""A layer's backward split into its input gradient (B) and its weight gradient (W).

Zero-bubble schedules (Qi et al. 2023) run a layer's backward in two parts: ``B``, the
gradient with respect to the layer's input, which the previous stage waits for, and ``W``,
the gradient with respect to its weights, which nothing waits for and so can run later,
in a tick where the stage would otherwise idle. ``jax.vjp`` gives both at once; this
module cuts the vjp's program (its jaxpr, with nested ``jit`` and ``checkpoint`` calls
inlined) in two: ``B`` is every equation the input gradient depends on, ``W`` every other
equation the weight gradient depends on. What ``W`` reads from ``B`` (the *frontier*: for
a matmul ``y = x @ w``, the cotangent of ``y``, and ``x``, from which ``W`` computes
``xᵀ·dy``) is returned by ``B`` and kept until ``W`` runs; nothing is computed twice, and
where the forward stored its residuals can be reused once ``B`` has run.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda w, x: jnp.tanh(x @ w[0])   # the weights as a list, as the engine has them
  >>> w, x = [jnp.ones((4, 4)) / 4], jnp.ones((2, 4))
  >>> y, vjp = jax.vjp(f, w, x)
  >>> res, tdef = jax.tree.flatten(vjp)
  >>> split = split_backward(lambda r, g: jax.tree.unflatten(tdef, r)(g), res, y, n_w=1)
  >>> d_x, frontier = split.b(res, jnp.ones_like(y))
  >>> (d_w,) = split.w(res, frontier)
  >>> (want_w,), want_x = vjp(jnp.ones_like(y))
  >>> bool(jnp.allclose(d_x, want_x)), bool(jnp.allclose(d_w, want_w)), len(frontier)
  (True, True, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

__all__ = ["Split", "split_backward"]

#: Call primitives whose body is inlined before the cut (so a layer's backward in one
#: ``jit`` or ``checkpoint`` is still cut per equation).
_INLINE = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2"}


class _Ref:
    """One value of the flattened program (an input, a constant or an equation's output)."""

    __slots__ = ("aval", "const")

    def __init__(self, aval: Any, const: Any = None):
        self.aval, self.const = aval, const


@dataclasses.dataclass
class _Node:
    eqn: Any
    ins: list[Any]  # _Ref, or ("lit", value)
    outs: list[_Ref]


def _flatten(jaxpr: Any, consts: Sequence[Any], ins: list[Any], nodes: list[_Node]) -> list[Any]:
    env: dict[Any, Any] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = _Ref(v.aval, const=c)
    for v, r in zip(jaxpr.invars, ins, strict=True):
        env[v] = r

    def read(a: Any) -> Any:
        return ("lit", a.val) if isinstance(a, Literal) else env[a]

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINE and "jaxpr" in eqn.params:
            sub = eqn.params["jaxpr"]
            if hasattr(sub, "consts"):  # a ClosedJaxpr
                outs = _flatten(sub.jaxpr, sub.consts, args, nodes)
            else:
                outs = _flatten(sub, [], args, nodes)
        else:
            outs = [_Ref(v.aval) for v in eqn.outvars]
            nodes.append(_Node(eqn, args, outs))
        for v, r in zip(eqn.outvars, outs, strict=True):
            env[v] = r
    return [read(a) for a in jaxpr.outvars]


def _run(nodes: list[_Node], env: dict[_Ref, Any]) -> None:
    def value(a: Any) -> Any:
        if isinstance(a, tuple):
            return a[1]
        return a.const if a.const is not None else env[a]

    for node in nodes:
        eqn = node.eqn
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*[value(a) for a in node.ins], **params)
        out = out if eqn.primitive.multiple_results else [out]
        for r, x in zip(node.outs, out, strict=True):
            env[r] = x


@dataclasses.dataclass(frozen=True)
class Split:
    """A backward cut in two.

    Attributes:
      b: ``(residuals, g) -> (d_x, frontier)``: the input gradient, and the values ``W``
        needs that only ``B`` computes.
      w: ``(residuals, frontier) -> [d_w, ...]``: the weight gradient (it reads only the
        residuals marked ``direct``).
      frontier: the frontier's shapes and dtypes (``jax.ShapeDtypeStruct`` each).
      b_equations, w_equations: how many equations each part runs.
    """

    b: Callable[..., tuple[Any, list[Any]]]
    w: Callable[..., list[Any]]
    frontier: tuple[jax.ShapeDtypeStruct, ...]
    b_equations: int
    w_equations: int


def split_backward(
    bwd: Callable[..., Any],
    residuals: Sequence[Any],
    g: Any,
    *,
    n_w: int,
    direct: Sequence[bool] | None = None,
) -> Split:
    """Cut ``bwd(residuals, g) -> (d_w, d_x)`` (``d_w`` a list of ``n_w`` arrays, ``d_x``
    one array) into ``B`` and ``W`` (see :class:`Split`); traced once, abstractly.

    ``direct[i]``: ``W`` may read residual ``i`` itself when it runs (a weight, which stays
    in memory anyway); the others it reads (and the output cotangent ``g``) are in the
    frontier, so nothing ``W`` needs is read from where the forward stored it: that can be
    overwritten once ``B`` has run. Default: every residual direct.

    Example:
      >>> import jax.numpy as jnp
      >>> bwd = lambda r, g: ([r[0].T @ g], g @ r[1].T)   # y = x @ w: r = (x, w)
      >>> s = split_backward(bwd, [jnp.ones((2, 3)), jnp.ones((3, 3))], jnp.ones((2, 3)), n_w=1,
      ...                    direct=[False, True])
      >>> [tuple(f.shape) for f in s.frontier], s.b_equations, s.w_equations   # x and g
      ([(2, 3), (2, 3)], 2, 2)
    """
    spec = lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype)  # noqa: E731
    res_s = [spec(r) for r in residuals]
    direct = [True] * len(res_s) if direct is None else list(direct)
    closed = jax.make_jaxpr(lambda r, gg: _pack(bwd(r, gg)))(res_s, spec(g))
    nodes: list[_Node] = []
    in_refs = [_Ref(v.aval) for v in closed.jaxpr.invars]
    outs = _flatten(closed.jaxpr, closed.consts, in_refs, nodes)
    d_w_refs, d_x_ref = outs[:n_w], outs[n_w]
    res_refs, g_ref = in_refs[:-1], in_refs[-1]
    producer = {id(r): n for n, node in enumerate(nodes) for r in node.outs}

    def ancestors(roots: list[Any]) -> set[int]:
        seen: set[int] = set()
        stack = [producer[id(r)] for r in roots if not isinstance(r, tuple) and id(r) in producer]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for a in nodes[n].ins:
                if not isinstance(a, tuple) and id(a) in producer:
                    stack.append(producer[id(a)])
        return seen

    in_b = ancestors([d_x_ref])
    in_w = ancestors(d_w_refs) - in_b
    b_nodes = [nodes[n] for n in sorted(in_b)]
    w_nodes = [nodes[n] for n in sorted(in_w)]
    # What W reads that it does not compute, is not a constant and may not read directly
    # (B's outputs, the stored residuals, g): the frontier, which B hands over.
    w_outs = {id(r) for node in w_nodes for r in node.outs}
    free = {id(r) for r, d in zip(res_refs, direct, strict=True) if d}
    wanted: dict[int, _Ref] = {}
    for a in [x for node in w_nodes for x in node.ins] + list(d_w_refs):
        if isinstance(a, tuple) or a.const is not None or id(a) in w_outs or id(a) in free:
            continue
        wanted.setdefault(id(a), a)
    frontier = list(wanted.values())

    def b(res: Sequence[Any], gv: Any) -> tuple[Any, list[Any]]:
        env = dict(zip(res_refs, res, strict=True))
        env[g_ref] = gv
        _run(b_nodes, env)
        return _value(d_x_ref, env), [env[r] for r in frontier]

    def w(res: Sequence[Any], front: Sequence[Any]) -> list[Any]:
        env = {r: x for r, x, d in zip(res_refs, res, direct, strict=True) if d}
        env.update(zip(frontier, front, strict=True))
        _run(w_nodes, env)
        return [_value(r, env) for r in d_w_refs]

    shapes = tuple(jax.ShapeDtypeStruct(r.aval.shape, r.aval.dtype) for r in frontier)
    return Split(b, w, shapes, len(b_nodes), len(w_nodes))


def _pack(out: Any) -> list[Any]:
    d_w, d_x = out
    return [*d_w, d_x]


def _value(a: Any, env: dict[_Ref, Any]) -> Any:
    if isinstance(a, tuple):
        return a[1]
    return a.const if a.const is not None else env[a]
