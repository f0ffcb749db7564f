"""Multi-head latent attention (MLA, DeepSeek-V2) and its two tensor-parallel layouts.

Keys and values come from one low-rank latent shared by all heads, ``c_kv = norm(x·W_dkv)``
of rank ``d_c`` (``kv_latent``): ``k_nope = c_kv·W_uk`` and ``v = c_kv·W_uv`` per head.
Position enters through a decoupled RoPE part: a small per-head rope query of width
``d_rope`` and one rope key ``RoPE(x·W_kr)`` shared by every head; q and k are the
concatenations ``[nope; rope]`` (``d_nope + d_rope`` wide, scores scaled by its root).
Queries optionally pass through a latent of their own (``q_latent``: ``c_q = norm(x·W_dq)``,
``q = c_q·W_uq``). What a decoder caches per token is ``c_kv`` and the rope key, not
``2·h·d_head`` keys and values.

The weights carry logical axes (:data:`MLA_AXES`): the latents ``kv_latent`` and
``q_latent``, the heads ``heads``, the per-head widths ``kv``. Two layouts follow from the
rules:

- **heads over ``tensor``, latent replicated** (``tp``: ``kv_latent`` has no rule): every
  device computes and keeps the whole latent ``[batch, seq, d_c]``; the up-projections
  are column-parallel over heads.
- **latent over ``tensor``** (``tp_latent``: ``("kv_latent", "tensor")``, and
  ``q_latent`` likewise): W_dkv is column-parallel over the latent, so each device keeps
  ``d_c / t`` of it; the up-projections contract the split latent (a reduce-scatter onto
  the heads, which attention keeps split over ``tensor``). The latent per device is
  ``1/t`` of the first layout's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from shardkit.nn.rope import rope_tables
  >>> spec = MlaSpec(n_heads=4, kv_latent=16, nope_dim=8, rope_dim=4, v_dim=8)
  >>> w = init_weights(jax.random.key(0), spec, d_model=32)
  >>> out, latent = mla_attention(jnp.ones((2, 6, 32)), w, spec, *rope_tables(6, 4))
  >>> out.shape, latent.shape
  ((2, 6, 32), (2, 6, 16))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from shardkit import context
from shardkit.annotate import axes, constrain
from shardkit.errors import ShardingError
from shardkit.nn.attention import causal_attention
from shardkit.nn.rope import apply_rope
from shardkit.nn.segments import Segments
from shardkit.rules import Rules

__all__ = [
    "KV_LATENT",
    "MLA_AXES",
    "LinenMla",
    "MlaSpec",
    "NnxMla",
    "check_layout",
    "init_weights",
    "mla_attention",
]

#: Logical axes of the weights (a leading ``layers`` is added under a scan).
MLA_AXES: dict[str, tuple[str | None, ...]] = {
    "wq": ("embed", "heads", "kv"),
    "wq_a": ("embed", "q_latent"),
    "q_norm": ("q_latent",),
    "wq_b": ("q_latent", "heads", "kv"),
    "wkv_a": ("embed", "kv_latent"),
    "kv_norm": ("kv_latent",),
    "wk_rope": ("embed", "kv"),
    "wk_b": ("kv_latent", "heads", "kv"),
    "wv_b": ("kv_latent", "heads", "kv"),
    "wo": ("heads", "kv", "embed"),
}
#: The K/V latent activation ``[batch, seq, d_c]``; the query latent's.
KV_LATENT = ("batch", "length", "kv_latent")
Q_LATENT = ("batch", "length", "q_latent")
_HEADS = ("batch", "length", "heads", "kv")
INIT_STD = 0.02
NORM_EPS = 1e-6


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """The shape of a multi-head latent attention.

    Attributes:
      n_heads: attention heads ``h``.
      kv_latent: rank ``d_c`` of the K/V latent.
      nope_dim: per-head width of the query/key part without position (``d_nope``).
      rope_dim: width ``d_rope`` of the rope part (per-head query, shared key); even.
      v_dim: per-head width of the values (``≤ nope_dim + rope_dim``).
      q_latent: rank of the query latent; 0: queries straight from ``x``.

    Raises:
      ShardingError: a size that is not a positive int, an odd ``rope_dim``, or values
        wider than the queries.

    Example:
      >>> MlaSpec(n_heads=8, kv_latent=32, nope_dim=8, rope_dim=4, v_dim=8).qk_dim
      12
      >>> MlaSpec(n_heads=8, kv_latent=32, nope_dim=8, rope_dim=3, v_dim=8)
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: MlaSpec(rope_dim=3): RoPE rotates pairs, so rope_dim is even.
      Fix: pass rope_dim=4 (or 2).
    """

    n_heads: int
    kv_latent: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    q_latent: int = 0

    def __post_init__(self) -> None:
        for field in ("n_heads", "kv_latent", "nope_dim", "rope_dim", "v_dim"):
            if not _positive(getattr(self, field)):
                raise ShardingError(
                    f"MlaSpec({field}={getattr(self, field)!r}): {field} must be a positive "
                    f"int.\nFix: pass {field} as a positive integer."
                )
        if not (_positive(self.q_latent) or self.q_latent == 0) or isinstance(self.q_latent, bool):
            raise ShardingError(
                f"MlaSpec(q_latent={self.q_latent!r}): the query latent's rank is a positive "
                "int, or 0 (queries straight from x).\nFix: pass q_latent=0 or a rank."
            )
        if self.rope_dim % 2:
            raise ShardingError(
                f"MlaSpec(rope_dim={self.rope_dim}): RoPE rotates pairs, so rope_dim is even.\n"
                f"Fix: pass rope_dim={self.rope_dim + 1} (or {self.rope_dim - 1})."
            )
        if self.v_dim > self.qk_dim:
            raise ShardingError(
                f"MlaSpec(v_dim={self.v_dim}): values wider than the queries and keys "
                f"(nope_dim + rope_dim = {self.qk_dim}) are not supported.\nFix: pass "
                f"v_dim ≤ {self.qk_dim}."
            )

    @property
    def qk_dim(self) -> int:
        """Per-head width of q and k: ``nope_dim + rope_dim``."""
        return self.nope_dim + self.rope_dim

    def shapes(self, d_model: int) -> dict[str, tuple[int, ...]]:
        """The weights' shapes for a model of width ``d_model``.

        Example:
          >>> MlaSpec(2, 8, 4, 2, 4).shapes(16)["wk_b"]
          (8, 2, 4)
        """
        h, c = self.n_heads, self.kv_latent
        out: dict[str, tuple[int, ...]] = {}
        if self.q_latent:
            out.update(
                wq_a=(d_model, self.q_latent),
                q_norm=(self.q_latent,),
                wq_b=(self.q_latent, h, self.qk_dim),
            )
        else:
            out["wq"] = (d_model, h, self.qk_dim)
        out.update(
            wkv_a=(d_model, c),
            kv_norm=(c,),
            wk_rope=(d_model, self.rope_dim),
            wk_b=(c, h, self.nope_dim),
            wv_b=(c, h, self.v_dim),
            wo=(h, self.v_dim, d_model),
        )
        return out

    def param_count(self, d_model: int) -> int:
        """Parameters of one attention (the norms' scales included).

        Example:
          >>> MlaSpec(2, 8, 4, 2, 4).param_count(16)  # 16·2·6 + 16·8 + 8 + 16·2 + 2·(8·2·4) + 2·4·16
          616
        """
        return sum(math.prod(s) for s in self.shapes(d_model).values())


def _axis_size(entry: Any, mesh: Mesh) -> tuple[tuple[str, ...], int]:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return names, math.prod(int(mesh.shape[a]) for a in names)


def check_layout(spec: MlaSpec, mesh: Mesh | None, rules: Rules | None) -> None:
    """Raise if ``rules`` on ``mesh`` split the latents or the heads unevenly.

    The latent-split layout needs ``d_c`` (and the query latent) divisible by the mesh axes
    ``kv_latent`` is on; the heads layout needs the heads divisible by those of ``heads``.

    Raises:
      ShardingError: naming the size, the mesh axes and their sizes, and a fix.

    Example:
      >>> import shardkit as sk
      >>> mesh = jax.sharding.AbstractMesh((4,), ("tensor",))
      >>> check_layout(MlaSpec(8, 6, 8, 4, 8), mesh, sk.Rules([("kv_latent", "tensor")]))
      Traceback (most recent call last):
      ...
      shardkit.errors.ShardingError: MLA: the K/V latent rank 6 does not divide over ('tensor',) (4 devices; mesh {'tensor': 4}) under the latent-split layout ('kv_latent' -> ('tensor',)).
      Fix: a kv_latent rank that is a multiple of 4 (8), or the heads layout (no 'kv_latent' rule: the tp recipe).
    """
    if mesh is None or rules is None:
        return
    sizes = {a: int(mesh.shape[a]) for a in mesh.axis_names}
    # One name at a time: in one spec, a mesh axis the latent took is not the heads' too.
    latent, q_latent, heads = (
        _axis_size((*rules.spec((name,), mesh=mesh), None)[0], mesh)
        for name in ("kv_latent", "q_latent", "heads")
    )
    checks = [("the K/V latent rank", "kv_latent", spec.kv_latent, latent)]
    if spec.q_latent:
        checks.append(("the query latent rank", "q_latent", spec.q_latent, q_latent))
    for what, name, size, (names, n) in checks:
        if size % n:
            raise ShardingError(
                f"MLA: {what} {size} does not divide over {names} ({n} devices; mesh {sizes}) "
                f"under the latent-split layout ({name!r} -> {names}).\nFix: a {name} rank that "
                f"is a multiple of {n} ({-(-size // n) * n}), or the heads layout (no "
                f"{name!r} rule: the tp recipe)."
            )
    names, n = heads
    if spec.n_heads % n:
        layout = "heads" if latent[1] == 1 else "latent-split"
        raise ShardingError(
            f"MLA: {spec.n_heads} heads do not divide over {names} ({n} devices; mesh {sizes}) "
            f"under the {layout} layout ('heads' -> {names}: attention runs h/{n} heads a "
            f"device).\nFix: a head count that is a multiple of {n}, or a smaller {names[0]!r} "
            f"axis (one dividing {spec.n_heads})."
        )


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + NORM_EPS)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def mla_attention(
    x: jax.Array,
    w: dict[str, jax.Array],
    spec: MlaSpec,
    cos: jax.Array,
    sin: jax.Array,
    segments: Segments | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal MLA of ``x[batch, seq, d_model]``: ``(output [batch, seq, d_model], c_kv)``.

    ``cos``/``sin``: RoPE tables of width ``rope_dim`` (:func:`shardkit.nn.rope.rope_tables`);
    ``c_kv`` is the normalised K/V latent ``[batch, seq, kv_latent]``, what a decoder
    caches. Attention is :func:`~shardkit.nn.attention.causal_attention` (any strategy;
    the values are zero-padded to the queries' width when narrower).

    Raises:
      ShardingError: the active rules split a latent or the heads unevenly
        (:func:`check_layout`).
    """
    ctx = context.current()
    check_layout(spec, context.active_mesh(), ctx.param_rules)
    dtype = x.dtype
    weights = {k: v.astype(dtype) for k, v in w.items()}
    if spec.q_latent:
        cq = constrain(jnp.einsum("bsd,dc->bsc", x, weights["wq_a"]), Q_LATENT)
        cq = constrain(_rms(cq, w["q_norm"]), Q_LATENT)
        q = jnp.einsum("bsc,chk->bshk", cq, weights["wq_b"])
    else:
        q = jnp.einsum("bsd,dhk->bshk", x, weights["wq"])
    q = constrain(q, _HEADS)
    q = jnp.concatenate(
        [q[..., : spec.nope_dim], apply_rope(q[..., spec.nope_dim :], cos, sin)], axis=-1
    )
    ckv = constrain(jnp.einsum("bsd,dc->bsc", x, weights["wkv_a"]), KV_LATENT)
    ckv = constrain(_rms(ckv, w["kv_norm"]), KV_LATENT)
    k_rope = apply_rope(jnp.einsum("bsd,dr->bsr", x, weights["wk_rope"])[:, :, None], cos, sin)
    k_nope = constrain(jnp.einsum("bsc,chk->bshk", ckv, weights["wk_b"]), _HEADS)
    v = constrain(jnp.einsum("bsc,chk->bshk", ckv, weights["wv_b"]), _HEADS)
    k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], spec.rope_dim))
    k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), _HEADS)
    pad = spec.qk_dim - spec.v_dim
    if pad:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad)))
    o = causal_attention(q, k, constrain(v, _HEADS), segments=segments)[..., : spec.v_dim]
    out = jnp.einsum("bshk,hkd->bsd", constrain(o, _HEADS), weights["wo"])
    return out, ckv


