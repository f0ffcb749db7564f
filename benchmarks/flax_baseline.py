"""The hand-written Flax path shardkit is measured against.

What a JAX/Flax user writes today to shard GPT-2 without shardkit, following the Flax
and MaxText documentation:

- a linen GPT-2 with the same shapes as ``shardkit.models.gpt`` (tied token embedding,
  learned positions, pre-LayerNorm blocks, fused q/k/v projection, GELU MLP, biases
  everywhere), every parameter annotated with ``nn.with_logical_partitioning``;
- **unrolled** layers (a Python loop, no ``nn.scan``), each block under ``nn.remat``
  (full recompute, as ``remat="full"`` in shardkit);
- MaxText-style rule lists per layout, applied with Flax's own ``nn.logical_axis_rules``;
  activations constrained with ``nn.with_logical_constraint`` on the residual stream, the
  MLP hidden units, the heads and the logits;
- state shardings derived the Flax way: ``nn.get_partition_spec`` of ``jax.eval_shape`` of
  the init (optax's moments inherit the parameters' boxes), then
  ``nn.logical_to_mesh_sharding``;
- ``jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=0)`` compiled under
  the legacy ``with mesh:`` context, with shardkit's optimizer (``shardkit.train.adamw()``)
  and the loss every Flax example writes (optax's integer-label cross-entropy, f32, mean).

Activation constraints and the legacy mesh context (measured, flax 0.12.8, jax 0.10.2):
``nn.with_logical_constraint`` without ``mesh=`` looks for the mesh with
``jax.sharding.get_abstract_mesh()``, which the legacy ``with mesh:`` does not set, so
every activation constraint is **silently a no-op** and GSPMD propagates shardings from
the parameters alone. ``jax.set_mesh`` would set it, but under ``jax.set_mesh`` the boxed
``nn.DenseGeneral`` kernels fail (see :class:`Attention`). ``compile_baseline`` therefore
has two variants: ``pin_activations=False`` (default), the code as written, constraints
dropped; ``pin_activations=True``, the same code with ``mesh=`` passed explicitly to
each constraint, so they take effect (what a user who found the no-op would do).

The compiled program is measured with shardkit's own functions (``memory_per_device``,
``parse_collectives``, ``wire_bytes_by_kind``), so both sides are measured identically.

Example (8 emulated devices, set up before JAX starts)::

    compiled = compile_baseline(CONFIGS["gpt-tiny"], "fsdp", jax.devices(), batch=8, seq=64)
    total, state, wire, by_kind = measure(compiled)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from shardkit import train
from shardkit.models.config import ModelConfig
from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind
from shardkit.report.memory import memory_per_device

__all__ = ["LAYOUTS", "GPT", "compile_baseline", "mesh_for", "measure", "param_count"]

#: Per layout: mesh axes (one may be -1: the remaining devices) and the MaxText-style rule
#: list (first matching rule whose mesh axis is still free wins: with ``batch`` listed
#: first, FSDP activations keep ``embed`` whole while parameters shard it).
LAYOUTS: dict[str, tuple[dict[str, int], list[tuple[str, Any]]]] = {
    "dp": ({"data": -1}, [("batch", "data")]),
    "fsdp": ({"fsdp": -1}, [("batch", "fsdp"), ("embed", "fsdp")]),
    "tp": (
        {"data": 1, "tensor": -1},
        [("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")],
    ),
    "tp_sp": (  # Megatron sequence parallelism: ``length`` on tensor where heads/mlp are not
        {"data": 1, "tensor": -1},
        [
            ("batch", "data"),
            ("heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
            ("length", "tensor"),
        ],
    ),
    "dp_fsdp": ({"data": 2, "fsdp": -1}, [("batch", ("data", "fsdp")), ("embed", "fsdp")]),
    "fsdp_tp": (
        {"fsdp": -1, "tensor": 4},
        [
            ("batch", "fsdp"),
            ("embed", "fsdp"),
            ("heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
        ],
    ),
}

INIT_STD = 0.02
LN_EPS = 1e-5


def _init(init: Any, names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(init, names)


def _normal(std: float) -> Any:
    return nn.initializers.normal(std)


class Attention(nn.Module):
    config: ModelConfig
    mesh: Mesh | None = None

    def _pin(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        return nn.with_logical_constraint(x, names, mesh=self.mesh)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        heads = ("batch", "length", "heads", "kv")
        # nn.DenseGeneral with a logically partitioned kernel fails under jax.set_mesh in
        # flax 0.12.8 (the kernel is created flat, then reshaped, and the box's constraint
        # hits the flat shape); it works under the legacy ``with mesh:`` used here.
        qkv = nn.DenseGeneral(
            (3, cfg.n_heads, cfg.head_dim),
            kernel_init=_init(_normal(INIT_STD), ("embed", None, "heads", "kv")),
            bias_init=_init(nn.initializers.zeros, (None, "heads", "kv")),
            name="qkv",
        )(x)
        q, k, v = (self._pin(qkv[:, :, i], heads) for i in range(3))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
        pos = jnp.arange(x.shape[1])
        scores = jnp.where(pos[:, None] >= pos[None, :], scores, jnp.finfo(jnp.float32).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        y = self._pin(y, heads)
        return nn.DenseGeneral(
            cfg.d_model,
            axis=(-2, -1),
            kernel_init=_init(
                _normal(INIT_STD / math.sqrt(2 * cfg.n_layers)), ("heads", "kv", "embed")
            ),
            bias_init=_init(nn.initializers.zeros, ("embed",)),
            name="out",
        )(y)


class Block(nn.Module):
    config: ModelConfig
    mesh: Mesh | None = None

    def _pin(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        return nn.with_logical_constraint(x, names, mesh=self.mesh)

    def _norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(
            epsilon=LN_EPS,
            scale_init=_init(nn.initializers.ones, ("embed",)),
            bias_init=_init(nn.initializers.zeros, ("embed",)),
            name=name,
        )

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        residual = ("batch", "length", "embed")
        x = self._pin(x, residual)
        x = x + Attention(cfg, self.mesh, name="attn")(self._norm("ln_1")(x))
        x = self._pin(x, residual)
        h = nn.Dense(
            cfg.d_ff,
            kernel_init=_init(_normal(INIT_STD), ("embed", "mlp")),
            bias_init=_init(nn.initializers.zeros, ("mlp",)),
            name="up",
        )(self._norm("ln_2")(x))
        h = self._pin(nn.gelu(h), ("batch", "length", "mlp"))
        x = x + nn.Dense(
            cfg.d_model,
            kernel_init=_init(_normal(INIT_STD / math.sqrt(2 * cfg.n_layers)), ("mlp", "embed")),
            bias_init=_init(nn.initializers.zeros, ("embed",)),
            name="down",
        )(h)
        return self._pin(x, residual)


class GPT(nn.Module):
    """GPT-2, the shapes (and parameter count) of ``shardkit.models.gpt.GPT``."""

    config: ModelConfig
    mesh: Mesh | None = None  # passed to the activation constraints; None: read the context

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        wte = nn.Embed(
            cfg.vocab,
            cfg.d_model,
            embedding_init=_init(_normal(INIT_STD), ("vocab", "embed")),
            name="wte",
        )
        wpe = nn.Embed(
            cfg.max_seq,
            cfg.d_model,
            embedding_init=_init(_normal(INIT_STD / 2), (None, "embed")),
            name="wpe",
        )
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[-1])[None, :])
        block = nn.remat(Block)  # full recompute of each block in the backward pass
        for i in range(cfg.n_layers):  # unrolled: no nn.scan
            x = block(cfg, self.mesh, name=f"layers_{i}")(x)
        x = nn.LayerNorm(
            epsilon=LN_EPS,
            scale_init=_init(nn.initializers.ones, ("embed",)),
            bias_init=_init(nn.initializers.zeros, ("embed",)),
            name="ln_f",
        )(x)
        logits = wte.attend(x).astype(jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"), mesh=self.mesh)


def mesh_for(layout: str, devices: Sequence[jax.Device]) -> Mesh:
    """The layout's mesh over ``devices`` (the ``-1`` axis takes what is left)."""
    axes = dict(LAYOUTS[layout][0])
    fixed = math.prod(v for v in axes.values() if v != -1)
    axes = {k: len(devices) // fixed if v == -1 else v for k, v in axes.items()}
    shape = tuple(axes.values())
    return Mesh(np.asarray(list(devices)).reshape(shape), tuple(axes))


def _init_state(model: GPT, tx: optax.GradientTransformation, rng: jax.Array) -> Any:
    params = model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]
    # Boxed params in: optax's moments come out boxed with the same logical names.
    return train.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def param_count(config: ModelConfig) -> int:
    """Parameters of the baseline GPT (equals ``config.param_count()``)."""
    params = jax.eval_shape(GPT(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(params)))


