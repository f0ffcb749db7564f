"""A language-model head and cross-entropy that never hold the whole logits.

The vocabulary projection of a step's hidden states, ``f32[tokens, vocab]``, is the
largest activation of a small or mid-sized language model: for GPT-2-small at 8 × 512
tokens it is 786 MiB, against 12 MiB of hidden states. Its backward pass holds it
several times over (the exponentials, the logits' gradient, that gradient again for the
weight's gradient). :func:`chunked_cross_entropy` projects and scores the tokens a
chunk at a time, under ``jax.lax.scan``, with each chunk rematerialised
(``jax.checkpoint``): forward and backward hold one chunk's logits and their gradient,
and the weight's gradient is summed chunk by chunk.

It composes with the layouts of :mod:`shardkit.recipes`: the logits of each chunk are
constrained (``sk.constrain``) to their logical axes, so a vocabulary split over
devices stays split (Megatron's vocab-parallel loss), and the chunks are strided over
the sequence (chunk ``k`` holds positions ``k, k + c, k + 2c, ...``), so a sequence
split over devices (sequence or context parallelism) gives each device its share of
every chunk and nothing moves between chunks.

Example:
  >>> import jax, jax.numpy as jnp, shardkit as sk
  >>> hidden = jax.random.normal(jax.random.key(0), (2, 8, 4))
  >>> w = jax.random.normal(jax.random.key(1), (4, 16))
  >>> targets = jnp.arange(16).reshape(2, 8) % 16
  >>> losses = sk.chunked_cross_entropy(hidden, targets, lambda h: h @ w, chunks=4)
  >>> full = cross_entropy(hidden @ w, targets)   # the same, all logits at once
  >>> losses.shape, bool(jnp.allclose(losses, full, atol=1e-5))
  ((2, 8), True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from shardkit import context, errors
from shardkit.annotate.constrain import (
    current_activation_rules,
    current_param_rules,
    is_explicit,
    param_rules,
)
from shardkit.nn.replicas import ReplicaView, per_replica
from shardkit.nn.tsp_head import vocab_ring_cross_entropy
from shardkit.scopes import block, model_code

__all__ = [
    "HEAD_GRAD_CHUNKS",
    "ChunkError",
    "LOGITS",
    "auto_chunks",
    "chunked_cross_entropy",
    "cross_entropy",
    "head_loss_and_grad",
    "head_post_grad",
    "head_token_chunks",
    "head_view",
    "masked_mean",
]

#: Logical axes of the logits of the reference models.
LOGITS = ("batch", "length", "vocab")


class ChunkError(errors.ShardingError):
    """A chunk count that does not split the tokens (or the devices' share of them)."""


def _one_hot(
    targets: jax.Array, classes: int, dtype: Any, iota: jax.Array | None = None
) -> jax.Array:
    """``jax.nn.one_hot(targets, classes, dtype=dtype)`` written out, same ops.

    ``jax.nn.one_hot`` is a jitted function whose lowering is cached without its caller's
    name stack, so its iota's ``op_name`` says ``jit(_one_hot)``, not the loss's scope;
    written here, the report books that buffer to the loss. A loop's body takes its
    ``iota`` from :func:`_classes` outside the loop: JAX hoists a loop-invariant iota out
    of the body with no name stack at all.
    """
    if iota is None:
        iota = _classes(targets, classes)
    return (targets[..., None] == iota).astype(dtype)


def _classes(targets: jax.Array, classes: int) -> jax.Array:
    """The class indices ``[1, ..., 1, classes]`` that :func:`_one_hot` compares with."""
    shape = (1,) * targets.ndim + (classes,)
    replicated = NamedSharding(jax.typeof(targets).sharding.mesh, PartitionSpec())
    return jax.lax.broadcasted_iota(targets.dtype, shape, targets.ndim, out_sharding=replicated)


@block("loss")
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy, written so a vocabulary split over devices stays split.

    The target logit is picked with a one-hot product and a sum over the vocabulary
    (Megatron's vocab-parallel loss): with logits sharded on ``vocab``, XLA reduces
    ``[batch, length]`` partial sums instead of gathering or resharding the logits, as
    a ``take_along_axis`` would make it do.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> logits, t = jnp.array([[[0.5, 1.0, -1.0]]]), jnp.array([[1]])
      >>> bool(jnp.allclose(cross_entropy(logits, t),
      ...                   optax.softmax_cross_entropy_with_integer_labels(logits, t)))
      True
    """
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.sum(logits * _one_hot(targets, logits.shape[-1], logits.dtype), -1)
    return log_z - target


def masked_mean(losses: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Mean of per-token ``losses`` over the tokens of a document (``segment_ids != 0``).

    Packed rows (:mod:`shardkit.packing`) pad with segment 0 and never form a target
    across a document boundary, so this is the loss of the documents alone: the same
    value as training each document in a row of its own (padding masked the same way).
    Works on the per-token losses of :func:`cross_entropy` and of the chunked head
    (:func:`chunked_cross_entropy`, TSP's vocabulary ring) alike.

    Example:
      >>> import jax.numpy as jnp
      >>> float(masked_mean(jnp.array([[1.0, 3.0, 100.0]]), jnp.array([[1, 2, 0]])))
      2.0
    """
    keep = (segment_ids != 0).astype(jnp.float32)
    return jnp.sum(losses * keep) / jnp.maximum(jnp.sum(keep), 1.0)


_LSE = "shardkit_chunked_ce_logsumexp"


@jax.custom_jvp
def _logsumexp(x: jax.Array) -> jax.Array:
    """``logsumexp`` over the last axis whose derivative reads its own (named) output.

    ``jax.nn.logsumexp``'s derivative recomputes the maximum and the sum of
    exponentials (two reductions over the vocabulary, all-reduces when it is split);
    this one is ``exp(x − y)`` with ``y`` the saved result.
    """
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return jnp.log(jnp.sum(jnp.exp(x - m), axis=-1)) + m[..., 0]


@_logsumexp.defjvp
def _logsumexp_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = checkpoint_name(_logsumexp(x), _LSE)
    return y, jnp.sum(jnp.exp(x - y[..., None]) * dx, axis=-1)


def auto_chunks(length: int, vocab: int, d_model: int, *, quantum: int = 1, ratio: int = 8) -> int:
    """The chunk count :func:`chunked_cross_entropy` picks when given none.

    The fewest chunks that make one chunk's logits (``tokens/c × vocab`` values) at most
    ``ratio`` times the step's hidden states (``tokens × d_model``): ``c ≥ vocab /
    (ratio · d_model)``, rounded up to a divisor of ``length`` that leaves each chunk a
    multiple of ``quantum`` positions (the devices the sequence is split over). With
    ``ratio=1`` this is the rule of Liger-Kernel's fused linear cross-entropy; measured
    on GPT-2-small under ``fsdp`` (8 devices, 8 × 512 tokens), memory stops falling
    past 8 chunks (548 MiB unchunked, 356 at 4, 347 at 8, 346 at 16 and 32), so 8 keeps
    the chunks' matrix products larger for about the same memory.

    Args:
      length: the chunked dimension (the sequence length).
      vocab, d_model: the logits' and hidden states' last dimension.
      quantum: chunks must hold a multiple of this many positions.
      ratio: largest chunk logits, in hidden states.

    Example:
      >>> auto_chunks(512, 50304, 768)   # GPT-2-small: 50304 / (8 · 768) = 8.2
      16
      >>> auto_chunks(512, 32000, 768, quantum=8)   # Llama, sequence over 8 devices
      8
      >>> auto_chunks(16, 256, 64)   # tiny
      1
    """
    want = max(1, math.ceil(vocab / (ratio * d_model)))
    fits = [c for c in range(1, length + 1) if length % c == 0 and (length // c) % quantum == 0]
    return min((c for c in fits if c >= want), default=max(fits, default=1))


def _logits_spec(shape: Sequence[int], logical: Sequence[str | None]) -> PartitionSpec | None:
    mesh, rules = context.active_mesh(), current_activation_rules()
    if mesh is None or rules is None:
        return None
    return rules.spec(tuple(logical), shape=tuple(shape), mesh=mesh, path="logits chunk")


def _pin(x: jax.Array, spec: PartitionSpec | None) -> jax.Array:
    if spec is None:
        return x
    if is_explicit(context.active_mesh()):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _quantum(spec: PartitionSpec | None, dim: int) -> int:
    """Devices the dimension ``dim`` of a ``spec`` is split over."""
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return 1
    mesh = context.active_mesh()
    names = (spec[dim],) if isinstance(spec[dim], str) else tuple(spec[dim])
    return math.prod(mesh.shape[a] for a in names)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relayout(x: jax.Array, forward: PartitionSpec, backward: PartitionSpec) -> jax.Array:
    """``x`` constrained to ``forward``; its cotangent constrained to ``backward``.

    The hidden states are gathered for the head (``forward``) but their gradient is a
    partial sum over the vocabulary's devices: constraining it to the hidden states'
    own layout (``backward``) makes XLA reduce-scatter it, where the transpose of a
    plain constraint would all-reduce it and slice.
    """
    return _pin(x, forward)


def _relayout_fwd(x, forward, backward):
    return _pin(x, forward), None


def _relayout_bwd(forward, backward, _, ct):
    return (_pin(ct, backward),)


_relayout.defvjp(_relayout_fwd, _relayout_bwd)


@block("loss.head_view")
def head_view(
    weight: jax.Array,
    weight_axes: Sequence[str | None],
    *,
    data: jax.Array,
    data_axes: Sequence[str | None] = LOGITS[:-1],
    reuse: ReplicaView | None = None,
) -> ReplicaView:
    """The head's weight as the chunked loss reads it: a ``sk.ReplicaView``.

    The head computes in the layout the *activation* rules give the weight (its
    vocabulary split as the logits' is, the hidden dimension whole). The weight is put
    in that layout once, before the chunk loop, with one copy per replica of the
    devices that split the tokens but not the weight (``sk.per_replica``): each device
    sums its tokens' share of the weight's gradient into its own copy, chunk after
    chunk, and the copies are reduced once, after the loop, not once per chunk.

    Args:
      weight: the head's weight, as the model reads it.
      weight_axes: its logical axes.
      data, data_axes: the targets and their logical axes (the tokens to split).
      reuse: a view of the same weight made for another use (a tied embedding's
        lookup); returned when it has the same replicas and layout, so that both uses'
        gradients add up on each replica before their one reduction.

    Example:
      >>> import jax.numpy as jnp
      >>> view = head_view(jnp.ones((4, 10)), ("embed", "vocab"), data=jnp.zeros((2, 6)))
      >>> view.n   # no plan: the weight itself
      1
    """
    act, rules, mesh = current_activation_rules(), current_param_rules(), context.active_mesh()
    if act is None or mesh is None:
        return reuse if reuse is not None else ReplicaView(weight)
    weight_axes = tuple(weight_axes)
    spec = act.spec(weight_axes, shape=weight.shape, mesh=mesh, path="head weight")
    stored = spec if rules is None else rules.spec(weight_axes, shape=weight.shape, mesh=mesh)
    with param_rules(act):
        view = per_replica(weight, weight_axes, data=data, data_axes=tuple(data_axes))
    if reuse is not None and (reuse.axes, reuse.groups) == (view.axes, view.groups):
        if spec == stored:  # the other use's view is this one
            return reuse
    if view.n == 1:  # no replicas: the head's layout, once, outside the loop
        return ReplicaView(_pin(weight, spec))
    # The same replicas, their gradient reduced in two stages (see _replicate).
    sizes = tuple(mesh.shape[a] for a in view.axes)
    value = _replicate(weight, PartitionSpec(view.axes, *spec), stored, view.axes, sizes)
    return ReplicaView(value, view.groups, view.axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _replicate(
    w: jax.Array,
    spec: PartitionSpec,
    stored: PartitionSpec,
    axes: tuple[str, ...],
    sizes: tuple[int, ...],
) -> jax.Array:
    """``w`` broadcast to ``[n, *w.shape]`` over the replica ``axes`` (as ``per_replica``).

    Its gradient, a sum over the replicas, is reduced in two stages: first over the
    replica axes that also split the stored weight (``stored``), into that split (a
    reduce-scatter), then over the others on the smaller shard (an all-reduce). Summed
    in one go, XLA all-reduces the whole weight over every replica and slices.
    """
    return _pin(jnp.broadcast_to(w, (math.prod(sizes), *w.shape)), spec)


def _replicate_fwd(w, spec, stored, axes, sizes):
    return _replicate(w, spec, stored, axes, sizes), None


def _replicate_bwd(spec, stored, axes, sizes, _, ct):
    used = {a for entry in stored for a in ((entry,) if isinstance(entry, str) else entry or ())}
    rest = [a for a in axes if a not in used]
    ct = _pin(ct.reshape(*sizes, *ct.shape[1:]), PartitionSpec(*axes, *spec[1:]))
    first = tuple(i for i, a in enumerate(axes) if a in used)
    if first and rest:
        ct = _pin(ct.sum(first), PartitionSpec(*rest, *stored))
        return (ct.sum(tuple(range(len(rest)))),)
    return (ct.sum(tuple(range(len(axes)))),)  # where the optimizer wants it (zero1: split)


_replicate.defvjp(_replicate_fwd, _replicate_bwd)


def _head_view(
    weight: Any,
    weight_axes: Sequence[str | None] | None,
    targets: jax.Array,
    token_axes: Sequence[str | None],
) -> ReplicaView:
    if isinstance(weight, ReplicaView):
        return weight
    if weight_axes is None:
        return ReplicaView(weight)
    return head_view(weight, weight_axes, data=targets, data_axes=token_axes)


@block("loss.chunked")
def chunked_cross_entropy(
    hidden: jax.Array,
    targets: jax.Array,
    project: Callable[..., jax.Array],
    *,
    weight: Any = None,
    weight_axes: Sequence[str | None] | None = None,
    chunks: int | None = None,
    logits_axes: Sequence[str | None] = LOGITS,
) -> jax.Array:
    """Per-token cross-entropy of ``project(hidden)``, a chunk of tokens at a time.

    ``project`` maps hidden states ``[..., d]`` to logits ``[..., vocab]``; it is called
    once per chunk under ``jax.checkpoint`` inside a ``jax.lax.scan``, so neither the
    whole logits nor their gradient ever exist: the backward pass recomputes each
    chunk's logits, and the weight's gradient is summed chunk by chunk. Chunk ``k`` of
    ``c`` holds positions ``k, k + c, ...`` of the last token dimension (strided: each
    device of a split sequence holds its share of every chunk).

    Pass the head's weight as ``weight`` (with its logical axes ``weight_axes``) and
    ``project(weight, hidden)``: under a plan (``plan.jit``) it is then laid out once,
    before the loop, as the activation rules lay out the logits (vocabulary split as
    theirs, hidden dimension whole), with one copy per replica of the devices that
    split the tokens (``sk.per_replica``), so its gradient is reduced once after the
    loop, not once per chunk. Under TSP's schedules (``layer_schedule="tsp"``) with
    the weight's vocabulary split over the TSP axis, the loss is instead a ring over the
    vocabulary shards (:mod:`shardkit.nn.tsp_head`; ``chunks`` unused), so no
    device holds the whole weight. A ``sk.ReplicaView`` (a tied embedding already read
    through ``sk.per_replica``) is used as it is. Each chunk's logits are constrained to
    ``logits_axes``; the hidden states are gathered to the layout the logits need once,
    before the loop, and their gradient is reduce-scattered back chunk by chunk.

    Args:
      hidden: hidden states ``[*tokens, d]`` (e.g. ``[batch, length, d]``).
      targets: integer targets ``[*tokens]``.
      project: ``hidden -> logits``, or ``(weight, hidden) -> logits`` with ``weight``;
        computed in any dtype, scored in f32.
      weight: the head's weight (an array or a ``sk.ReplicaView``), or ``None`` when
        ``project`` closes over it (its layout and gradient are then left to XLA, which
        may reduce the gradient once per chunk).
      weight_axes: logical axes of ``weight`` (an array's), e.g. ``("embed", "vocab")``.
      chunks: number of chunks; ``None`` picks :func:`auto_chunks`; 1 projects all the
        tokens at once (still under ``jax.checkpoint``).
      logits_axes: logical axes of the logits, one per dimension.

    Returns:
      ``f32[*tokens]``: the cross-entropy of every token (take ``.mean()`` for the loss).

    Raises:
      ChunkError: ``chunks`` does not divide the last token dimension, or leaves chunks
        that the devices the sequence is split over do not divide.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> h, w = jnp.ones((2, 6, 4)), jnp.zeros((4, 10))
      >>> t = jnp.zeros((2, 6), jnp.int32)
      >>> head = lambda w, x: x @ w
      >>> losses = chunked_cross_entropy(h, t, head, weight=w, weight_axes=("embed", "vocab"),
      ...                                chunks=3)
      >>> round(float(losses.mean()), 4)   # uniform over 10 tokens: log 10
      2.3026
      >>> chunked_cross_entropy(h, t, head, weight=w, chunks=4)
      Traceback (most recent call last):
      ...
      shardkit.nn.loss.ChunkError: chunked_cross_entropy: chunks=4 does not divide the last token dimension (6) of targets (2, 6).
      Fix: pass chunks dividing 6 (e.g. 1, 2, 3, 6), or chunks=None to pick one.
    """
    if hidden.shape[:-1] != targets.shape or targets.ndim < 1:
        raise errors.ShardingError(
            f"chunked_cross_entropy: hidden {hidden.shape} must be targets {targets.shape} "
            "plus one hidden dimension.\nFix: pass hidden [*tokens, d] and targets [*tokens]."
        )
    if len(logits_axes) != hidden.ndim:
        raise errors.ShardingError(
            f"chunked_cross_entropy: logits_axes {tuple(logits_axes)} name "
            f"{len(logits_axes)} dimension(s); the logits have {hidden.ndim}.\n"
            "Fix: one logical name (or None) per token dimension, then the vocabulary's."
        )
    project = model_code(project)  # the head's projection is the model's code
    if weight is not None and weight_axes is not None and not isinstance(weight, ReplicaView):
        # Under TSP's schedules the head's vocabulary shards travel a ring instead.
        losses = vocab_ring_cross_entropy(
            hidden, targets, project, weight, weight_axes, logits_axes
        )
        if losses is not None:
            return losses
    *lead, length = targets.shape
    k, d = len(lead), hidden.shape[-1]
    token_axes = tuple(logits_axes[:-1])
    view = None if weight is None else _head_view(weight, weight_axes, targets, token_axes)

    def logits_of(h: jax.Array) -> jax.Array:
        if view is None:
            return project(h)
        return view.map(project, h)

    probe = jax.ShapeDtypeStruct((*lead, length, d), hidden.dtype)
    vocab = jax.eval_shape(logits_of, probe).shape[-1]
    full_spec = _logits_spec((*lead, length, vocab), logits_axes)
    # A chunk's positions must split as the logits split them and, where the logits take
    # another layout, as the hidden states' own layout does (cp: logits over the
    # vocabulary, the hidden states over the sequence).
    own_split = 1
    if full_spec is not None:
        own_split = _quantum(_logits_spec((*lead, length, d), (*token_axes, None)), k)
    quantum = math.lcm(_quantum(full_spec, k), own_split)
    divisors = [c for c in range(1, length + 1) if length % c == 0]
    if chunks is None:
        chunks = auto_chunks(length, vocab, d, quantum=quantum)
    elif not isinstance(chunks, int) or chunks < 1 or length % chunks:
        shown = ", ".join(map(str, divisors[:6])) + (", ..." if len(divisors) > 6 else "")
        raise ChunkError(
            f"chunked_cross_entropy: chunks={chunks!r} does not divide the last token "
            f"dimension ({length}) of targets {targets.shape}.\n"
            f"Fix: pass chunks dividing {length} (e.g. {shown}), or chunks=None to pick one."
        )
    elif (length // chunks) % quantum:
        ok = [c for c in divisors if (length // c) % quantum == 0]
        raise ChunkError(
            f"chunked_cross_entropy: chunks={chunks} leaves {length // chunks} positions per "
            f"chunk, which the {quantum} devices the sequence is split over do not divide "
            f"(logits {full_spec}).\nFix: pass chunks in {ok}, or chunks=None to pick one."
        )
    size = length // chunks
    chunk_spec = _logits_spec((*lead, size, vocab), logits_axes)
    if full_spec is not None:
        # Forward: the layout the logits need (tokens as theirs, hidden dimension whole),
        # once, outside the loop and its recomputation. Backward: the gradient goes back
        # to the hidden states' own layout (a reduce-scatter, not an all-reduce).
        own = _logits_spec((*lead, length, d), (*token_axes, None))
        # Pinned in its own layout first: the op that made it (a norm's "+ bias") then
        # runs there, and XLA gathers its result, not a broadcast of the bias.
        hidden = _relayout(_pin(hidden, own), PartitionSpec(*full_spec[:-1], None), own)
        targets = _pin(targets, PartitionSpec(*full_spec[:-1]))  # gathered once too
        inner = PartitionSpec(*chunk_spec[:-1], None)
        inner_own = _logits_spec((*lead, size, d), (*token_axes, None))

    def split(x: jax.Array) -> jax.Array:  # [*lead, length, ...] -> [c, *lead, size, ...]
        x = x.reshape(*lead, size, chunks, *x.shape[k + 1 :])
        return jnp.moveaxis(x, k + 1, 0)

    # With the vocabulary split, the backward pass recomputes everything but the
    # log-partition function (one value per token), so it needs no all-reduce over the
    # vocabulary of its own. Unsplit, everything is recomputed (measured: less memory).
    split_vocab = _quantum(full_spec, k + 1) > 1
    policy = jax.checkpoint_policies.save_only_these_names(_LSE) if split_vocab else None

    iota = _classes(targets, vocab)  # here, in the loss's scope: see _one_hot

    @functools.partial(jax.checkpoint, policy=policy)
    def chunk_loss(h: jax.Array, t: jax.Array) -> jax.Array:
        if full_spec is not None:
            h = _relayout(h, inner, inner_own)
        logits = _pin(logits_of(h).astype(jnp.float32), chunk_spec)
        if not split_vocab:  # cross_entropy's ops, with the iota from outside the loop
            log_z = jax.nn.logsumexp(logits, axis=-1)
            return log_z - jnp.sum(logits * _one_hot(t, logits.shape[-1], logits.dtype, iota), -1)
        target = jnp.sum(logits * _one_hot(t, logits.shape[-1], logits.dtype, iota), -1)
        return _logsumexp(logits) - target

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return carry, chunk_loss(*xs)

    _, losses = jax.lax.scan(body, None, (split(hidden), split(targets)))  # [c, *lead, size]
    return jnp.moveaxis(losses, 0, k + 1).reshape(targets.shape)


#: Vocabulary chunks :func:`head_loss_and_grad` writes the weight's gradient in.
HEAD_GRAD_CHUNKS = 8


def head_token_chunks(tokens: int, d_model: int, chunks: int = HEAD_GRAD_CHUNKS) -> int:
    """The token chunks :func:`head_loss_and_grad` scores one at a time when given none.

    The fewest that divide ``tokens`` and keep one chunk's f32 logits (``tokens/c ×
    vocab``) no larger than one vocabulary slice of the weight's gradient (``vocab/chunks
    × d_model``), which the backward holds anyway: ``tokens/c ≤ d_model/chunks`` (the
    vocabulary cancels). For GPT-2-small's last pipeline stage (256 tokens, d 768, 8
    slices): 4 chunks of 64 tokens, 12 MiB of logits at a time instead of 49. Where the
    divisors allow only chunks under a quarter of that bound (388 tokens: 97 chunks of
    4), chunks of up to four times the bound instead (2 of 194), and one chunk where
    there are none (a prime count): a chunk of a few tokens would read the whole weight.

    Example:
      >>> head_token_chunks(256, 768)
      4
      >>> head_token_chunks(2048, 4096)   # gpt-7b, one sequence
      4
      >>> head_token_chunks(12, 2048)   # few tokens: one chunk
      1
      >>> head_token_chunks(1000, 768), head_token_chunks(388, 768), head_token_chunks(257, 768)
      (20, 2, 1)
    """
    if not isinstance(tokens, int) or tokens < 1:
        raise ChunkError(
            f"head_token_chunks(tokens={tokens!r}): the head's tokens are a positive int.\n"
            "Fix: pass the micro-batch's token count on the device."
        )
    most = max(1, d_model // max(1, chunks))  # tokens a chunk may hold

    def fewest(limit: int) -> int:
        start = -(-tokens // limit)
        return next(c for c in range(start, tokens + 1) if tokens % c == 0)

    c = fewest(most)
    if 4 * (tokens // c) >= most:
        return c
    c = fewest(4 * most)
    return c if 4 * (tokens // c) >= most else 1


def _head_chunk(hidden, targets, w, acc, g, *, vocab_axis, dtype, chunks):
    """One token chunk of :func:`head_loss_and_grad`: ``(Σ cross-entropy, ∂/∂hidden, acc +
    ∂/∂weight)``, the gradients of ``g ·`` that sum; ``hidden`` ``[n, d]``, ``w`` in
    ``dtype``."""
    vocab = w.shape[vocab_axis]
    to_logits = "nd,vd->nv" if vocab_axis == 0 else "nd,dv->nv"
    to_hidden = "nv,vd->nd" if vocab_axis == 0 else "nv,dv->nd"
    to_weight = "nv,nd->vd" if vocab_axis == 0 else "nv,nd->dv"
    logits = jnp.einsum(to_logits, hidden, w).astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    d_hidden = jnp.zeros(hidden.shape, jnp.float32)
    target = jnp.zeros(targets.shape, jnp.float32)  # each token's target logit
    bounds = np.linspace(0, vocab, min(chunks, vocab) + 1).round().astype(int)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        # The slice starts at lo + a 0 that XLA cannot prove (no x is both NaN and
        # infinite), read from the hidden states' gradient the previous slice added to:
        # so each slice of the weight and the logits is taken after that slice. Left
        # free, XLA takes them all at once (measured: 8 weight slices live together, as
        # big as the gradient this function spares; it folds |x| < 0 to false). Read
        # from ``acc`` instead, XLA copies ``acc`` once per slice.
        x = d_hidden.reshape(-1)[0]
        start = lo + (jnp.isnan(x) & jnp.isinf(x)).astype(jnp.int32)
        size = hi - lo
        part_logits = jax.lax.dynamic_slice_in_dim(logits, start, size, -1)
        probs = jnp.exp(part_logits - log_z[..., None])
        hot = targets[..., None] == start + jnp.arange(size)
        target = target + jnp.sum(jnp.where(hot, part_logits, 0.0), -1)
        d_logits = ((probs - hot.astype(jnp.float32)) * g).astype(dtype)
        part = jax.lax.dynamic_slice_in_dim(w, start, size, vocab_axis)
        d_hidden = d_hidden + jnp.einsum(
            to_hidden, d_logits, part, preferred_element_type=jnp.float32
        )
        d_part = jnp.einsum(to_weight, d_logits, hidden).astype(acc.dtype)
        old = jax.lax.dynamic_slice_in_dim(acc, start, size, vocab_axis)
        acc = jax.lax.dynamic_update_slice_in_dim(acc, old + d_part, start, vocab_axis)
    return jnp.sum(log_z - target), d_hidden, acc


@block("loss.head_grad")
def head_loss_and_grad(
    hidden: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    acc: jax.Array,
    *,
    vocab_axis: int = 0,
    scale: float | jax.Array = 1.0,
    dtype: Any = None,
    chunks: int = HEAD_GRAD_CHUNKS,
    token_chunks: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``scale`` × the mean cross-entropy of ``hidden · weight``, its gradient for
    ``hidden``, and ``acc`` plus its gradient for ``weight``, added in place.

    ``jax.value_and_grad`` of the head, then ``acc + grad``, holds the weight's gradient
    twice (XLA writes a matrix product into a fresh buffer; only GPU backends fuse the
    add into it): for GPT-2-small's tied table, 147 MiB twice, plus the logits' gradient
    and its transpose. Here the tokens are scored in ``token_chunks`` chunks, one at a
    time (a ``lax.scan``), and each chunk's backward runs ``chunks`` slices of the
    vocabulary at a time (a Python loop): each slice's gradient is added into ``acc``
    where it belongs. The extra memory is one chunk's f32 logits (by default
    :func:`head_token_chunks`'s count: no larger than one slice of the weight's gradient
    where the token count has a divisor near ``d/chunks``) and one slice's logits
    gradient and weight gradient. Loss and gradients come out of one pass: each logit is computed
    once, as in ``jax.value_and_grad``. Used by the pipeline's last stage, where a running
    sum of the head's gradient exists anyway (:class:`shardkit.parallel.stages.Stages`
    ``post_grad``).

    Args:
      hidden: ``[*tokens, d]``.
      targets: integer ``[*tokens]``.
      weight: ``[vocab, d]`` (``vocab_axis=0``, a tied embedding table) or ``[d, vocab]``
        (``vocab_axis=1``, a head's kernel), in its stored dtype.
      acc: the running gradient of ``weight`` (its shape; any float dtype).
      vocab_axis: where the vocabulary is in ``weight``.
      scale: multiplies the loss and both gradients (e.g. ``1/micro-batches``).
      dtype: the products' dtype (default ``hidden``'s); the logits are scored in f32.
      chunks: vocabulary slices of the backward (uneven when they do not divide it).
      token_chunks: how many token chunks (a divisor of the token count); default
        :func:`head_token_chunks`.

    Returns:
      ``(loss, d_hidden, acc + d_weight)``, each gradient of ``scale · loss``.

    Raises:
      ShardingError: a weight that is not 2-D, shapes that do not match; ``ChunkError``:
        ``chunks`` not a positive int, ``token_chunks`` not a divisor of the tokens.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> h = jax.random.normal(jax.random.key(0), (2, 5, 4))
      >>> w = jax.random.normal(jax.random.key(1), (10, 4))
      >>> t = jnp.arange(10).reshape(2, 5)
      >>> f = lambda w, h: cross_entropy(jnp.einsum("...d,vd->...v", h, w), t).mean()
      >>> want, (dw, dh) = jax.value_and_grad(f, argnums=(0, 1))(w, h)
      >>> loss, d_h, acc = head_loss_and_grad(h, t, w, jnp.ones_like(w), chunks=3,
      ...                                     token_chunks=2)
      >>> bool(jnp.allclose(loss, want)), bool(jnp.allclose(d_h, dh, atol=1e-6))
      (True, True)
      >>> bool(jnp.allclose(acc, 1 + dw, atol=1e-6))
      True
    """
    if weight.ndim != 2 or vocab_axis not in (0, 1):
        raise errors.ShardingError(
            f"head_loss_and_grad: weight {weight.shape} with vocab_axis={vocab_axis}; the "
            "head's weight is 2-D, its vocabulary on axis 0 or 1.\nFix: weight [vocab, d] "
            "with vocab_axis=0, or [d, vocab] with vocab_axis=1."
        )
    if acc.shape != weight.shape or hidden.shape[:-1] != targets.shape:
        raise errors.ShardingError(
            f"head_loss_and_grad: hidden {hidden.shape}, targets {targets.shape}, weight "
            f"{weight.shape}, acc {acc.shape}.\nFix: hidden [*tokens, d], targets [*tokens], "
            "acc the weight's shape."
        )
    if not isinstance(chunks, int) or chunks < 1:
        raise ChunkError(
            f"head_loss_and_grad: chunks={chunks!r}.\nFix: a positive int (slices of the "
            f"vocabulary, {HEAD_GRAD_CHUNKS} by default; uneven slices are fine)."
        )
    tokens, d = targets.size, hidden.shape[-1]
    if token_chunks is None:
        token_chunks = head_token_chunks(tokens, d, chunks)
    if not isinstance(token_chunks, int) or token_chunks < 1 or tokens % token_chunks:
        fits = [c for c in range(1, tokens + 1) if tokens % c == 0]
        raise ChunkError(
            f"head_loss_and_grad: token_chunks={token_chunks!r} for {tokens} tokens.\nFix: a "
            f"divisor of {tokens} (e.g. {', '.join(map(str, fits[:6]))}), or None for "
            f"{head_token_chunks(tokens, d, chunks)}."
        )
    dtype = hidden.dtype if dtype is None else dtype
    w = weight.astype(dtype)
    g = scale / tokens  # d loss / d (each token's cross-entropy)
    kw = {"vocab_axis": vocab_axis, "dtype": dtype, "chunks": chunks}
    h = hidden.reshape(token_chunks, tokens // token_chunks, d)
    t = targets.reshape(token_chunks, tokens // token_chunks)
    if token_chunks == 1:
        total, d_hidden, acc = _head_chunk(h[0], t[0], w, acc, g, **kw)
    else:

        def one(acc, ht):
            total, d_h, acc = _head_chunk(*ht, w, acc, g, **kw)
            return acc, (total, d_h)

        acc, (totals, d_hidden) = jax.lax.scan(one, acc, (h, t))
        total = jnp.sum(totals)
    loss = total / tokens * scale
    return loss, d_hidden.reshape(hidden.shape).astype(hidden.dtype), acc


def head_post_grad(
    norm: Callable[[Any, jax.Array], jax.Array],
    *,
    norm_key: str,
    head_key: str,
    vocab_axis: int,
    dtype: Callable[[], Any] | None = None,
) -> Callable[..., tuple[jax.Array, Any, jax.Array]]:
    """A pipeline's ``Stages.post_grad`` for ``post = cross-entropy(head(norm(y)))``.

    ``norm(norm_params, y)`` is the final norm (``rest[norm_key]`` its parameters);
    ``rest[head_key]`` holds the head's one weight, ``[vocab, d]`` (``vocab_axis=0``, a
    tied embedding table) or ``[d, vocab]`` (``vocab_axis=1``); ``dtype()`` gives the
    products' dtype when traced (default the norm's output dtype). The head's gradient is
    written into the running sum in vocabulary slices (:func:`head_loss_and_grad`), so
    the last stage never holds it twice; the loss is the mean cross-entropy of
    ``mb["targets"]``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> norm = lambda p, y: y * p["g"]
      >>> rest = {"ln": {"g": jnp.ones(4)}, "head": {"w": jnp.ones((4, 10))}}
      >>> pg = head_post_grad(norm, norm_key="ln", head_key="head", vocab_axis=1)
      >>> mb = {"targets": jnp.zeros((2, 3), jnp.int32)}
      >>> zeros = jax.tree.map(jnp.zeros_like, rest)
      >>> loss, d_rest, dy = pg(rest, jnp.ones((2, 3, 4)), mb, zeros, 1.0)
      >>> round(float(loss), 4), d_rest["head"]["w"].shape   # uniform over 10: log 10
      (2.3026, (4, 10))
    """

    def post_grad(rest: Any, y: jax.Array, mb: Any, d_rest: Any, scale: Any):
        z, pull = jax.vjp(norm, rest[norm_key], y)
        (weight,), w_def = jax.tree.flatten(rest[head_key])
        (acc,) = jax.tree.leaves(d_rest[head_key])
        loss, dz, acc = head_loss_and_grad(
            z,
            mb["targets"],
            weight,
            acc,
            vocab_axis=vocab_axis,
            scale=scale,
            dtype=None if dtype is None else dtype(),
        )
        d_norm, dy = pull(dz)
        out = {k: d_rest[k] for k in d_rest}
        out[norm_key] = jax.tree.map(jnp.add, d_rest[norm_key], d_norm)
        out[head_key] = jax.tree.unflatten(w_def, [acc])
        return loss, out, dy

    return post_grad
