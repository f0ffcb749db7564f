"""The analytic model's bottom layer: its record types and its formulas.

What a layout *should* cost per device, term by term: ZeRO's state bytes, Megatron's
activations, the ring model's wire bytes (all-reduce 2(N−1)/N × operand,
all-gather (N−1)/N × result, reduce-scatter (N−1)/N × operand; kinds with no traffic
left out, as in the measured ``wire_bytes_by_kind``), and the records they fill
(:class:`AnalyticMemory`, :class:`AnalyticModel`). The dense, pipeline, TSP and phase
models (:mod:`~shardkit.report.analytic`, :mod:`~shardkit.report.pipeline_analytic`,
:mod:`~shardkit.report.analytic_tsp`, :mod:`~shardkit.report.phases`) are built from
these and import nothing of each other's below them.

References:
  Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", arXiv:1910.02054. Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", arXiv:2205.05198.

Example:
  >>> wire_bytes("fsdp", psi=1e6, n=8)
  {'all-gather': 7000000.0, 'reduce-scatter': 3500000.0}
  >>> logits_bytes(b=2, s=128, vocab=256, nbytes=4, t=2)   # b·s·V·B/t
  131072.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from shardkit.errors import ShardingError
from shardkit.report.analytic_tsp import context_kv_bytes

__all__ = [
    "AnalyticMemory",
    "AnalyticModel",
    "activation_bytes",
    "hybrid_wire",
    "logits_bytes",
    "megatron_activations_per_layer",
    "wire_bytes",
    "wire_bytes_hybrid",
    "zero_memory",
]

_AXES = ("data", "fsdp", "tensor", "sequence")
_KIND_AXIS = {
    "dp": "data",
    "zero1": "data",
    "zero2": "data",
    "fsdp": "fsdp",
    "zero3": "fsdp",
    "tp": "tensor",
    "tp_sp": "tensor",
    "cp": "sequence",
}


@dataclasses.dataclass(frozen=True)
class AnalyticMemory:
    """Bytes per device of the training state and activations.

    ``phases`` (optional): the peak of each phase of the step (layers, head and loss,
    optimizer step; :mod:`shardkit.report.phases`). When given, the total is the
    largest of them rather than the sum of the four parts.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    phases: Mapping[str, float] | None = None

    @property
    def total(self) -> float:
        """Sum of the four parts, or the largest phase peak when ``phases`` is given."""
        if self.phases:
            return max(self.phases.values())
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict[str, Any]:
        """``params``, ``grads``, ``optimizer``, ``activations`` and ``total`` (with
        ``phases`` and ``peak_phase`` when phases are given)."""
        out: dict[str, Any] = {**dataclasses.asdict(self), "total": self.total}
        if not self.phases:
            del out["phases"]
        else:
            out["phases"] = dict(self.phases)
            out["peak_phase"] = max(self.phases, key=lambda k: self.phases[k])
        return out


@dataclasses.dataclass(frozen=True)
class AnalyticModel:
    """Analytic cost of one (model config, recipe, mesh, batch, seq).

    Attributes:
      memory: bytes per device.
      wire_bytes_by_kind: ring wire bytes per device per step, by collective kind.
      notes: the formulas used, with their numbers, human-readable.
      wire_terms: the same wire bytes by what moves (:data:`shardkit.report.wire_terms.TERMS`:
        weight all-gathers, gradient reductions, activation collectives, ...), from the same
        formulas; they add up to ``sum(wire_bytes_by_kind.values())``.
    """

    memory: AnalyticMemory
    wire_bytes_by_kind: dict[str, float]
    notes: tuple[str, ...]
    wire_terms: Mapping[str, float] = dataclasses.field(default_factory=dict)


