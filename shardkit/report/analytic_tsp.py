"""The analytic model of TSP (tensor and sequence parallelism on one axis).

Derived here, per device and training step, for a TSP axis of size D with f = (D − 1)/D,
B bytes per value, L layers, per-layer ringed weights Ψ_l (the attention and MLP
kernels), one data replica's b sequences of S tokens, width h, K/V width h_kv
(n_kv_heads·head_dim: GQA's K/V travel with their own heads), vocabulary V, and
Ψ_r the weights left over (norms, biases, position table):

Paper's schedules (``layer_schedule="tsp"``, :mod:`shardkit.nn.tsp`):

- weight rings, collective-permute: forward, each device receives the D − 1 other
  shards of every ringed kernel, f·Ψ_l·B per layer; backward, the shards again and a
  gradient accumulator for D − 1 hops, 2f·Ψ_l·B. Full remat re-runs the forward of
  the input-side projections (q/k/v, up, gate: Ψ_in of Ψ_l; the output projections'
  results are not needed again), + f·Ψ_in·B.
- the vocabulary head's ring (:mod:`shardkit.nn.tsp_head`), collective-permute:
  f·V·h·B forward, 2f·V·h·B backward.
- K/V ring (zigzag ring attention), collective-permute: D − 1 blocks of K and V,
  f·2·b·S·h_kv·B forward and the same for dK/dV backward (+ one forward again under
  full remat). The zigzag reorder of q, k, v and of the output moves at most one local
  block of each per device: 4·(h + h_kv)·b·S·B/D per pass (forward, backward,
  recompute; 8·b·S·h·B/D without GQA).
- the embedding lookup (:func:`shardkit.nn.tsp_head.vocab_ring_lookup`): each
  device looks its vocabulary rows up for every token (the token ids all-gathered,
  f·b·S·4 bytes) and the partial embeddings travel a ring reduce-scatter,
  f·b·S·h·B, collective-permute; backward, their gradient a ring all-gather, f·b·S·h·B.
- Ψ_r is left to XLA as FSDP: all-gather 2f·Ψ_r·B, reduce-scatter f·Ψ_r·B.

Rules only (``tsp_gspmd``): FSDP over the axis for the layers' weights and Ψ_r
(all-gather 2f·(LΨ_l + Ψ_r)·B, reduce-scatter f·(LΨ_l + Ψ_r)·B), the head's weight
gathered once for the chunked loss (f·V·h·B) and its gradient reduce-scattered
(f·V·h·B), the same K/V ring, and XLA's vocab-parallel lookup: the same bytes as the
ring lookup, as a reduce-scatter of the partial embeddings and an all-gather of their
gradient. No device gathers the embedding table in either.

Both: gradients of the Ψ/D shard all-reduced over ``data`` (d replicas),
2(Ψ/D)·B·(d − 1)/d. State: params, grads and the optimizer divided by D.
Activations: Megatron's per-layer count (Korthikanti et al. 2022) at S/D tokens.

Against TP (+SP), whose layer moves 4 all-reduces' worth, 8f·b·S·h·B with backward,
a TSP layer moves less once f·(3Ψ_l + 4bS·h_kv) + 8bS(h + h_kv)/D < 8f·bSh, i.e. for
b·S > 3fΨ_l / (8f·h − 4f·h_kv − 8(h + h_kv)/D) tokens (the paper's 3Ψ_l/(4h) with
h_kv = h and no zigzag). :func:`tsp_crossover_tokens` gives it.

Example:
  >>> round(tsp_crossover_tokens(layer_params=12 * 2048**2, d_model=2048, d=8))
  43008
"""

from __future__ import annotations

import math

__all__ = ["context_kv_bytes", "positions_travel", "tsp_crossover_tokens", "tsp_wire_bytes"]


