"""``Model``: the linen GPT and the NNX Llama reference models behind the model protocol.

A ``Model`` is a :class:`shardkit.protocol.Model`: ``init``, ``loss``, its pipeline cut
(:meth:`Model.stages`: embedding / one block / final norm, head and loss) and its
dimensions (:attr:`Model.dims`). ``init`` gives annotated parameters (linen:
``nn.LogicallyPartitioned`` boxes; NNX: an ``nnx.State`` of ``nnx.Param`` Variables with
``out_sharding`` metadata), which ``sk.logical_axes`` reads; ``apply`` and ``loss`` take
the plain arrays ``sk.unbox`` returns (or the annotated tree itself).

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> from shardkit import models
  >>> model = models.get("llama-tiny", n_layers=1)
  >>> params = jax.jit(lambda key: sk.unbox(model.init(key)))(jax.random.key(0))
  >>> tokens = jnp.zeros((2, 8), jnp.int32)
  >>> loss = jax.jit(model.loss)(params, {"inputs": tokens, "targets": tokens})
  >>> bool(abs(loss - jnp.log(256)) < 0.5)
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
from flax import nnx

from shardkit import context, errors, explicit
from shardkit.annotate import activation_rules
from shardkit.balance import zigzag_ranks
from shardkit.dims import ModelDims
from shardkit.errors import NotPipelinableError
from shardkit.models.config import CONFIGS, ModelConfig
from shardkit.models.deepseek import DeepseekLlama
from shardkit.models.gpt import GPT, LN_EPS, LOGITS, Block, checkpoint_policy
from shardkit.models.llama import Llama
from shardkit.models.moe import MoeLlama
from shardkit.nn.loss import cross_entropy, head_post_grad, masked_mean
from shardkit.nn.rope import rope_tables
from shardkit.nn.segments import Segments, segments_of
from shardkit.nn.stack import linen_layer
from shardkit.protocol import Stages

__all__ = ["Model", "get", "names"]


def _neutral_trace_context() -> bool:
    """Whether code runs outside every plan and mesh: no shardkit context entered, no
    mesh set (``plan.abstract_init`` traces a model's init there)."""
    return context.current() == context.ShardingContext() and (
        jax.sharding.get_abstract_mesh().empty
    )


def _trace_flags() -> tuple[Any, ...]:
    """The JAX and Flax settings a traced init depends on (Flax's: how it splits RNG
    streams, which mapping its init returns)."""
    return (
        jax.config.jax_enable_x64,
        jax.config.jax_default_prng_impl,
        jax.config.jax_threefry_partitionable,
        flax.config.flax_fix_rng_separator,
        flax.config.flax_return_frozendict,
    )


@functools.lru_cache(maxsize=32)
def _linen_init_program(model: Model, key: jax.ShapeDtypeStruct, flags: tuple) -> tuple[Any, Any]:
    """A linen model's init traced once: its jaxpr and its output's tree (boxes and all).

    Flax runs the whole forward pass to create linen parameters (about 0.2 s for a
    scanned GPT of any size). ``plan.abstract_init`` traces an init for every report,
    plan and planner candidate; replaying this jaxpr costs a few milliseconds instead.
    Only traced outside plans and meshes (:func:`_neutral_trace_context`), so nothing a
    plan sets can differ between the trace and its replays; ``flags``
    (:func:`_trace_flags`) are part of the key.
    """
    del flags  # part of the cache key only (models are equal by name and config)
    program, shapes = jax.make_jaxpr(model._linen_init, return_shape=True)(key)
    return program, jax.tree.structure(shapes)


class Model:
    """A reference model behind one ``init`` / ``apply`` / ``loss`` interface.

    Args:
      config: the model's shape and options; ``config.family`` picks GPT (linen)
        or Llama (NNX).
      name: a label (``get`` uses the config's name in ``CONFIGS``).

    All three methods are pure functions of their arguments: wrap them in
    ``jax.jit``, ``jax.eval_shape`` or ``jax.grad`` freely.

    Example:
      >>> import jax
      >>> model = Model(CONFIGS["gpt-7b"], name="gpt-7b")
      >>> abstract = jax.eval_shape(model.init, jax.random.key(0))   # nothing materialized
      >>> abstract["wte"]["embedding"].names, abstract["wte"]["embedding"].value.shape
      (('vocab', 'embed'), (50688, 4096))
    """

    #: A reference model annotates its own parameters (``@sk.axes``).
    annotations = None

    def __init__(self, config: ModelConfig, name: str = "custom"):
        self.config = config
        self.name = name

    @property
    def dims(self) -> ModelDims:
        """The model's dimensions (``config.dims()``)."""
        return self.config.dims()

    @property
    def vocab(self) -> int:
        """The token range of the model's inputs."""
        return self.config.vocab

    @property
    def remat(self) -> str:
        """What each block rematerialises (``config.remat``)."""
        return self.config.remat

    @property
    def precision(self) -> str | None:
        """``"bf16"``/``"f32"`` when the config fixes the compute dtype; ``None``: the plan's."""
        if self.config.dtype is None:
            return None
        return "bf16" if jnp.dtype(self.config.dtype) == jnp.bfloat16 else "f32"

    def __repr__(self) -> str:
        return f"Model(name={self.name!r}, config={self.config!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Model) and other.name == self.name and other.config == self.config

    def __hash__(self) -> int:
        return hash((self.name, self.config))

    @property
    def module(self) -> Any:
        """The linen ``GPT`` module, or an abstract NNX ``Llama`` (shapes only).

        An NNX module fixes its compute dtype when built, so the Llama is built once per
        dtype: the config's, or the active plan's precision (``config.compute_dtype``).
        """
        if self.config.family == "gpt":
            return GPT(self.config)  # reads config.compute_dtype when traced
        return self._llama(self.config.compute_dtype)

    @functools.cache  # noqa: B019 (one abstract module per dtype, for the model's life)
    def _llama(self, dtype: Any) -> Any:
        config = dataclasses.replace(self.config, dtype=dtype)
        cls = _nnx_class(config)
        # Shapes only, and outside any active mesh: NNX would otherwise read the logical
        # names in ``out_sharding`` as mesh axes of that mesh.
        no_mesh = jax.sharding.AbstractMesh((), ())
        with nnx.use_eager_sharding(False), jax.sharding.use_abstract_mesh(no_mesh):
            return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))

    @property
    def _graphdef(self) -> nnx.GraphDef:
        graphdef, _ = nnx.split(self.module)
        return graphdef

    def init(self, rng: jax.Array) -> Any:
        """Fresh annotated parameters from a PRNG key.

        Returns:
          linen: the ``params`` collection, leaves boxed in ``nn.LogicallyPartitioned``;
          NNX: an ``nnx.State`` of ``nnx.Param`` with ``out_sharding`` metadata.
          Layers under scan carry a leading ``"layers"`` axis.

        Example:
          >>> import jax, shardkit as sk
          >>> params = jax.jit(get("gpt-tiny").init)(jax.random.key(0))
          >>> sk.logical_axes(params)["wpe"]["embedding"]
          (None, 'embed')
        """
        if self.config.family == "gpt":
            # Outside any plan, replay the model's one trace (a subclass, which may hold
            # state of its own, traces its init every time).
            if type(self) is Model and _neutral_trace_context():
                # (a typed key's dtype names its PRNG implementation)
                key = jax.ShapeDtypeStruct(rng.shape, rng.dtype)
                program, out_tree = _linen_init_program(self, key, _trace_flags())
                return jax.tree.unflatten(out_tree, jax_core.jaxpr_as_fun(program)(rng))
            return self._linen_init(rng)
        cls = _nnx_class(self.config)
        with nnx.use_eager_sharding(False):
            module = cls(self.config, rngs=nnx.Rngs(params=rng))
        return nnx.state(module, nnx.Param)

    def _linen_init(self, rng: jax.Array) -> Any:
        # linen creates parameters by running the model on a dummy batch; its activations
        # (batch 1, length 1) are not to be constrained by any active rules.
        with activation_rules(None):
            return self.module.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]

    def apply(
        self, params: Any, tokens: jax.Array, *, segments: Segments | None = None
    ) -> jax.Array:
        """Logits ``f32[batch, seq, vocab]`` for ``int32[batch, seq]`` tokens.

        Args:
          params: ``sk.unbox(model.init(rng))`` (or the annotated tree itself).
          tokens: token ids.
          segments: packed rows, ``Segments(segment_ids, positions)``
            (:mod:`shardkit.packing`); ``None``: one document per row.

        Example:
          >>> import jax, jax.numpy as jnp, shardkit as sk
          >>> model = get("gpt-tiny", n_layers=1)
          >>> params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
          >>> jax.eval_shape(model.apply, params, jnp.zeros((2, 4), jnp.int32)).dtype
          dtype('float32')
        """
        shape = (*tokens.shape, self.config.vocab)
        first = (lambda out: out[0]) if self.config.family == "moe" else (lambda out: out)
        if segments is None:
            logits = lambda p, t: first(self._forward(p, t))  # noqa: E731
            return explicit.auto(logits, LOGITS, shape)(params, tokens)
        seg = self._packed({"segment_ids": segments[0], "positions": segments[1]}, tokens)

        def forward(p: Any, i: jax.Array, ids: jax.Array, pos: jax.Array) -> jax.Array:
            return first(self._forward(p, i, None, Segments(ids, pos)))

        return explicit.auto(forward, LOGITS, shape)(params, tokens, *seg)

    def loss(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean next-token cross-entropy (f32) of ``batch["targets"]`` given ``batch["inputs"]``.

        A packed batch (:mod:`shardkit.packing`) also carries ``"segment_ids"`` (0:
        padding) and ``"positions"`` (restarting per document): attention stays inside
        each document, positions restart, and the mean is over the documents' tokens
        (:func:`shardkit.nn.loss.masked_mean`). A batch without them is as before.
        A batch marked ``"zigzag"`` (:meth:`shardkit.Plan.shard_batch`'s one-document rows
        in the zigzag order, :func:`shardkit.balance.zigzag_marker`) runs the ring's
        static half blocks; unmarked rows are masked at run time.

        The head and the loss run a chunk of tokens at a time (``sk.chunked_cross_entropy``,
        ``config.loss_chunks`` chunks), so the whole logits are never held. Under an
        Explicit mesh the model runs with its axes Auto (``shardkit.explicit.auto``);
        the loss comes back replicated, the gradients typed as the parameters.

        Example:
          >>> import jax, jax.numpy as jnp, shardkit as sk
          >>> model = get("llama-tiny", n_layers=1)
          >>> params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
          >>> t = jnp.zeros((2, 4), jnp.int32)
          >>> jax.eval_shape(model.loss, params, {"inputs": t, "targets": t}).shape
          ()
        """
        seg = self._packed(batch, batch["inputs"])
        if seg is None:
            mean = lambda p, i, t: self._mean(self._forward(p, i, t))  # noqa: E731
            return explicit.auto(mean, (), ())(params, batch["inputs"], batch["targets"])

        def packed(p: Any, i: jax.Array, t: jax.Array, ids: jax.Array, pos: jax.Array):
            return self._mean(self._forward(p, i, t, Segments(ids, pos)), ids)

        # Rows Plan.shard_batch placed in the zigzag order, one document each: the ring
        # knows their masks statically (shardkit.balance.zigzag_marker).
        with context.using(zigzag_ranks=zigzag_ranks(batch)):
            return explicit.auto(packed, (), ())(params, batch["inputs"], batch["targets"], *seg)

    def _packed(self, batch: Any, tokens: jax.Array) -> Segments | None:
        """The batch's ``Segments`` (checked), or ``None`` for one document per row."""
        seg = segments_of(batch, tokens.shape, f"{self.name}: batch['segment_ids']")
        # Only a learned position table bounds a row (a position past it would be read
        # clamped, silently); RoPE takes any length, packed or not (zigzag-placed rows of
        # one document each come here with segment ids too).
        long = tokens.shape[-1] > self.config.max_seq
        if seg is not None and long and self.dims.position_table:
            raise errors.ShardingError(
                f"{self.name}: a packed row of {tokens.shape[-1]} tokens is longer than the "
                f"model's position table, max_seq {self.config.max_seq}.\nFix: pack rows of at most "
                f"{self.config.max_seq} tokens (pack_documents(..., seq={self.config.max_seq})"
                f"), or get({self.name!r}, max_seq={tokens.shape[-1]})."
            )
        return seg

    def _mean(self, out: Any, segment_ids: jax.Array | None = None) -> jax.Array:
        """The mean loss of ``_forward``'s output (of the real tokens of packed rows), with
        an MoE model's weighted auxiliary losses added."""
        loss, stats = out if self.config.family == "moe" else (out, None)
        mean = loss.mean() if segment_ids is None else masked_mean(loss, segment_ids)
        return mean if stats is None else mean + jnp.sum(stats["aux"])

    def router_stats(self, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """An MoE model's routers on ``batch``: ``{"load", "dropped"}`` tokens per layer and
        expert ``[layers, E]``, ``"balance"`` and ``"z"`` (the unweighted losses) per layer.
        A packed batch's padding (``segment_ids`` 0) is routed nowhere and counted nowhere.

        Raises:
          ShardingError: the model has no experts.

        Example:
          >>> import jax, jax.numpy as jnp, shardkit as sk
          >>> model = get("moe-tiny")
          >>> params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
          >>> t = jnp.zeros((2, 16), jnp.int32)
          >>> jax.eval_shape(model.router_stats, params, {"inputs": t, "targets": t})["load"].shape
          (2, 8)
        """
        if self.config.family != "moe":
            raise errors.ShardingError(
                f"{self.name}.router_stats: the model has no experts (family "
                f"{self.config.family!r}).\nFix: use an MoE model (moe-tiny, moe-small, ...)."
            )
        seg = self._packed(batch, batch["inputs"])  # packed rows: padding routes nowhere
        segments = None if seg is None else Segments(*seg)
        _, stats = self._forward(params, batch["inputs"], batch["targets"], segments)
        return {k: stats[k] for k in ("load", "dropped", "balance", "z")}

    def stages(self) -> Stages:
        """The model cut into embedding, blocks and head, for a pipeline.

        The same operations as :meth:`loss`, in the same order (a test checks they agree);
        ``post_grad`` writes the vocabulary head's gradient in place
        (:func:`shardkit.nn.loss.head_post_grad`).

        Raises:
          NotPipelinableError: the model's layers are not scanned (``scan=False``).

        Example:
          >>> get("llama-tiny").stages().key
          'layers'
        """
        cfg, model = self.config, self
        if cfg.family == "moe":
            raise NotPipelinableError(
                f"{model.name}: a mixture-of-experts block returns its router's auxiliary "
                "losses beside its output, which a pipeline stage (layer(w, x) -> x) does "
                "not carry.\nFix: train it with ep, fsdp_ep, ep_tp, ep_gspmd, dp or fsdp."
            )
        if not cfg.scan:
            raise NotPipelinableError(
                f"{model.name}: scan=False keeps its {cfg.n_layers} layers as separate "
                "parameters (layers_0, ...); a pipeline cuts one stacked 'layers' axis.\n"
                f"Fix: get({model.name!r}, scan=True) (the default)."
            )

        def loss_of(logits: jax.Array, mb: Any) -> jax.Array:
            return cross_entropy(logits.astype(jnp.float32), mb["targets"]).mean()

        def remat(fn: Callable) -> Callable:
            if cfg.remat == "none":
                return fn
            return jax.checkpoint(fn, prevent_cse=False, policy=checkpoint_policy(cfg.remat))

        if cfg.family == "gpt":

            def pre(rest: Any, mb: Any) -> jax.Array:
                tokens = mb["inputs"]
                table = rest["wte"]["embedding"].astype(cfg.compute_dtype)
                x = jnp.take(table, tokens, axis=0)
                x = x + jnp.take(
                    rest["wpe"]["embedding"], jnp.arange(tokens.shape[-1])[None], axis=0
                )
                return x.astype(cfg.compute_dtype)

            layer = remat(linen_layer(Block(cfg)))

            def final_norm(params: Any, y: jax.Array) -> jax.Array:
                # Built when traced: the compute dtype is the plan's (sk.compute_dtype()).
                norm = nn.LayerNorm(
                    epsilon=LN_EPS, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype
                )
                return norm.apply({"params": params}, y)

            def post(rest: Any, y: jax.Array, mb: Any) -> jax.Array:
                y = final_norm(rest["ln_f"], y)
                table = rest["wte"]["embedding"].astype(cfg.compute_dtype)
                return loss_of(jnp.einsum("...d,vd->...v", y, table), mb)

            post_grad = head_post_grad(
                final_norm,
                norm_key="ln_f",
                head_key="wte",
                vocab_axis=0,
                dtype=lambda: cfg.compute_dtype,
            )
            return Stages(pre, layer, post, post_grad=post_grad)

        def graphdef(part: str) -> Any:
            # An NNX module fixes its compute dtype when built: read it when traced, under the
            # plan's precision (``model.module`` is built once per dtype).
            return nnx.split(getattr(model.module, part))[0]

        def pre(rest: Any, mb: Any) -> jax.Array:
            return nnx.merge(graphdef("embed"), rest["embed"])(mb["inputs"]).astype(
                cfg.compute_dtype
            )

        def block(state: Any, x: jax.Array) -> jax.Array:
            cos, sin = rope_tables(x.shape[1], cfg.head_dim)
            return nnx.merge(graphdef("layers"), state)(x, cos, sin)

        def final_norm(params: Any, y: jax.Array) -> jax.Array:
            return nnx.merge(graphdef("norm"), params)(y)

        def post(rest: Any, y: jax.Array, mb: Any) -> jax.Array:
            y = final_norm(rest["norm"], y)
            return loss_of(nnx.merge(graphdef("head"), rest["head"])(y), mb)

        post_grad = head_post_grad(
            final_norm,
            norm_key="norm",
            head_key="head",
            vocab_axis=1,
            dtype=lambda: cfg.compute_dtype,
        )
        return Stages(pre, remat(block), post, post_grad=post_grad)

    def _forward(
        self,
        params: Any,
        tokens: jax.Array,
        targets: jax.Array | None = None,
        segments: Segments | None = None,
    ):
        if self.config.family == "gpt":
            return self.module.apply({"params": params}, tokens, targets, segments)
        return nnx.merge(self._graphdef, params)(tokens, targets, segments)


def _nnx_class(config: ModelConfig) -> type[nnx.Module]:
    """The NNX model class of a config: Llama, MoE Llama, or with latent attention DeepSeek."""
    if config.family != "moe":
        return Llama
    return DeepseekLlama if config.kv_latent else MoeLlama


def names() -> list[str]:
    """Names of the reference configs, for ``get``.

    Example:
      >>> names()[:2]
      ['gpt-tiny', 'gpt-small']
    """
    return list(CONFIGS)


def get(name: str, **overrides: Any) -> Model:
    """The reference model ``name``, with ``ModelConfig`` fields replaced by ``overrides``.

    Raises:
      ShardingError: unknown name or unknown/invalid override.

    Example:
      >>> get("gpt-tiny", remat="full", n_layers=4).config.n_layers
      4
    """
    if name not in CONFIGS:
        raise errors.ShardingError(
            f"Unknown model {name!r}.\nFix: use one of {', '.join(names())}."
        )
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise errors.ShardingError(
            f"get({name!r}): {unknown} are not ModelConfig fields.\n"
            f"Fix: override only {', '.join(sorted(fields))}."
        )
    return Model(dataclasses.replace(CONFIGS[name], **overrides), name=name)