def init_weights(rng: jax.Array, spec: MlaSpec, d_model: int, dtype: Any = jnp.float32) -> dict:
    """Plain (unannotated) weights for :func:`mla_attention`: normal(0.02), norms at 1.

    Example:
      >>> w = init_weights(jax.random.key(0), MlaSpec(2, 8, 4, 2, 4), d_model=16)
      >>> w["wkv_a"].shape, float(w["kv_norm"][0])
      ((16, 8), 1.0)
    """
    shapes = spec.shapes(d_model)
    keys = jax.random.split(rng, len(shapes))
    return {
        name: jnp.ones(shape, dtype)
        if name.endswith("_norm")
        else INIT_STD * jax.random.normal(key, shape, dtype)
        for key, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def _init(name: str, normal: Any) -> Any:
    return nn.initializers.ones if name.endswith("_norm") else normal


class LinenMla(nn.Module):
    """MLA as a linen module: ``(out, c_kv) = LinenMla(spec)(x, cos, sin)``.

    Example:
      >>> import shardkit as sk
      >>> from shardkit.nn.rope import rope_tables
      >>> m = LinenMla(MlaSpec(2, 8, 4, 2, 4))
      >>> params = m.init(jax.random.key(0), jnp.ones((1, 4, 16)), *rope_tables(4, 2))["params"]
      >>> sk.logical_axes(params)["wkv_a"]
      ('embed', 'kv_latent')
    """

    spec: MlaSpec
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments=None):
        normal = nn.initializers.normal(INIT_STD)
        weights = {
            name: self.param(
                name,
                nn.with_logical_partitioning(_init(name, normal), MLA_AXES[name]),
                shape,
                self.param_dtype,
            )
            for name, shape in self.spec.shapes(x.shape[-1]).items()
        }
        dtype = self.dtype or context.compute_dtype()
        return mla_attention(x.astype(dtype), weights, self.spec, cos, sin, segments)


@axes({rf"^{name}$": names for name, names in MLA_AXES.items()})
class NnxMla(nnx.Module):
    """MLA as an NNX module: ``(out, c_kv) = NnxMla(spec, d_model, rngs=...)(x, cos, sin)``.

    Example:
      >>> with nnx.use_eager_sharding(False):
      ...     m = nnx.eval_shape(lambda: NnxMla(MlaSpec(2, 8, 4, 2, 4), 16, rngs=nnx.Rngs(0)))
      >>> m.wk_b.shape, m.wk_b.out_sharding
      ((8, 2, 4), ('kv_latent', 'heads', 'kv'))
    """

    def __init__(
        self,
        spec: MlaSpec,
        d_model: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.spec, self.dtype = spec, dtype
        normal = nnx.initializers.normal(INIT_STD)
        for name, shape in spec.shapes(d_model).items():
            init = nnx.initializers.ones if name.endswith("_norm") else normal
            setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments=None):
        weights = {name: getattr(self, name)[...] for name in self.spec.shapes(x.shape[-1])}
        dtype = self.dtype or context.compute_dtype()
        return mla_attention(x.astype(dtype), weights, self.spec, cos, sin, segments)
