"""``Workload``: what one training step processes, for the analytic model and reports.

A report read from a compiled program is reproducible only with the step's
workload next to it: the batch, the sequence, the model's dimensions where
known, rematerialisation and precision. The reference models fill it from their
config; a user's own model gives what it knows (batch alone is enough for the
state and data-parallel terms; the activation terms need the dimensions).

Example:
  >>> from shardkit.workload import Workload
  >>> w = Workload(batch=8, seq=128, layers=2, d_model=64, n_heads=4, vocab=256)
  >>> w.has_dims, Workload(batch=8).has_dims
  (True, False)
  >>> w.to_json()["batch"]
  8
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from shardkit.context import check_precision
from shardkit.dtypes import is_key
from shardkit.protocol import Model

__all__ = ["Workload", "dims_sizes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One training step's sizes.

    Attributes:
      batch: global batch (examples per step).
      seq: sequence length (tokens per example), if the batch has one.
      layers, d_model, n_heads, n_kv_heads, vocab: the model's dimensions, for the
        activation terms (Megatron's per-layer activations, tensor- and
        sequence-parallel collectives, the logits); ``None`` where unknown.
      in_projections: a layer's column-parallel projections (the matmuls that read the
        attention's or the MLP's input), each reducing its input's gradient on its own
        under tensor parallelism: 2 fused (GPT's ``qkv`` and ``up``, Megatron's), 5 for
        Llama's separate ``wq``, ``wk``, ``wv``, ``gate`` and ``up``.
      remat: ``"none"``, ``"full"`` or ``"save_dots"``; ``None`` where the model's own
        code decides (a user's model).
      precision: ``"f32"`` (every value 4 bytes) or ``"bf16"`` (mixed precision:
        activations 2 bytes; parameters, gradients and Adam's moments 4).
      model: a label for reports (a reference model's name, or ``module:factory``).
    """

    batch: int
    seq: int | None = None
    layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab: int | None = None
    in_projections: int = 2
    remat: str | None = "none"
    precision: str = "f32"
    model: str | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision, "Workload(precision)")

    @property
    def has_dims(self) -> bool:
        """True when the activation terms can be computed."""
        return None not in (self.seq, self.layers, self.d_model, self.n_heads, self.vocab)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        batch: int,
        seq: int,
        model: str | None = None,
        remat: str | None = None,
        precision: str | None = None,
    ) -> Workload:
        """A reference model's workload (``config`` is a ``ModelConfig`` or alike).

        ``precision`` is the plan's (default ``"f32"``); a config whose ``dtype`` is set
        explicitly overrides it (bfloat16: ``"bf16"``, else ``"f32"``)."""
        return cls(
            batch=batch,
            seq=seq,
            layers=config.n_layers,
            d_model=config.d_model,
            n_heads=config.n_heads,
            n_kv_heads=getattr(config, "n_kv_heads", config.n_heads),
            vocab=config.vocab,
            in_projections=getattr(config, "in_projections", 2),
            remat=remat or getattr(config, "remat", "none") or "none",
            precision=_precision_of(getattr(config, "dtype", None), precision),
            model=model,
        )

    @classmethod
    def of_model(cls, model: Model, *, batch: int, seq: int, precision: str = "f32") -> Workload:
        """The workload of any model (:class:`shardkit.protocol.Model`): its declared
        ``dims`` (none: batch and sequence only), its ``remat`` (``None``: its own code
        decides) and its ``precision`` (``None``: the plan's ``precision``, which a model of
        your own is assumed to follow by reading ``sk.compute_dtype()``).

        Example:
          >>> from shardkit import models
          >>> Workload.of_model(models.get("llama-tiny"), batch=8, seq=32).in_projections
          5
        """
        return cls(
            batch=batch,
            seq=seq,
            model=model.name,
            remat=model.remat,
            precision=model.precision or precision,
            **dims_sizes(model.dims),
        )

    @classmethod
    def of_batch(cls, batch: Any, precision: str = "f32") -> Workload | None:
        """The sizes a batch tree implies: its leaves' leading dimension, and the sequence
        length when it holds token ids (2-D integer arrays); ``None`` for a batch of scalars.

        Example:
          >>> import numpy as np
          >>> w = Workload.of_batch({"inputs": np.zeros((8, 32), np.int32)})
          >>> w.batch, w.seq, Workload.of_batch({"x": np.zeros((8, 3))}).seq
          (8, 32, None)
        """
        leaves = [x for x in jax.tree.leaves(batch) if np.shape(x)]
        if not leaves:
            return None
        tokens = [
            x
            for x in leaves
            if len(np.shape(x)) == 2
            and not is_key(getattr(x, "dtype", None))
            and np.issubdtype(np.dtype(getattr(x, "dtype", np.float32)), np.integer)
        ]
        seq = int(np.shape(tokens[0])[1]) if tokens else None
        return cls(batch=int(np.shape(leaves[0])[0]), seq=seq, precision=precision)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _precision_of(dtype: Any, default: str | None) -> str:
    """``"bf16"``/``"f32"`` of a config's explicit ``dtype``; ``default`` when it has none."""
    if dtype is None:
        return default or "f32"
    return "bf16" if np.dtype(dtype).name == "bfloat16" else "f32"


def dims_sizes(dims: Any) -> dict[str, int]:
    """The :class:`Workload` fields a model's ``ModelDims`` gives (none without dims).

    Example:
      >>> from shardkit import models
      >>> dims_sizes(models.get("gpt-tiny").dims)["layers"]
      2
    """
    if dims is None:
        return {}
    return {
        "layers": dims.layers,
        "d_model": dims.d_model,
        "n_heads": dims.n_heads,
        "n_kv_heads": dims.n_kv_heads,
        "vocab": dims.vocab,
        "in_projections": dims.in_projections,
    }