def zero_memory(
    psi: float,
    n: int,
    stage: Literal[0, 1, 2, 3],
    *,
    k: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> AnalyticMemory:
    """ZeRO bytes per device of the model state (no activations).

    Stage 0 (DP): (2+2+K)Ψ; 1: 2Ψ+2Ψ+KΨ/N; 2: 2Ψ+(2+K)Ψ/N; 3: (2+2+K)Ψ/N, for
    mixed-precision Adam (K=12: f32 master copy, m and v). For f32 Adam pass
    ``param_bytes=4, grad_bytes=4, k=8``.

    Args:
      psi: parameter count Ψ.
      n: data-parallel degree N.
      stage: 0 (replicated), 1 (optimizer sharded), 2 (+ gradients), 3 (+ parameters).
      k: optimizer bytes per parameter K.
      param_bytes: bytes per parameter; grad_bytes: bytes per gradient value.

    Returns:
      An :class:`AnalyticMemory` with ``activations=0``.

    References:
      Rajbhandari et al. 2019 (ZeRO), section 5 and figure 1; Korthikanti et al. 2022.

    Example:
      >>> [round(zero_memory(7.5e9, 64, s).total / 1e9, 1) for s in (0, 1, 2, 3)]
      [120.0, 31.4, 16.6, 1.9]
    """
    if stage not in (0, 1, 2, 3) or n < 1:
        raise ShardingError(f"zero_memory: stage is 0..3 and n >= 1, got stage={stage}, n={n}.")
    return AnalyticMemory(
        params=param_bytes * psi / (n if stage >= 3 else 1),
        grads=grad_bytes * psi / (n if stage >= 2 else 1),
        optimizer=k * psi / n if stage >= 1 else k * psi,
        activations=0.0,
    )


def megatron_activations_per_layer(
    s: float,
    b: float,
    h: float,
    a: float,
    *,
    t: int = 1,
    mode: Literal["none", "tp", "tp_sp", "full_recompute"],
    bytes_per_value: float = 2,
) -> float:
    """Activation bytes one transformer layer keeps for the backward pass.

    none ``sbh(34 + 5as/h)``; tp ``sbh(10 + 24/t + 5as/(ht))``; tp_sp
    ``sbh(34/t + 5as/(ht))``; full_recompute ``2sbh`` (the layer input only). The paper's
    constants assume 16-bit activations (and count dropout masks at one byte); the result
    is scaled by ``bytes_per_value / 2``.

    Args:
      s: sequence length; b: micro-batch; h: hidden size; a: attention heads.
      t: tensor-parallel degree (unused by ``none`` and ``full_recompute``).
      mode: which of the paper's cases.
      bytes_per_value: bytes of one activation value (4 for f32).

    Returns:
      Bytes per device per layer.

    References:
      Korthikanti et al. 2022, sections 4.1-4.2 and table 2; Rajbhandari et al. 2019.

    Example:
      >>> megatron_activations_per_layer(2048, 1, 12288, 96, t=8, mode="tp")
      578813952.0
    """
    sbh, attn = s * b * h, 5 * a * s / h
    per_mode = {
        "none": 34 + attn,
        "tp": 10 + 24 / t + attn / t,
        "tp_sp": 34 / t + attn / t,
        "full_recompute": 2,
    }
    if mode not in per_mode:
        raise ShardingError(f"mode is one of {list(per_mode)}, got {mode!r}.")
    return float(sbh * per_mode[mode] * bytes_per_value / 2)


def wire_bytes(
    recipe_kind: str,
    *,
    psi: float,
    n: int,
    bytes_per_value: float = 4,
    layers: int | None = None,
    b: float | None = None,
    s: float | None = None,
    h: float | None = None,
    vocab: int | None = None,
    t: int | None = None,
    h_kv: float | None = None,
    in_projections: int = 2,
) -> dict[str, float]:
    """Ring wire bytes per device per step of one pure layout, by collective kind.

    - ``dp``: gradient all-reduce, ``2Ψ·B·(N−1)/N``.
    - ``zero1``/``zero2``: gradient reduce-scatter + parameter all-gather, ``Ψ·B·(N−1)/N``
      each (the same 2Ψ as DP).
    - ``fsdp``/``zero3``: all-gather of the weights forward and again backward,
      ``2Ψ·B·(N−1)/N``, and a gradient reduce-scatter, ``Ψ·B·(N−1)/N`` (3Ψ in all).
    - ``tp`` (Megatron, degree ``t``, default ``n``): per layer, all-reduces of ``b·s·h``
      partial sums: the 2 row-parallel outputs forward (after attention, after the MLP)
      and, backward, the input gradient of each of the ``in_projections`` column-parallel
      projections (2 fused, GPT's ``qkv`` and ``up`` as Megatron's; Llama's separate
      ``wq``, ``wk``, ``wv``, ``gate`` and ``up`` reduce 5: XLA does not add them up
      first). With ``vocab`` given the embedding and loss are vocab-parallel and add the
      embedding output's all-reduce (forward), the head input-gradient all-reduce
      (backward), both of ``b·s·h``, and the cross-entropy's 3 forward all-reduces of
      ``b·s`` (max logit, target logit, sum of exponentials; its backward is local).
    - ``tp_sp`` (Megatron-SP): each ``b·s·h`` all-reduce becomes a reduce-scatter (the
      sequence stays split between the blocks), and per layer 6 all-gathers of ``b·s·h``:
      the 2 column-parallel inputs forward, the 2 row-parallel outputs' gradients
      backward (the forward reduce-scatters' transposes) and the 2 inputs again backward
      for the weight gradients (Megatron-SP keeps only their sequence shard, and so does
      XLA's program). ``6 + 2 + in_projections`` collectives of half an all-reduce's bytes
      a layer: fused, 1.25× TP's volume. With ``vocab`` the embedding's output is
      reduce-scattered forward and its gradient gathered backward, the head's input
      gathered forward and its gradient reduce-scattered backward; the cross-entropy's
      stay all-reduces.
    - ``cp`` (context parallel, all-gather attention): gradient all-reduce as DP, plus per
      layer an all-gather of K and V forward and a reduce-scatter of dK, dV backward,
      ``2·b·s·h_kv·B·(N−1)/N`` each (a ring permute moves the same bytes).

    Args:
      recipe_kind: one of the kinds above.
      psi: parameter count Ψ; n: group size N.
      bytes_per_value: bytes B of a parameter, gradient or activation value.
      layers, b, s, h: layers, global batch, full sequence, hidden size (tp, tp_sp, cp).
      vocab: count the vocab-parallel embedding and loss (tp, tp_sp); t: tensor degree.
      h_kv: width of K (and of V) for cp, ``n_kv_heads·head_dim``; defaults to ``h``.
      in_projections: a layer's column-parallel projections (tp, tp_sp): 2 fused (GPT),
        5 for Llama (``ModelConfig.in_projections``).

    Returns:
      ``{kind: bytes}`` for the kinds with traffic.

    References:
      Rajbhandari et al. 2019, section 7; Korthikanti et al. 2022, section 4.2.

    Example:
      >>> wire_bytes("dp", psi=1e6, n=8)
      {'all-reduce': 7000000.0}
    """
    if recipe_kind not in _KIND_AXIS:
        raise ShardingError(f"Unknown recipe kind {recipe_kind!r}; known: {list(_KIND_AXIS)}.")
    axis = _KIND_AXIS[recipe_kind]
    size = t if axis == "tensor" and t is not None else n
    data_kind = recipe_kind if axis == "data" else "dp"
    tensor_kind = recipe_kind if axis == "tensor" else "tp"
    return hybrid_wire(
        {axis: size},
        psi,
        bytes_per_value,
        layers,
        b,
        s,
        h,
        vocab,
        h_kv,
        data_kind,
        tensor_kind,
        in_projections=in_projections,
    )[0]


def wire_bytes_hybrid(
    axis_sizes: Mapping[str, int],
    *,
    psi: float,
    bytes_per_value: float = 4,
    layers: int | None = None,
    b: float | None = None,
    s: float | None = None,
    h: float | None = None,
    vocab: int | None = None,
    h_kv: float | None = None,
    data_kind: Literal["dp", "zero1", "zero2"] = "dp",
    tensor_kind: Literal["tp", "tp_sp"] = "tp",
    recompute: bool = False,
    attention: str = "allgather",
    in_projections: int = 2,
) -> dict[str, float]:
    """Ring wire bytes per device per step of a layout over several mesh axes, by kind.

    The parts add up, each over its own group, nested ``data ⊃ sequence ⊃ fsdp ⊃ tensor``:

    - ``tensor`` (t): shards the layer weights, so every other part runs on Ψ/t; its
      activation collectives (see :func:`wire_bytes`) use the batch of one tensor group,
      ``b/(data·fsdp)``, and the local sequence ``s/sequence``.
    - ``fsdp`` (f): ZeRO-3 on Ψ/t over f (all-gathers ``2(Ψ/t)``, reduce-scatter ``Ψ/t``).
    - ``data`` (d) and ``sequence`` (c) hold replicas of the remaining Ψ/(t·f) shard: one
      gradient all-reduce over the d·c devices (or ZeRO-1/2's reduce-scatter + all-gather
      with ``data_kind``); ``sequence`` adds the K/V all-gather and dK/dV reduce-scatter over
      c of ``2·(b/(d·f))·s·(h_kv/t)`` per layer.

    A size-1 axis moves nothing, so a hybrid with one axis of size 1 is the pure layout.

    Args:
      axis_sizes: mesh axis sizes, e.g. ``{"data": 2, "fsdp": 4}``; missing axes are 1.
      psi, bytes_per_value, layers, b, s, h, vocab, h_kv, in_projections: as
        :func:`wire_bytes` (``b`` and ``s`` are the global batch and the full sequence).
      data_kind: what the data axis runs: ``dp``, ``zero1`` or ``zero2``.
      tensor_kind: what the tensor axis runs: ``tp`` or ``tp_sp``.
      recompute: full activation recomputation (remat) re-runs every layer's forward,
        and with it the forward activation collectives of ``tensor`` and ``sequence``
        that the backward needs: under TP and TP+SP the attention output's reduction
        (not the MLP's: nothing reads the layer's output, XLA drops it), so
        ``3 + in_projections`` reductions of ``b·s·h`` per layer instead of
        ``2 + in_projections``; under TP+SP also the 2 inputs' all-gathers, which then
        serve the weight gradients in place of the re-gathers (6 all-gathers either way).
      attention: how ``sequence`` moves K/V: ``"allgather"`` (all-gather forward,
        reduce-scatter backward), ``"ring"`` (collective-permutes, the same bytes) or
        ``"ulysses"`` (all-to-alls of q, k, v and the output).

    Returns:
      ``{kind: bytes}`` for the kinds with traffic.

    References:
      Rajbhandari et al. 2019; Korthikanti et al. 2022.

    Example:
      >>> wire_bytes_hybrid({"data": 2, "fsdp": 4}, psi=1e6)
      {'all-gather': 6000000.0, 'reduce-scatter': 3000000.0, 'all-reduce': 1000000.0}
    """
    return hybrid_wire(
        axis_sizes,
        psi,
        bytes_per_value,
        layers,
        b,
        s,
        h,
        vocab,
        h_kv,
        data_kind,
        tensor_kind,
        recompute,
        attention,
        in_projections=in_projections,
    )[0]


def hybrid_wire(
    axis_sizes,
    psi,
    nbytes,
    layers,
    b,
    s,
    h,
    vocab,
    h_kv,
    data_kind,
    tensor_kind,
    recompute=False,
    attention="allgather",
    activations=True,
    terms=None,
    in_projections=2,
    head_term="logits / loss collectives",
    positions=False,
    ulysses=1,
    kv_recompute=None,
    gathered_once=0.0,
    vocab_split_head=True,
    tables=2,
):
    """(wire bytes by kind, notes) of :func:`wire_bytes_hybrid`.

    The sequence axis's attention traffic is
    :func:`~shardkit.report.analytic_tsp.context_kv_bytes` (``attention`` ring,
    allgather or ulysses; ``positions``: the batch carries segment ids and positions,
    placed balanced or packed; ``ulysses``: under ``"usp"``, the Ulysses axis's size of
    the sequence axes' c devices, the ring's c/ulysses).

    ``activations=False`` leaves out the tensor and sequence axes' activation traffic
    (a workload without the model's dimensions) instead of raising. ``terms`` (a dict)
    receives the same bytes by wire term (:mod:`shardkit.report.wire_terms`): FSDP's
    and ZeRO's parameter all-gathers are ``weight all-gathers``; FSDP's reduce-scatter
    and the replicas' all-reduce (or ZeRO's reduce-scatter) ``gradient reductions``;
    TP's b·s·h all-reduces (or SP's reduce-scatters and all-gathers) ``activation
    collectives``, but for the head's input gathered forward under TP+SP, which is
    ``logits / loss collectives`` with the vocab-parallel cross-entropy's b·s all-reduces
    (the loss code gathers it; ``head_term`` names another term where other code
    gathers it); the
    sequence axis's K/V traffic ``context-parallel K/V``.

    ``kv_recompute``: whether the remat re-runs the sequence axis's K/V traffic (default
    ``recompute``; ``save_dots`` recomputes it too: the rotated blocks are not matmul
    outputs). ``gathered_once``: the parameters of ``psi`` fsdp gathers once a step, not
    twice (outside the scanned stack: XLA keeps the forward's gather).
    ``vocab_split_head=False``: the head computes in the tokens' layout under TP+SP
    (``logits="auto"`` past ``T_g > vocab``): the ``tables`` vocabulary tables are
    gathered and reduced over the tensor axis in place of the embedding's and head's
    b·s·h collectives and the cross-entropy's all-reduces.
    """
    unknown = sorted(set(axis_sizes) - set(_AXES))
    if unknown or any(not isinstance(v, int) or v < 1 for v in axis_sizes.values()):
        raise ShardingError(f"axis_sizes {dict(axis_sizes)}: axes are {_AXES} with sizes >= 1.")
    if data_kind not in ("dp", "zero1", "zero2") or tensor_kind not in ("tp", "tp_sp"):
        raise ShardingError(f"data_kind {data_kind!r} / tensor_kind {tensor_kind!r} unknown.")
    d, f, t, c = (axis_sizes.get(a, 1) for a in _AXES)
    if activations and (t > 1 or c > 1) and None in (layers, b, s, h):
        raise ShardingError(
            f"axis_sizes {dict(axis_sizes)}: tensor/sequence parallelism needs "
            "layers=, b=, s= and h= (the activation sizes)."
        )
    out: dict[str, float] = {}
    notes: list[str] = []

    terms = {} if terms is None else terms

    def add(kind: str, volume: float, group: int, factor: float, note: str, term: str) -> None:
        if group > 1 and volume > 0:
            value = factor * volume * nbytes * (group - 1) / group
            out[kind] = out.get(kind, 0.0) + value
            terms[term] = terms.get(term, 0.0) + value
            notes.append(f"{kind} over {group}: {note}")

    weights, grads = "weight all-gathers", "gradient reductions"
    if f > 1:
        # The scanned stack's weights are gathered forward and again in the backward
        # (the loop's body re-gathers them); the parameters outside it (tables, the
        # final norm), ``gathered_once``, once: XLA keeps the forward's gather.
        add(
            "all-gather",
            (2 * psi - gathered_once) / t,
            f,
            1,
            "fsdp weights forward + backward, 2·(Ψ/t)·B·(f−1)/f"
            if not gathered_once
            else f"fsdp weights: the stack's forward + backward, the other {gathered_once:,.0f} "
            "once, (2Ψ − Ψ_rest)/t·B·(f−1)/f",
            weights,
        )
        add("reduce-scatter", psi / t, f, 1, "fsdp gradients, (Ψ/t)·B·(f−1)/f", grads)
    shard, replicas = psi / (t * f), d * c
    if data_kind == "dp":
        add("all-reduce", shard, replicas, 2, "gradients, 2·(Ψ/(t·f))·B·(n−1)/n", grads)
    else:
        add(
            "reduce-scatter",
            shard,
            replicas,
            1,
            f"{data_kind} gradients, (Ψ/(t·f))·B·(n−1)/n",
            grads,
        )
        add(
            "all-gather",
            shard,
            replicas,
            1,
            f"{data_kind} parameters, (Ψ/(t·f))·B·(n−1)/n",
            weights,
        )
    if (t > 1 or c > 1) and not activations:
        notes.append(
            "tensor/sequence activation traffic not modelled: the workload gives no "
            "model dimensions (layers, d_model, seq)"
        )
    if t > 1 and activations:
        bsh = b / (d * f) * (s / c) * h
        act = "activation collectives"
        # Per layer, the reductions of b·s·h partial sums: the 2 row-parallel outputs
        # (attention's out, the MLP's down) forward, the recomputed attention output under
        # remat (the MLP's is dead code there: the backward reads no layer output), and
        # each column-parallel projection's input gradient backward (2 fused, Llama's 5).
        n_red = (2 + in_projections + (1 if recompute else 0)) * layers
        head_note = ""
        if tensor_kind == "tp":
            n_ar = n_red + (2 if vocab is not None else 0)  # embedding output, head input grad
            if vocab is not None:
                head_note = " + embedding output and head input gradient"
            add(
                "all-reduce",
                n_ar * bsh,
                t,
                2,
                f"{n_ar} all-reduces of b·s·h, Megatron TP: "
                f"per layer 2 forward{' + 1 recomputed' if recompute else ''} + "
                f"{in_projections} input gradients{head_note}",
                act,
            )
        else:
            # TP+SP gathers each column-parallel input from its sequence shards forward,
            # gathers the 2 row-parallel outputs' gradients backward (the transposes of the
            # forward reduce-scatters) and gathers the 2 inputs again for the weight
            # gradients (Megatron-SP keeps only its shard; under remat the recomputed
            # forward's gathers serve instead): 6 all-gathers a layer either way.
            add(
                "all-gather",
                6 * layers * bsh,
                t,
                1,
                f"{6 * layers} all-gathers of b·s·h, "
                "TP+SP: per layer 2 inputs forward, 2 output gradients backward, 2 inputs "
                f"again ({'recomputed' if recompute else 'for the weight gradients'})",
                act,
            )
            add(
                "reduce-scatter",
                n_red * bsh,
                t,
                1,
                f"{n_red} reduce-scatters of b·s·h, "
                f"TP+SP: per layer 2 outputs forward{' + 1 recomputed' if recompute else ''} + "
                f"{in_projections} input gradients",
                act,
            )
            if vocab is not None and not vocab_split_head:
                # the head in the tokens' layout (logits="auto" past T_g > vocab): the
                # tables gathered whole and their gradients reduced, no b·s·h pairs
                add("all-gather", tables * vocab * h, t, 1, "the vocabulary tables, V·h", weights)
                add("reduce-scatter", tables * vocab * h, t, 1, "their gradients, V·h", grads)
                if head_term != "logits / loss collectives":  # a pipeline stage's own head
                    add("all-gather", bsh, t, 1, "b·s·h, the head's input forward", head_term)
            elif vocab is not None:  # vocab-parallel embedding and head, Megatron-SP's pairs
                add(
                    "reduce-scatter",
                    2 * bsh,
                    t,
                    1,
                    "2 of b·s·h, the embedding's output "
                    "forward and the head's input gradient backward",
                    act,
                )
                add("all-gather", bsh, t, 1, "b·s·h, the embedding output's gradient backward", act)
                add("all-gather", bsh, t, 1, "b·s·h, the head's input forward", head_term)
        if vocab is not None and (vocab_split_head or tensor_kind == "tp"):
            add(
                "all-reduce",
                3 * bsh / h,
                t,
                2,
                "vocab-parallel cross-entropy, 3 of b·s",
                "logits / loss collectives",
            )
    if c > 1 and activations:
        for kind, value, note in context_kv_bytes(
            attention,
            layers=layers,
            b=b / (d * f),
            s=s,
            h=h / t,
            h_kv=(h if h_kv is None else h_kv) / t,
            n=c // ulysses if attention == "usp" else c,
            nbytes=nbytes,
            recompute=recompute if kv_recompute is None else kv_recompute,
            positions=positions,
            ulysses=ulysses if attention == "usp" else 1,
        ):
            out[kind] = out.get(kind, 0.0) + value
            terms["context-parallel K/V"] = terms.get("context-parallel K/V", 0.0) + value
            notes.append(f"{kind} over {c}: {note}")
    return out, notes


def activation_bytes(precision: str, bytes_per_value: float = 4) -> float:
    """Bytes of one activation value: 2 under ``"bf16"`` (mixed precision), else
    ``bytes_per_value``. Parameters, gradients and Adam's moments keep theirs (float32),
    and the logits are scored in float32 whatever the precision.

    Example:
      >>> activation_bytes("bf16"), activation_bytes("f32")
      (2, 4)
    """
    if precision not in ("f32", "bf16"):
        raise ShardingError(f"precision is 'f32' or 'bf16', got {precision!r}.")
    return 2 if precision == "bf16" else bytes_per_value


def logits_bytes(*, b: float, s: float, vocab: int, nbytes: float, t: int = 1) -> float:
    """The logits of ``b`` sequences of ``s`` tokens, ``b·s·V·B/t`` bytes per device
    (scored in f32 whatever the precision: ``nbytes`` is the state's; ``t`` the devices
    that split the vocabulary). The one formula the dense, TSP, pipeline and phase models
    and the memory terms count the logits with."""
    return b * s * vocab * nbytes / t