def tsp_wire_bytes(
    *,
    psi: float,
    layer_params: float,
    in_params: float,
    layers: int,
    b: float,
    s: float,
    h: float,
    d: int,
    data: int = 1,
    nbytes: float = 4,
    schedule: str = "tsp",
    recompute: bool = False,
    h_kv: float | None = None,
    vocab: int = 0,
    tables: int = 2,
    terms: dict[str, float] | None = None,
    attention: str = "ring",
    zigzag: bool = True,
    fsdp: int = 1,
    ulysses: int = 1,
    kv_recompute: bool | None = None,
    stack_params: float | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Ring wire bytes per device per step of a TSP layout, by kind, and notes.

    Args:
      psi: all parameters Ψ; layer_params: ringed weights of one layer Ψ_l;
      in_params: the input-side part of Ψ_l (recomputed under full remat).
      layers: L; b: sequences per data replica; s: sequence length; h: model width.
      d: TSP axis size D; data: data-parallel replicas; nbytes: B.
      schedule: ``"tsp"`` (the paper's rings) or ``"gspmd"`` (rules only).
      recompute: full activation recomputation.
      h_kv: K/V width (default ``h``).
      vocab: V, for the embedding lookup and the head (0: counted in Ψ_r as FSDP).
      tables: vocabulary tables in Ψ, 1 tied (GPT) or 2 (Llama's embedding and head).
      attention: how the context axis moves K/V: ``"ring"``, ``"allgather"``,
        ``"ulysses"`` or ``"usp"`` (:func:`context_kv_bytes`).
      ulysses: under ``"usp"``, the Ulysses axis's size U of the D context devices (the
        ring has D/U).
      fsdp: an FSDP axis beside the context axis that splits the batch and, with it, every
        weight (``fsdp_cp``: ZeRO-3 over the F·D devices): the weights, the head and the
        lookup run over the F·D group, for its F·b sequences; the K/V traffic over D
        for b (``b`` is then the sequences of one context group).
      kv_recompute: whether the remat re-runs the K/V traffic (default ``recompute``;
        ``save_dots`` does too: the rotated blocks are not matmul outputs).
      stack_params: the scanned layer stack's parameters; given, the ``"gspmd"``
        schedule gathers the vocabulary tables whole for the lookup and the head, and
        every parameter outside the stack once a step (as XLA moves them), and under
        ``fsdp`` all-reduces their gradients over each axis in turn.
      zigzag: the ring reorders q, k, v and the output in every layer (the tokens placed
        in order); ``False`` where the batch is placed balanced, with positions
        (:mod:`shardkit.balance`).
      terms: a dict that receives the same bytes by wire term
        (:mod:`shardkit.report.wire_terms`): the K/V ring and the zigzag reorder are
        ``context-parallel K/V``; the token ids and the lookup ``activation collectives``;
        weight rings, the head's ring or gather and the FSDP rest ``weight all-gathers``;
        the head's and the rest's gradients and the data all-reduce ``gradient reductions``.

    Returns:
      ``({kind: bytes}, notes)``.

    Example:
      >>> wire, _ = tsp_wire_bytes(psi=100, layer_params=40, in_params=20, layers=2,
      ...                          b=1, s=8, h=2, d=4)
      >>> wire["collective-permute"]  # 3f·L·Ψ_l·B + (2f·2bSh + 2·8bSh/D)·L·B
      1616.0
    """
    f = (d - 1) / d
    group = d * fsdp  # the devices one copy of the state is split over
    fg, bg = (group - 1) / group, b * fsdp
    out: dict[str, float] = {}
    notes: list[str] = []

    terms = {} if terms is None else terms
    weights, grads = "weight all-gathers", "gradient reductions"
    kv, act = "context-parallel K/V", "activation collectives"

    def add(kind: str, value: float, note: str, term: str) -> None:
        if value > 0:
            out[kind] = out.get(kind, 0.0) + value
            terms[term] = terms.get(term, 0.0) + value
            notes.append(f"{kind}: {note} = {value:,.0f} B")

    h_kv = h if h_kv is None else h_kv
    kv_recompute = recompute if kv_recompute is None else kv_recompute
    passes = 3 if kv_recompute else 2
    u = ulysses if attention == "usp" else 1
    for kind, value, note in context_kv_bytes(
        attention,
        layers=layers,
        b=b,
        s=s,
        h=h,
        h_kv=h_kv,
        n=d // u,
        nbytes=nbytes,
        recompute=kv_recompute,
        positions=positions_travel(not zigzag, attention),
        ulysses=u,
    ):
        add(kind, value, note, kv)
    if attention in ("ring", "usp") and zigzag and d // u > 1:  # USP: the ring's heads, ranks
        add(
            "collective-permute",
            layers * passes * 4 * (h + h_kv) / u * b * s * nbytes / (d // u),
            f"zigzag reorder, {passes} passes × L·4·(h + h_kv)·b·S·B/D"
            + (" (USP: h/U over the ring's D/U)" if u > 1 else ""),
            kv,
        )
    gathered_tables = schedule == "gspmd" and stack_params is not None
    rest = psi - (tables * vocab * h if vocab and not gathered_tables else 0)
    if vocab:
        add("all-gather", fg * bg * s * 4, "token ids for the lookup, f·b·S·4", act)
    # A tied table with data replicas is read through one replica view by the lookup
    # and the head (shardkit.nn.replicas: its gradient reduced once): gathered whole
    # over the TSP axis, no ring for the lookup or the head.
    replica_table = schedule == "tsp" and tables == 1 and data > 1
    if vocab and replica_table:
        add("all-gather", fg * vocab * h * nbytes, "the tied table gathered, f·V·h·B", weights)
        add("reduce-scatter", fg * vocab * h * nbytes, "its gradient, f·V·h·B", grads)
    elif vocab and not gathered_tables:
        lookup = "collective-permute" if schedule == "tsp" else "reduce-scatter"
        add(lookup, fg * bg * s * h * nbytes, "embedding lookup forward, f·b·S·h·B", act)
        lookup = "collective-permute" if schedule == "tsp" else "all-gather"
        add(lookup, fg * bg * s * h * nbytes, "embedding gradient back, f·b·S·h·B", act)
        if schedule == "tsp":
            add("collective-permute", 3 * f * vocab * h * nbytes, "head ring, 3f·V·h·B", weights)
        else:
            add(
                "all-gather", fg * vocab * h * nbytes, "head weight gathered once, f·V·h·B", weights
            )
            add("reduce-scatter", fg * vocab * h * nbytes, "head gradient, f·V·h·B", grads)
    if schedule == "tsp":
        ring = 3 * layer_params + (in_params if recompute else 0)
        add(
            "collective-permute",
            layers * f * ring * nbytes,
            "weight rings, L·f·(3Ψ_l" + (" + Ψ_in" if recompute else "") + ")·B",
            weights,
        )
        rest -= layers * layer_params
    rest = max(rest, 0.0)
    if gathered_tables:  # the tables gathered whole for the lookup and the head, once
        once = psi - stack_params
        add(
            "all-gather",
            fg * (2 * stack_params + once) * nbytes,
            "FSDP weights: the stack's forward + backward, the tables and the rest once, "
            "f·(2Ψ_stack + Ψ − Ψ_stack)·B",
            weights,
        )
    else:
        add(
            "all-gather",
            2 * fg * rest * nbytes,
            "FSDP weights forward + backward, 2f·Ψ_r·B",
            weights,
        )
    if gathered_tables and fsdp > 1:
        # The state split over two axes (fsdp × context): XLA reduce-scatters the stack's
        # gradients over both, but all-reduces the rest's whole over each axis in turn (a
        # tied table's lookup and head partial sums apart), then keeps its shard.
        rest_grads = psi - stack_params + (vocab * h if tables == 1 else 0)
        add("reduce-scatter", fg * stack_params * nbytes, "FSDP gradients of the stack", grads)
        add(
            "all-reduce",
            (2 * f + 2 * (fsdp - 1) / fsdp) * rest_grads * nbytes,
            "the other gradients all-reduced over the context axis, then over fsdp, "
            "(2(D−1)/D + 2(F−1)/F)·Ψ_rest·B",
            grads,
        )
    else:
        add("reduce-scatter", fg * rest * nbytes, "FSDP gradients, f·Ψ_r·B", grads)
    if data > 1:
        add(
            "all-reduce",
            2 * psi / group * nbytes * (data - 1) / data,
            "gradient shard over data, 2(Ψ/D)·B·(d−1)/d",
            grads,
        )
    return out, notes


def positions_travel(balanced: bool, attention: str) -> bool:
    """Whether the batch's segment ids and positions travel with K/V: under a balanced
    placement, where attention reads them; not the ring's (alone or USP's), whose
    zigzag-placed one-document rows have static masks."""
    return balanced and attention not in ("ring", "usp")


def context_kv_bytes(
    attention: str,
    *,
    layers: int,
    b: float,
    s: float,
    h: float,
    h_kv: float,
    n: int,
    nbytes: float,
    recompute: bool,
    positions: bool,
    ulysses: int = 1,
) -> list[tuple[str, float, str]]:
    """The context axis's attention traffic per device and step, ``(kind, bytes, note)``.

    f = (N − 1)/N, passes P = 2 (forward, backward) or 3 with ``recompute`` (the callers
    pass it under remat ``full`` and ``save_dots``), per layer:

    - ``ring``: K and V blocks around the ring, P·f·2·b·S·h_kv·B (dK/dV travel back in
      the backward); with ``positions`` (packed rows, masked at run time) the blocks'
      positions travel with them in the forward passes with their segment ids,
      (P − 1)·f·2·b·S·4 (int32). The zigzag-placed one-document rows a balancing
      recipe's batch holds send none: their masks are static;
    - ``allgather``: K and V all-gathered each forward pass, (P − 1)·f·2·b·S·h_kv·B, and
      dK/dV reduce-scattered, f·2·b·S·h_kv·B; with ``positions`` the segment ids and
      positions gathered, (P − 1)·f·2·b·S·4;
    - ``ulysses``: 4 all-to-alls (q, k, v, the output) each pass,
      P·f·b·(S/N)·(2h + 2h_kv)·B (:func:`shardkit.nn.ulysses.ulysses_wire_bytes`), and
      with ``positions`` the segment ids and positions all-gathered, (P − 1)·f·2·b·S·4.

    - ``usp`` (Ulysses × ring; ``n`` the ring's size R, ``ulysses`` the Ulysses axis's
      U, f_U = (U − 1)/U): the all-to-alls over U of the U·R-way shards,
      P·f_U·b·(S/(U·R))·(2h + 2h_kv)·B, and the ring over R of h_kv/U heads,
      P·f·2·b·S·(h_kv/U)·B; with ``positions`` the segment ids and positions
      all-gathered over U once a step, f_U·2·b·(S/R)·4 (the recompute's gather of the
      same integers is the forward's), and travelling the ring, (P − 1)·f·2·b·S·4;
      none for the zigzag-placed one-document rows of a balancing recipe (static masks).

    ``b``: the sequences one context group holds; ``S`` the whole sequence.

    Example:
      >>> [round(v) for _, v, _ in context_kv_bytes("ulysses", layers=1, b=1, s=8, h=4,
      ...  h_kv=4, n=2, nbytes=1, recompute=False, positions=False)]
      [64]
    """
    if attention == "usp":
        return _usp_bytes(
            layers=layers,
            b=b,
            s=s,
            h=h,
            h_kv=h_kv,
            ring=n,
            ulysses=ulysses,
            nbytes=nbytes,
            passes=3 if recompute else 2,
            positions=positions,
        )
    if n <= 1:
        return []
    f = (n - 1) / n
    passes = 3 if recompute else 2
    kv = layers * f * 2 * b * s * h_kv * nbytes
    pos = layers * (passes - 1) * f * 2 * b * s * 4  # segment ids and positions, int32
    out: list[tuple[str, float, str]] = []
    if attention == "ulysses":
        a2a = passes * layers * f * b * (s / n) * (2 * h + 2 * h_kv) * nbytes
        out.append(
            ("all-to-all", a2a, f"Ulysses q/k/v/out, {passes} passes × L·f·b·(S/N)·(2h + 2h_kv)·B")
        )
        if positions:
            out.append(
                ("all-gather", pos, f"segment ids and positions, {passes - 1} passes × L·f·2·b·S·4")
            )
    elif attention == "allgather":
        out.append(
            (
                "all-gather",
                (passes - 1) * kv,
                f"K/V gathered, {passes - 1} passes × L·f·2·b·S·h_kv·B",
            )
        )
        out.append(("reduce-scatter", kv, "dK/dV, L·f·2·b·S·h_kv·B"))
        if positions:
            out.append(
                ("all-gather", pos, f"segment ids and positions, {passes - 1} passes × L·f·2·b·S·4")
            )
    else:
        out.append(
            ("collective-permute", passes * kv, f"K/V ring, {passes} passes × L·f·2·b·S·h_kv·B")
        )
        if positions:
            out.append(
                (
                    "collective-permute",
                    pos,
                    f"K/V segment ids and positions, {passes - 1} passes × L·f·2·b·S·4",
                )
            )
    return out


def _usp_bytes(*, layers, b, s, h, h_kv, ring, ulysses, nbytes, passes, positions):
    """:func:`context_kv_bytes` of USP: the Ulysses axis's all-to-alls, the ring's K/V."""
    out: list[tuple[str, float, str]] = []
    fu, fr = (ulysses - 1) / ulysses, (ring - 1) / ring
    a2a = passes * layers * fu * b * (s / (ulysses * ring)) * (2 * h + 2 * h_kv) * nbytes
    kv = passes * layers * fr * 2 * b * s * (h_kv / ulysses) * nbytes
    if a2a:
        note = f"USP: Ulysses q/k/v/out over U={ulysses}, {passes} passes × L·f_U·b·(S/(U·R))"
        out.append(("all-to-all", a2a, note + "·(2h + 2h_kv)·B"))
    if kv:
        note = f"USP: K/V ring over R={ring}, {passes} passes × L·f_R·2·b·S·(h_kv/U)·B"
        out.append(("collective-permute", kv, note))
    if positions:
        # once a step: the batch's integers, gathered alike in the forward and the
        # recompute (XLA keeps one; measured), where the ring's travel in its loop twice
        gather = layers * fu * 2 * b * (s / ring) * 4
        travel = (passes - 1) * layers * fr * 2 * b * s * 4
        if gather:
            note = "USP: segment ids and positions over U, once × L·f_U·2·b·(S/R)·4"
            out.append(("all-gather", gather, note))
        if travel:
            note = f"USP: segment ids and positions round the ring, {passes - 1} passes × L·f_R·2·b·S·4"
            out.append(("collective-permute", travel, note))
    return out


def tsp_crossover_tokens(
    *, layer_params: float, d_model: float, d: int, zigzag: bool = True, h_kv: float | None = None
) -> float:
    """Tokens b·S per replica above which a TSP layer moves fewer bytes than TP+SP's.

    Training (forward + backward, no remat): TSP f·(3Ψ_l + 4bS·h_kv) (+8bS(h + h_kv)/D
    zigzag) against TP's 8f·bSh; ``h_kv`` (K/V width) defaults to ``d_model``. Infinite
    when the zigzag overhead outweighs the saving.

    Example:
      >>> tsp_crossover_tokens(layer_params=3 * 4, d_model=1, d=8, zigzag=False)
      9.0
    """
    f, h_kv = (d - 1) / d, d_model if h_kv is None else h_kv
    per_token = 8 * f * d_model - 4 * f * h_kv - (8 * (d_model + h_kv) / d if zigzag else 0)
    return math.inf if per_token <= 0 else 3 * f * layer_params / per_token
