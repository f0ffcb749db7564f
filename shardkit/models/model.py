"""``Model``: one interface over the linen GPT and the NNX Llama reference models.

``init`` gives annotated parameters (linen: ``nn.LogicallyPartitioned`` boxes;
NNX: an ``nnx.State`` of ``nnx.Param`` Variables with ``out_sharding``
metadata), which ``sk.logical_axes`` reads; ``apply`` and ``loss`` take the
plain arrays ``sk.unbox`` returns (or the annotated tree itself).

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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit import errors, explicit
from shardkit.annotate import activation_rules
from shardkit.models.config import CONFIGS, ModelConfig
from shardkit.models.gpt import GPT, LOGITS
from shardkit.models.llama import Llama

__all__ = ["Model", "get", "names"]


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

    def __init__(self, config: ModelConfig, name: str = "custom"):
        self.config = config
        self.name = name

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
        # Shapes only, and outside any active mesh: NNX would otherwise read the logical
        # names in ``out_sharding`` as mesh axes of that mesh.
        no_mesh = jax.sharding.AbstractMesh((), ())
        with nnx.use_eager_sharding(False), jax.sharding.use_abstract_mesh(no_mesh):
            return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))

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
            # linen creates parameters by running the model on a dummy batch; its
            # activations (batch 1, length 1) are not to be constrained by any active rules.
            with activation_rules(None):
                return self.module.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]
        with nnx.use_eager_sharding(False):
            module = Llama(self.config, rngs=nnx.Rngs(params=rng))
        return nnx.state(module, nnx.Param)

    def apply(self, params: Any, tokens: jax.Array) -> jax.Array:
        """Logits ``f32[batch, seq, vocab]`` for ``int32[batch, seq]`` tokens.

        Args:
          params: ``sk.unbox(model.init(rng))`` (or the annotated tree itself).
          tokens: token ids.

        Example:
          >>> import jax, jax.numpy as jnp, shardkit as sk
          >>> model = get("gpt-tiny", n_layers=1)
          >>> params = jax.eval_shape(lambda k: sk.unbox(model.init(k)), jax.random.key(0))
          >>> jax.eval_shape(model.apply, params, jnp.zeros((2, 4), jnp.int32)).dtype
          dtype('float32')
        """
        shape = (*tokens.shape, self.config.vocab)
        return explicit.auto(self._forward, LOGITS, shape)(params, tokens)

    def loss(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean next-token cross-entropy (f32) of ``batch["targets"]`` given ``batch["inputs"]``.

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
        mean = lambda p, i, t: self._forward(p, i, t).mean()  # noqa: E731
        return explicit.auto(mean, (), ())(params, batch["inputs"], batch["targets"])

    def _forward(self, params: Any, tokens: jax.Array, targets: jax.Array | None = None):
        if self.config.family == "gpt":
            return self.module.apply({"params": params}, tokens, targets)
        return nnx.merge(self._graphdef, params)(tokens, targets)


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
