"""Which phase of a training step sets its memory peak: layers, head and loss, optimizer.

:func:`~shardkit.report.analytic.analytic_model` adds up the state (params, grads,
optimizer) and the activations. A step never holds all of that *plus* every transient
at once: it passes through phases, and its peak is the largest of them. Per device:

- ``layers``: the state, the activations saved for the backward pass, and the layer
  being recomputed (full remat) with, under FSDP, its gathered weights and their
  gradient before the reduce-scatter (:func:`layer_peak_bytes`);
- ``head_loss``: the state, the saved activations, and the vocabulary head with its
  cross-entropy (:func:`head_loss_peak_bytes`): a chunk's logits, their gradient, the
  hidden states in the head's layout, and a gathered copy of the head's weight with
  its gradient where the head computes in another layout than the one stored (a
  pipeline's last stage writing the head's gradient in place:
  :func:`head_grad_peak_bytes`);
- ``optimizer_step``: the state, and what the update holds on top
  (:func:`_optimizer_step_peak_bytes`): nothing for a clip by one scalar factor, a copy
  of the gradients for optax's ``select`` form, and the largest gradient all-reduced
  out of place (XLA's CPU all-reduce writes a new buffer).

:func:`phase_peaks` evaluates the three for a reference model under a built-in
recipe; ``analytic_model`` stores them in ``AnalyticMemory.phases``, whose largest is
then the analytic total. A guide, not a bound: XLA's temporaries inside a phase
(f32 softmax scratch, copies for layout changes) are not modelled.

Example:
  >>> import shardkit as sk
  >>> from shardkit.report.analytic import analytic_model
  >>> m = analytic_model(sk.models.CONFIGS["gpt-small"].dims(), "fsdp", {"fsdp": 8}, batch=8, seq=512,
  ...                    remat="full")
  >>> peak_phase(m.memory.phases)
  'layers'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from shardkit import recipes
from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.nn.loss import HEAD_GRAD_CHUNKS, LOGITS, auto_chunks, head_token_chunks
from shardkit.report.formulas import activation_bytes, logits_bytes, megatron_activations_per_layer

__all__ = [
    "head_grad_peak_bytes",
    "head_loss_peak_bytes",
    "head_weight_copy_bytes",
    "layer_peak_bytes",
    "peak_phase",
    "phase_peaks",
    "spec_split",
]

#: The phases, in the order a step runs them.
_PHASES = ("layers", "head_loss", "optimizer_step")


def head_loss_peak_bytes(
    *,
    tokens: float,
    vocab: int,
    d_model: int,
    chunks: int = 1,
    token_split: int = 1,
    vocab_split: int = 1,
    bytes_per_value: float = 4,
    weight_copy_bytes: float = 0.0,
    live_logits: int = 3,
    weight_buffers: int = 3,
) -> float:
    """Bytes per device the vocabulary head and its loss hold beyond the state.

    ``live_logits`` f32 buffers of one chunk's logits (the exponentials, their gradient,
    the gradient again for the weight's gradient: three in XLA's buffer assignment),
    each ``tokens/(token_split·chunks) × vocab/vocab_split × 4``; the hidden states in
    the head's layout and their gradient, ``2 · tokens/token_split · d_model · B``; and
    ``weight_buffers`` times ``weight_copy_bytes``, the part of the head's weight a
    device holds in the head's layout beyond its stored shard (a vocabulary gathered for
    the head): the copy, its gradient, and that gradient's reduction, which XLA's CPU
    pipeline computes whole (an all-reduce, then a slice) before keeping the shard.

    Args:
      tokens: tokens of the step (batch × sequence).
      vocab, d_model: vocabulary and hidden size.
      chunks: chunks the head and loss run in (``sk.chunked_cross_entropy``).
      token_split, vocab_split: devices the logits' tokens and vocabulary are split over.
      bytes_per_value: bytes B of a hidden-state value.
      weight_copy_bytes: bytes per device of the weight's head layout beyond its shard.
      live_logits: logits-sized buffers live at once.
      weight_buffers: buffers of ``weight_copy_bytes`` live at once.

    Example:
      >>> # GPT-2-small under fsdp, unchunked: three f32[4096, 6288] (98.25 MiB each)
      >>> b = head_loss_peak_bytes(tokens=4096, vocab=50304, d_model=768, vocab_split=8)
      >>> round(b / 2**20, 2)
      318.75
      >>> round(head_loss_peak_bytes(tokens=4096, vocab=50304, d_model=768, chunks=16,
      ...                            vocab_split=8) / 2**20, 2)
      42.42
    """
    if chunks < 1 or token_split < 1 or vocab_split < 1:
        raise ShardingError(
            f"head_loss_peak_bytes: chunks {chunks}, token_split {token_split} "
            f"and vocab_split {vocab_split} must be >= 1."
        )
    logits = tokens / (token_split * chunks) * vocab / vocab_split * 4
    hidden = tokens / token_split * d_model * bytes_per_value
    return float(live_logits * logits + 2 * hidden + weight_buffers * weight_copy_bytes)


def head_grad_peak_bytes(
    *,
    tokens: float,
    vocab: int,
    d_model: int,
    vocab_chunks: int = HEAD_GRAD_CHUNKS,
    bytes_per_value: float = 4,
) -> float:
    """Bytes per device a pipeline's last stage holds for the head's loss and gradient,
    written in place (:func:`shardkit.nn.loss.head_loss_and_grad`).

    One token chunk's f32 logits (``tokens/T × vocab``, ``T`` from
    :func:`shardkit.nn.loss.head_token_chunks`); one vocabulary slice's three
    logits-sized f32 buffers (the slice, its exponentials, its gradient); the slice of
    the weight in the products' dtype and its f32 gradient (``vocab/vocab_chunks ×
    d_model``); the hidden states and their f32 gradient.

    Args:
      tokens: the micro-batch's tokens on the device (rounded to a whole count).
      vocab, d_model: vocabulary and hidden size.
      vocab_chunks: the backward's vocabulary slices.
      bytes_per_value: bytes B of a hidden-state value.

    Raises:
      ShardingError: fewer than one token or vocabulary slice.

    Example:
      >>> # GPT-2-small, one 256-token micro-batch: 4 chunks of 64 tokens, 8 slices
      >>> round(head_grad_peak_bytes(tokens=256, vocab=50304, d_model=768) / 2**20, 2)
      55.23
    """
    if round(tokens) < 1 or vocab_chunks < 1:
        raise ShardingError(
            f"head_grad_peak_bytes: tokens {tokens} and vocab_chunks {vocab_chunks} must be >= 1."
        )
    tokens = round(tokens)
    chunks = head_token_chunks(tokens, d_model, vocab_chunks)
    logits = tokens / chunks * vocab * 4
    weight_slice = vocab / vocab_chunks * d_model * (bytes_per_value + 4)
    hidden = tokens * d_model * (bytes_per_value + 4)
    return float(logits * (1 + 3 / vocab_chunks) + weight_slice + hidden)


def _optimizer_step_peak_bytes(
    *,
    grads_bytes: float,
    clip: Literal["scale", "select"] = "scale",
    reduced_leaf_bytes: float = 0.0,
) -> float:
    """Bytes per device the optimizer step holds beyond the state.

    A clip by one scalar factor (``shardkit.train.clip_by_global_norm``) fuses into the
    update: nothing. optax's ``select(‖g‖ < max, g, g/‖g‖·max)`` is computed as a second
    copy of the gradients: ``grads_bytes``. Plus ``reduced_leaf_bytes``: the largest
    gradient all-reduced across replicas, whose result XLA's CPU all-reduce writes to a
    new buffer while the input is still live (measured: GPT-2-small's 147 MiB embedding
    gradient twice under ``dp``).

    Example:
      >>> _optimizer_step_peak_bytes(grads_bytes=100.0, clip="select")
      100.0
      >>> _optimizer_step_peak_bytes(grads_bytes=100.0, reduced_leaf_bytes=30.0)
      30.0
    """
    if clip not in ("scale", "select"):
        raise ShardingError(
            f"_optimizer_step_peak_bytes: clip is 'scale' or 'select', got {clip!r}."
        )
    return float((grads_bytes if clip == "select" else 0.0) + reduced_leaf_bytes)


def layer_peak_bytes(
    *,
    s: float,
    b: float,
    h: float,
    a: float,
    t: int = 1,
    mode: Literal["none", "tp", "tp_sp"] = "none",
    bytes_per_value: float = 4,
    recompute: bool = True,
    gathered_layer_bytes: float = 0.0,
) -> float:
    """Bytes per device a layer's backward holds beyond the state and saved activations.

    With full recomputation, the layer being recomputed holds its activations again:
    Megatron's per-layer count for the layout (``mode``, see
    :func:`~shardkit.report.formulas.megatron_activations_per_layer`); without it they
    are among the saved activations already (0). Plus twice ``gathered_layer_bytes``:
    under FSDP one layer's weights gathered, and their gradient before it is
    reduce-scattered.

    Example:
      >>> # GPT-2-small, one sequence of 512 per device, f32, no tensor parallelism
      >>> round(layer_peak_bytes(s=512, b=1, h=768, a=12) / 2**20, 2)
      55.5
    """
    layer = (
        megatron_activations_per_layer(s, b, h, a, t=t, mode=mode, bytes_per_value=bytes_per_value)
        if recompute
        else 0.0
    )
    return float(layer + 2 * gathered_layer_bytes)


def spec_split(spec: Any, mesh: Mapping[str, int], dims: tuple[int, ...]) -> int:
    """Devices the dimensions ``dims`` of a ``PartitionSpec`` are split over.

    >>> from jax.sharding import PartitionSpec as P
    >>> spec_split(P(("data", "fsdp"), None, "tensor"), {"data": 2, "fsdp": 4, "tensor": 8}, (0, 1))
    8
    """
    names: list[str] = []
    for i in dims:
        entry = spec[i] if i < len(spec) else None
        names += [entry] if isinstance(entry, str) else list(entry or ())
    return math.prod(mesh.get(n, 1) for n in names)


def head_table_splits(
    recipe: Any, mesh: Mapping[str, int], *, rules: Any = None
) -> tuple[int, int]:
    """Devices the vocabulary table is split over (the head's layout, as stored).
    ``rules``: the step's activation rules (default: the recipe's).

    Example:
      >>> head_table_splits("fsdp", {"fsdp": 8})
      (8, 8)
    """
    recipe = recipes.get(recipe)
    sizes = {a: int(v) for a, v in mesh.items()}
    table = ("vocab", "embed")
    rules = recipe.activation_rules if rules is None else rules
    head_split = spec_split(rules.spec(table, mesh=sizes), sizes, (0, 1))
    return head_split, spec_split(recipe.rules.spec(table, mesh=sizes), sizes, (0, 1))


def head_weight_copy_bytes(
    dims: ModelDims,
    recipe: Any,
    mesh: Mapping[str, int],
    *,
    bytes_per_value: float = 4,
    rules: Any = None,
    act_bytes: float | None = None,
) -> float:
    """Bytes per device of the head's weight in the head's layout beyond its stored shard.

    The ``weight_copy_bytes`` of :func:`head_loss_peak_bytes`: a vocabulary gathered for
    the head where the head computes in another layout than the one stored. ``rules``:
    the step's activation rules (default: the recipe's); ``act_bytes``: bytes of the
    copy's values (default ``bytes_per_value``; 2 under bf16).

    Example:
      >>> import shardkit as sk
      >>> head_weight_copy_bytes(sk.models.CONFIGS["gpt-tiny"].dims(), "dp", {"data": 8})
      0.0
    """
    head_split, stored_split = head_table_splits(recipe, mesh, rules=rules)
    weight = dims.vocab * dims.d_model * bytes_per_value
    scale = 1.0 if act_bytes is None else act_bytes / bytes_per_value
    return max(0.0, weight / head_split - weight / stored_split) * scale


def phase_peaks(
    dims: ModelDims,
    recipe: Any,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    bytes_per_value: int = 4,
    remat: str = "none",
    clip: Literal["scale", "select"] = "scale",
    base: Any,
    precision: str = "f32",
) -> dict[str, float]:
    """Bytes per device at the peak of each phase of a training step whose loss is
    shardkit's chunked head.

    Args:
      dims: the model's :class:`~shardkit.dims.ModelDims` (``loss_chunks`` as the model
        uses it: ``None`` is :func:`shardkit.nn.loss.auto_chunks`).
      recipe: a ``Recipe`` or a registered recipe's name (its rules give the head's
        layout, and what each mesh axis runs: ``Recipe.parallelism``).
      mesh: mesh axis sizes.
      batch, seq: global batch and sequence length.
      bytes_per_value: bytes of a parameter, gradient or activation value.
      remat: ``"none"``, ``"full"`` or ``"save_dots"``.
      clip: the optimizer's clip (``"scale"``: ``shardkit.train.adamw``).
      base: the ``AnalyticMemory`` of
        :func:`~shardkit.report.analytic.analytic_model` for these arguments (its state
        and saved activations).
      precision: ``"bf16"``: activations, the recomputed layer, the hidden states and
        the head's weight copy at 2 bytes per value (the logits are scored in f32).

    The head's layout is the recipe's for this step
    (:meth:`~shardkit.recipes.Recipe.step_activation_rules`: under ``fsdp`` the logits
    split over the vocabulary only while the step has fewer tokens than the vocabulary).

    Returns:
      ``{"layers": ..., "head_loss": ..., "optimizer_step": ...}``.

    Example:
      >>> import shardkit as sk
      >>> from shardkit.report.analytic import analytic_model
      >>> kw = dict(batch=8, seq=512, remat="full")
      >>> dims = sk.models.CONFIGS["gpt-small"].dims()
      >>> base = analytic_model(dims, "dp", {"data": 8}, **kw).memory
      >>> peaks = phase_peaks(dims, "dp", {"data": 8}, clip="select", base=base, **kw)
      >>> max(peaks, key=peaks.get)
      'optimizer_step'
    """
    recipe = recipes.get(recipe)
    par = recipe.parallelism(mesh)
    d, f, t, c = par.data, par.fsdp, par.tensor, par.sequence
    data_kind, tensor_kind = par.data_kind, par.tensor_kind
    sizes = {a: int(v) for a, v in mesh.items()}
    nb, vocab, h = bytes_per_value, dims.vocab, dims.d_model
    act = activation_bytes(precision, nb)
    state = base.params + base.grads + base.optimizer
    logits_term = logits_bytes(b=batch / (d * f), s=seq / c, vocab=vocab, nbytes=nb, t=t)
    saved = base.activations - logits_term

    # The head: its layout is the activation rules' for the logits and for the weight.
    rules = recipe.step_activation_rules(sizes, tokens=batch * seq, vocab=vocab)
    logits_spec = rules.spec(LOGITS, mesh=sizes)
    token_split, vocab_split = (
        spec_split(logits_spec, sizes, (0, 1)),
        spec_split(logits_spec, sizes, (2,)),
    )
    weight = vocab * h * nb
    copy = head_weight_copy_bytes(
        dims, recipe, sizes, bytes_per_value=nb, rules=rules, act_bytes=act
    )
    quantum = spec_split(logits_spec, sizes, (1,))
    chunks = dims.loss_chunks or auto_chunks(seq, vocab, h, quantum=quantum)
    head = head_loss_peak_bytes(
        tokens=batch * seq,
        vocab=vocab,
        d_model=h,
        chunks=chunks,
        token_split=token_split,
        vocab_split=vocab_split,
        bytes_per_value=act,
        weight_copy_bytes=copy,
    )

    # One layer recomputed (full remat), its weights gathered under FSDP.
    mode = tensor_kind if t > 1 else "none"
    layer_params = dims.layer_params
    layer = layer_peak_bytes(
        s=seq / c,
        b=batch / (d * f),
        h=h,
        a=dims.n_heads,
        t=t,
        mode=mode,
        bytes_per_value=act,
        recompute=remat == "full",
        gathered_layer_bytes=layer_params * nb / t if f > 1 else 0.0,
    )

    # The largest gradient (a vocab × d_model table) all-reduced across replicas.
    stored_split = spec_split(recipe.rules.spec(("vocab", "embed"), mesh=sizes), sizes, (0, 1))
    replicas = d * c if data_kind == "dp" else 1
    reduced = weight / stored_split if replicas > 1 else 0.0
    step = _optimizer_step_peak_bytes(grads_bytes=base.grads, clip=clip, reduced_leaf_bytes=reduced)
    return {
        "layers": state + saved + layer,
        "head_loss": state + saved + head,
        "optimizer_step": state + step,
    }


def peak_phase(phases: Mapping[str, float]) -> str:
    """The phase with the largest peak.

    Example:
      >>> peak_phase({"layers": 2.0, "head_loss": 3.0, "optimizer_step": 1.0})
      'head_loss'
    """
    return max(phases, key=lambda k: phases[k])
