"""What a layout *should* cost per device: memory (ZeRO, Megatron) and wire bytes (ring).

shardkit's measured numbers are set against these: a guide to the limit a layout can
reach, not a bound. Wire bytes use DESIGN.md's ring model (all-reduce 2(N−1)/N × operand,
all-gather (N−1)/N × result, reduce-scatter (N−1)/N × operand); kinds with no traffic are
left out, as in the measured ``wire_bytes_by_kind``.

References:
  Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", arXiv:1910.02054. Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", arXiv:2205.05198.

Example:
  >>> wire_bytes("fsdp", psi=1e6, n=8)
  {'all-gather': 7000000.0, 'reduce-scatter': 3500000.0}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from shardkit.errors import ShardingError
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe
from shardkit.workload import Workload

__all__ = [
    "AnalyticMemory",
    "AnalyticModel",
    "activation_bytes",
    "analytic_costs",
    "analytic_model",
    "with_phases",
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
    return _hybrid(
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
        reduce-scatter backward) or ``"ring"`` (collective-permutes, the same bytes).

    Returns:
      ``{kind: bytes}`` for the kinds with traffic.

    References:
      Rajbhandari et al. 2019; Korthikanti et al. 2022.

    Example:
      >>> wire_bytes_hybrid({"data": 2, "fsdp": 4}, psi=1e6)
      {'all-gather': 6000000.0, 'reduce-scatter': 3000000.0, 'all-reduce': 1000000.0}
    """
    return _hybrid(
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


def _hybrid(
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
):
    """(wire bytes by kind, notes) of :func:`wire_bytes_hybrid`.

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
        add(
            "all-gather",
            psi / t,
            f,
            2,
            "fsdp weights forward + backward, 2·(Ψ/t)·B·(f−1)/f",
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
            if vocab is not None:  # vocab-parallel embedding and head, Megatron-SP's pairs
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
        if vocab is not None:
            add(
                "all-reduce",
                3 * bsh / h,
                t,
                2,
                "vocab-parallel cross-entropy, 3 of b·s",
                "logits / loss collectives",
            )
    if c > 1 and activations:
        kv = 2 * layers * b / (d * f) * s * (h if h_kv is None else h_kv) / t
        if attention == "ring":  # the same bytes, block by block around the ring
            add(
                "collective-permute",
                kv,
                c,
                3 if recompute else 2,
                "K, V blocks forward "
                "(again when recomputed) and dK, dV blocks backward, 2·L·b·s·h_kv/t each",
                "context-parallel K/V",
            )
        else:
            add(
                "all-gather",
                kv,
                c,
                2 if recompute else 1,
                "K and V per layer forward (again when recomputed), 2·L·b·s·h_kv/t",
                "context-parallel K/V",
            )
            add(
                "reduce-scatter",
                kv,
                c,
                1,
                "dK and dV per layer backward, 2·L·b·s·h_kv/t",
                "context-parallel K/V",
            )
    return out, notes


def _vocab_head_wire(recipe, mesh, w, act, nb, wire, terms) -> list[str]:
    """Add the wire of a head that computes in the vocabulary layout over a data or fsdp
    axis (:meth:`Recipe.step_activation_rules`; a tensor axis's is in :func:`_hybrid`'s
    TP+SP collectives of the head) to ``wire`` and ``terms``, and return its notes.

    Each device gathers the hidden states of the ``T_g`` tokens of the ``g`` devices that
    split the vocabulary, ``T_g·h·A·(g−1)/g`` forward (A: activation bytes) and as many
    reduce-scattered backward, plus the cross-entropy's 3 all-reduces of ``T_g`` f32
    statistics; in exchange the head's weight (``vocab × d_model``) computes on its
    shard: one all-gather and one reduction of it fewer. Measured against the
    ``tokens`` layout on gpt-small and llama-small over fsdp 8: −118.4 / −71.5 MiB of
    all-gathers and of reduce-scatters each, the formula −118.4 / −71.5.
    """
    tokens = w.batch * w.seq
    spec = recipe.step_activation_rules(mesh, tokens=tokens, vocab=w.vocab).spec(
        ("batch", "length", "vocab")
    )
    on_vocab = set(spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],))
    splits = [a for a in recipe.vocab_gather_axes(mesh) if a in on_vocab]
    gather = [a for a in splits if recipe.axis_role(a) in ("data", "fsdp")]
    if not gather:
        return []
    g = math.prod(mesh[a] for a in gather)
    rest = [a for a in recipe.vocab_gather_axes(mesh) if a not in gather]
    t_g = recipe.gathered_tokens(mesh, tokens) / math.prod(mesh[a] for a in rest)
    frac = (g - 1) / g
    hidden, stats = t_g * w.d_model * act * frac, 3 * 2 * t_g * 4 * frac
    weight = w.vocab * w.d_model * nb / recipe.parallelism(mesh).tensor * frac
    for kind, term, x in (
        ("all-gather", "logits / loss collectives", hidden),
        ("reduce-scatter", "activation collectives", hidden),  # the head's line
        ("all-reduce", "logits / loss collectives", stats),
        ("all-gather", "weight all-gathers", -weight),
        ("reduce-scatter", "gradient reductions", -weight),
    ):
        wire[kind] = wire.get(kind, 0.0) + x
        terms[term] = terms.get(term, 0.0) + x
    return [
        f"vocab-split head over {'×'.join(gather)} ({g}): hidden states of T_g = {t_g:,.0f} "
        f"tokens gathered forward and reduce-scattered backward, 2·T_g·h·{act}·(g−1)/g, + 3 "
        "f32 all-reduces of T_g; the head's weight is neither gathered nor reduced, "
        "−2·V·h·B·(g−1)/g"
    ]


def _phase_note(phases: Mapping[str, float]) -> str:
    peaks = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in phases.items())
    return f"total: the largest phase peak (shardkit.report.phases): {peaks}"


def analytic_costs(
    recipe: Recipe | str,
    mesh: Mapping[str, int],
    *,
    workload: Workload,
    param_bytes: float,
    optimizer_bytes: float,
    psi: float | None = None,
    bytes_per_value: int = 4,
    layer_params: float | None = None,
    in_params: float | None = None,
    vocab_tables: int = 2,
    pipeline: Mapping[str, Any] | None = None,
    stack_param_bytes: float | None = None,
    stack_optimizer_bytes: float | None = None,
    tensor_rest_bytes: float | None = None,
) -> AnalyticModel:
    """The analytic memory per device and wire bytes per step of any model under a recipe.

    What the layout runs is read from the recipe's rules (:meth:`Recipe.parallelism`),
    never from its name. State: ``param_bytes`` (and as many gradient bytes) divided by
    the degrees that shard parameters (tensor × fsdp), ``optimizer_bytes`` by those that
    shard optimizer state (× data under ZeRO-1). Wire: the ring model of
    :func:`wire_bytes_hybrid` (a layer's column-parallel projections for the tensor
    axis's collectives: ``workload.in_projections``). Activations (Megatron, Korthikanti et al. 2022, plus the
    logits) and the tensor/sequence activation traffic need the workload's dimensions;
    without them they are left out, and a note says so.

    Args:
      recipe: a ``Recipe`` or a registered recipe's name.
      mesh: mesh axis sizes.
      workload: the step's sizes (:class:`shardkit.workload.Workload`).
      param_bytes, optimizer_bytes: bytes of all parameters / all optimizer state,
        unsharded (count them from the state tree).
      psi: parameter count Ψ (default: ``param_bytes / bytes_per_value``).
      bytes_per_value: bytes of one parameter, gradient or activation value.
      layer_params, in_params: a layer's ringed weights and their input-side part, for a
        TSP axis (default: estimated as (Ψ − vocab·d_model)/layers and half of it;
        :mod:`shardkit.report.analytic_tsp`).
      vocab_tables: vocabulary tables in Ψ under a TSP axis: 1 tied (GPT), 2 untied.
      pipeline, stack_param_bytes, stack_optimizer_bytes: for a recipe with a ``stage``
        axis (required there): the pipeline's options (``{"microbatches": m, "schedule":
        ..., "virtual_stages": v, "unit": U}``) and the layer stack's share of the
        parameter and optimizer bytes; the model is
        :func:`shardkit.report.pipeline_analytic.pipeline_model` (per-stage state, the
        schedule's activations in flight, stage-to-stage and ZeroPP wire).
      tensor_rest_bytes: with ``stage`` and ``tensor`` axes, the bytes of the non-layer
        parameters split over ``tensor`` (default: ``vocab_tables`` vocabulary tables).

    Returns:
      An :class:`AnalyticModel`.

    Example:
      >>> from shardkit.workload import Workload
      >>> m = analytic_costs("fsdp", {"fsdp": 8}, workload=Workload(batch=8),
      ...                    param_bytes=4e6, optimizer_bytes=8e6)
      >>> m.memory.params, m.memory.optimizer, m.wire_bytes_by_kind["all-gather"]
      (500000.0, 1000000.0, 7000000.0)
    """
    recipe = get_recipe(recipe)
    par = recipe.parallelism(mesh)
    d, f, t, c = par.data, par.fsdp, par.tensor, par.sequence
    if par.stage > 1:
        from shardkit.report.pipeline_analytic import pipeline_model

        if pipeline is None or stack_param_bytes is None:
            raise ShardingError(
                f"{recipe.name} pipelines over {par.stage} stages: its analytic model needs the "
                "pipeline's options and the layer stack's bytes.\nFix: analytic_costs(..., "
                "pipeline={'microbatches': m, 'schedule': '1f1b'}, stack_param_bytes=..., "
                "stack_optimizer_bytes=...), or report a step built by "
                "shardkit.train.train_step (its PipelinedStep carries them)."
            )
        stack_opt = (
            stack_param_bytes / param_bytes * optimizer_bytes
            if stack_optimizer_bytes is None
            else stack_optimizer_bytes
        )
        return pipeline_model(
            par,
            workload,
            pipeline=pipeline,
            param_bytes=param_bytes,
            optimizer_bytes=optimizer_bytes,
            stack_param_bytes=stack_param_bytes,
            stack_optimizer_bytes=stack_opt,
            bytes_per_value=bytes_per_value,
            label=recipe.name,
            tensor_rest_bytes=tensor_rest_bytes,
            vocab_tables=vocab_tables,
        )
    if par.tsp > 1:  # TSP: its own model (shardkit.report.analytic_tsp)
        return _tsp_costs(
            recipe,
            par,
            workload,
            param_bytes,
            optimizer_bytes,
            psi,
            bytes_per_value,
            layer_params,
            in_params,
            vocab_tables,
        )
    w, nb = workload, bytes_per_value
    act = activation_bytes(w.precision, nb)
    psi = param_bytes / nb if psi is None else psi
    opt_degree = t * f * (d if par.data_kind == "zero1" else 1)
    remat = w.remat or "none"
    mode = "full_recompute" if remat == "full" else par.tensor_kind if t > 1 else "none"
    b = w.batch / (d * f)
    activations = 0.0
    if w.has_dims:
        s = w.seq / c
        per_layer = megatron_activations_per_layer(
            s, b, w.d_model, w.n_heads, t=t, mode=mode, bytes_per_value=act
        )
        activations = w.layers * per_layer + b * s * w.vocab * nb / t
        act_note = (
            f"activations: {w.layers} layers × Megatron '{mode}' (Korthikanti et al. "
            f"2022) at b={b:g}, s={s:g}, t={t}, {act} bytes per value ({w.precision}), "
            f"+ logits b·s·V·{nb}/{t} (scored in f32); a guide, not a bound"
        )
    else:
        act_note = (
            "activations: not modelled (the workload gives no layers, d_model, n_heads, seq, vocab)"
        )
    memory = AnalyticMemory(
        params=param_bytes / (t * f),
        grads=param_bytes / (t * f),
        optimizer=optimizer_bytes / opt_degree,
        activations=activations,
    )
    h_kv = None
    if w.has_dims and w.n_kv_heads is not None:
        h_kv = w.n_kv_heads * (w.d_model // w.n_heads)
    attention = "ring" if recipe.attention == "ring" else "allgather"
    terms: dict[str, float] = {}
    wire, wire_notes = _hybrid(
        par.sizes(),
        psi,
        nb,
        w.layers,
        w.batch,
        w.seq,
        w.d_model,
        w.vocab,
        h_kv,
        par.data_kind,
        par.tensor_kind,
        recompute=remat == "full",
        attention=attention,
        activations=w.has_dims,
        terms=terms,
        in_projections=w.in_projections,
    )
    if w.has_dims:
        wire_notes += _vocab_head_wire(recipe, mesh, w, act, nb, wire, terms)
    notes = (
        f"Ψ = {psi:,.0f} parameters, {recipe.name} as {par}, B = {nb} bytes per value",
        f"state: params and grads {param_bytes:,.0f} B/{t * f}, optimizer "
        f"{optimizer_bytes:,.0f} B/{opt_degree} (ZeRO, Rajbhandari et al. 2019)",
        act_note,
        *wire_notes,
    )
    return AnalyticModel(memory=memory, wire_bytes_by_kind=wire, notes=notes, wire_terms=terms)


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


def _tsp_costs(
    recipe, par, w, param_bytes, optimizer_bytes, psi, nb, layer_params, in_params, vocab_tables=2
) -> AnalyticModel:
    """:func:`analytic_costs` for a recipe with a TSP axis (size ``par.tsp``)."""
    from shardkit.report.analytic_tsp import tsp_wire_bytes

    if par.fsdp > 1 or par.tensor > 1 or par.sequence > 1:
        raise ShardingError(
            f"{recipe.name}: the analytic model covers TSP with data parallelism only, got {par}."
        )
    d, data = par.tsp, par.data
    psi = param_bytes / nb if psi is None else psi
    remat = w.remat or "none"
    memory = AnalyticMemory(
        params=param_bytes / d,
        grads=param_bytes / d,
        optimizer=optimizer_bytes / d,
        activations=0.0,
    )
    notes = [
        f"Ψ = {psi:,.0f} parameters, {recipe.name} as {par}, B = {nb} bytes per value",
        f"state: params, grads and optimizer / {d} (every weight split over the TSP axis)",
    ]
    if not w.has_dims:
        notes.append(
            "activations and TSP traffic not modelled: the workload gives no model "
            "dimensions (layers, d_model, seq)"
        )
        return AnalyticModel(memory=memory, wire_bytes_by_kind={}, notes=tuple(notes))
    b, s = w.batch / data, w.seq / d
    mode = "full_recompute" if remat == "full" else "none"
    per_layer = megatron_activations_per_layer(
        s, b, w.d_model, w.n_heads, mode=mode, bytes_per_value=activation_bytes(w.precision, nb)
    )
    memory = dataclasses.replace(memory, activations=w.layers * per_layer + b * s * w.vocab * nb)
    if layer_params is None:
        layer_params = max(psi - w.vocab * w.d_model, 0) / w.layers
        in_params = layer_params / 2
        notes.append("Ψ_l estimated as (Ψ − vocab·d_model)/layers (no model config)")
    h_kv = None
    if w.n_kv_heads is not None:
        h_kv = w.n_kv_heads * (w.d_model // w.n_heads)
    terms: dict[str, float] = {}
    wire, wire_notes = tsp_wire_bytes(
        psi=psi,
        layer_params=layer_params,
        in_params=in_params or 0.0,
        layers=w.layers,
        b=b,
        s=w.seq,
        h=w.d_model,
        d=d,
        data=data,
        nbytes=nb,
        schedule=par.tsp_kind,
        recompute=remat == "full",
        h_kv=h_kv,
        vocab=w.vocab,
        tables=vocab_tables,
        terms=terms,
    )
    notes += [
        f"activations: {w.layers} layers × Megatron '{mode}' at b={b:g}, s={s:g} "
        "(Korthikanti et al. 2022), + logits b·s·V·B; a guide, not a bound",
        *wire_notes,
    ]
    return AnalyticModel(
        memory=memory, wire_bytes_by_kind=wire, notes=tuple(notes), wire_terms=terms
    )


def layer_params(config: Any) -> tuple[float, float]:
    """(ringed weights of one layer Ψ_l, their input-side part) of a reference model.

    The attention and MLP kernels (TSP's rings): GPT q/k/v/out + up/down, Llama
    q/k/v/o + gate/up/down; input side: q/k/v and up (and gate).

    Example:
      >>> from shardkit.models import CONFIGS
      >>> layer_params(CONFIGS["gpt-tiny"])
      (49152, 28672)
    """
    return config.dims().ringed_layer_params


def analytic_model(
    config: Any,
    recipe: Recipe | str,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    bytes_per_value: int = 4,
    remat: str | None = None,
    precision: str = "f32",
    pipeline: Mapping[str, Any] | None = None,
) -> AnalyticModel:
    """The analytic memory per device and wire bytes per step of a reference model.

    :func:`analytic_costs` with the state counted from ``config`` for f32 Adam: params
    ``BΨ``, grads ``BΨ``, optimizer ``2BΨ`` (m and v). Activations:
    :func:`megatron_activations_per_layer` × ``n_layers`` at the per-device micro-batch
    and sequence (mode ``tp`` or ``tp_sp`` under tensor recipes, ``full_recompute``
    with remat ``"full"``), plus the logits ``b·s·vocab·B`` (÷t, vocab-parallel). This
    is a guide, not a bound: it ignores XLA's temporaries and ``save_dots`` (counted as
    no remat). For a reference model (a config with ``loss_chunks``) ``memory.phases``
    holds the peak of each phase of the step (:func:`shardkit.report.phases.phase_peaks`:
    the layer being recomputed, the chunked head and loss, the optimizer step) and the
    total is the largest.

    Args:
      config: a :class:`shardkit.models.ModelConfig` (or anything with ``vocab``,
        ``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``remat``, ``param_count()``;
        ``in_projections``, the layer's column-parallel projections for the tensor
        collectives, defaults to 2, fused).
      recipe: a ``Recipe`` or a registered recipe's name.
      mesh: mesh axis sizes; axes the recipe does not declare must be absent or 1.
      batch: global batch; seq: sequence length.
      bytes_per_value: bytes B of a parameter, gradient and activation value.
      remat: overrides ``config.remat`` when given.
      precision: ``"f32"`` or ``"bf16"`` (activations at 2 bytes per value, the state
        and the logits as ``bytes_per_value``; :func:`activation_bytes`).
      pipeline: a pipelined step's options (recipes with a ``stage`` axis; see
        :func:`analytic_costs`).

    Returns:
      An :class:`AnalyticModel`.

    References:
      Rajbhandari et al. 2019; Korthikanti et al. 2022.

    Example:
      >>> from shardkit.models import CONFIGS
      >>> m = analytic_model(CONFIGS["gpt-tiny"], "fsdp", {"fsdp": 8}, batch=8, seq=128)
      >>> m.memory.params == 4 * CONFIGS["gpt-tiny"].param_count() / 8
      True
    """
    psi = config.param_count()
    workload = Workload.from_config(config, batch=batch, seq=seq, remat=remat, precision=precision)
    ringed, ringed_in = layer_params(config)
    model = analytic_costs(
        recipe,
        mesh,
        workload=workload,
        psi=psi,
        param_bytes=bytes_per_value * psi,
        optimizer_bytes=2 * bytes_per_value * psi,
        bytes_per_value=bytes_per_value,
        layer_params=ringed,
        in_params=ringed_in,
        vocab_tables=config.dims().vocab_tables,
        pipeline=pipeline,
        stack_param_bytes=bytes_per_value * config.n_layers * config.dims().layer_params,
        stack_optimizer_bytes=2 * bytes_per_value * config.n_layers * config.dims().layer_params,
    )
    return with_phases(model, config, recipe, mesh, workload)


def with_phases(
    model: AnalyticModel,
    config: Any,
    recipe: Recipe | str,
    mesh: Mapping[str, int],
    workload: Workload,
) -> AnalyticModel:
    """``model`` with the peak of each phase of a reference model's step as its total.

    A no-op unless ``config`` is a reference model's ``ModelConfig`` (``None`` for any
    other model) and the workload has a sequence. See :func:`shardkit.report.phases.phase_peaks`.
    """
    if config is None or not workload.seq:
        return model
    if get_recipe(recipe).parallelism(mesh).stage > 1:  # the phase model knows no pipelines
        return model
    from shardkit.report.phases import phase_peaks

    phases = phase_peaks(
        config,
        recipe,
        mesh,
        batch=workload.batch,
        seq=workload.seq,
        bytes_per_value=4,
        remat=workload.remat or "none",
        base=model.memory,
        precision=workload.precision,
    )
    memory = dataclasses.replace(model.memory, phases=phases)
    notes = (*model.notes[:3], _phase_note(phases), *model.notes[3:])
    return AnalyticModel(
        memory=memory,
        wire_bytes_by_kind=model.wire_bytes_by_kind,
        notes=notes,
        wire_terms=model.wire_terms,
    )