def compile_baseline(
    config: ModelConfig,
    layout: str,
    devices: Sequence[jax.Device],
    *,
    batch: int,
    seq: int,
    pin_activations: bool = False,
) -> Any:
    """Compile (never run) one train step of the Flax baseline under ``layout``.

    Args:
      config: a GPT ``ModelConfig`` (``remat`` and ``scan`` are ignored: the baseline is
        always unrolled with full remat per block).
      layout: a key of :data:`LAYOUTS`.
      devices: the devices of the mesh.
      batch, seq: global batch and sequence length.
      pin_activations: pass the mesh to the activation constraints explicitly; without it
        they are silent no-ops under the legacy ``with mesh:`` (module docstring).

    Returns:
      The ``jax.stages.Compiled`` step.
    """
    rules = LAYOUTS[layout][1]
    mesh = mesh_for(layout, devices)
    model, tx = GPT(config, mesh if pin_activations else None), train.adamw()

    abstract = jax.eval_shape(lambda k: _init_state(model, tx, k), jax.random.key(0))
    logical = nn.get_partition_spec(abstract)
    state_sh = nn.logical_to_mesh_sharding(logical, mesh, rules)
    batch_sh = nn.logical_to_mesh_sharding(PartitionSpec("batch", "length"), mesh, rules)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(abstract),
        state_sh,
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sh)

    def loss_fn(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(state: train.TrainState, inputs: jax.Array, targets: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, inputs, targets)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return train.TrainState(state.step + 1, params, opt_state), loss

    jitted = jax.jit(
        step,
        in_shardings=(state_sh, batch_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )
    with mesh, nn.logical_axis_rules(rules):
        return jitted.lower(state, tokens, tokens).compile()


def measure(compiled: Any) -> tuple[int, int, float, dict[str, float]]:
    """``(memory_total, state_bytes, wire_bytes, wire_by_kind)`` per device of a compiled step.

    Measured exactly as shardkit's ``Report``: memory is arguments + output + temp − alias
    (state = arguments: params + optimizer state + the batch), wire bytes are ring-algorithm
    bytes per device per step from the optimized HLO.
    """
    memory = memory_per_device(compiled)
    by_kind = wire_bytes_by_kind(parse_collectives(compiled.as_text()))
    return memory.total, memory.arguments, float(sum(by_kind.values())), by_kind
