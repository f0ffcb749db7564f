"""The built-in recipes. Each is a small factory returning data.

Notation below: Ψ parameters, N devices on the sharded axis, f32 Adam state
(4Ψ params + 4Ψ grads + 8Ψ moments = 16Ψ bytes when replicated).
"""

from __future__ import annotations

from shardkit.recipes.recipe import Recipe
from shardkit.rules import Rules

__all__ = [
    "cp",
    "cp_usp",
    "dp",
    "dp_fsdp",
    "dp_pp",
    "dp_tp_sp",
    "dp_tp_sp_pp",
    "dp_tsp",
    "dp_tsp_gspmd",
    "ep",
    "ep_gspmd",
    "ep_tp",
    "fsdp",
    "fsdp_ep",
    "fsdp_cp",
    "fsdp_tp",
    "pp",
    "tp",
    "tp_sp",
    "tsp",
    "tsp_gspmd",
    "zero1",
    "zeropp",
]

#: Names the reference models use for activations (see shardkit/models).
_REPLICATED_ACTIVATIONS = [("length", None), ("embed", None), ("heads", None), ("mlp", None)]

#: Logical names of the reference models; a model need not use all of them.
_REFERENCE_NAMES = frozenset(
    {"batch", "length", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "expert"}
)

#: Megatron tensor parallelism: attention heads, MLP hidden units and the vocabulary
#: split over ``tensor``. Column-parallel kernels shard their output dimension
#: (q/k/v: heads; up/gate: mlp), row-parallel kernels their input (out: heads; down:
#: mlp); the embedding and the logits are vocab-parallel.
_TENSOR = [("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]


def dp() -> Recipe:
    """Data parallel: replicate the whole state, shard the batch over ``data``.

    Use when the state fits one device. Memory per device: 16Ψ bytes (f32 Adam)
    plus activations of B/N examples. Wire: one gradient all-reduce,
    2Ψ·4·(N−1)/N bytes per device per step. A weight the model reads twice (a tied
    embedding) is all-reduced once per read unless the model reads it through
    ``sk.per_replica`` (the reference GPT does).
    """
    return Recipe(
        name="dp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-reduce"}),
        summary="data parallel: state replicated, batch sharded over 'data'",
        mesh_axes=(("data", -1),),
        rules=Rules([]),
        activation_rules=Rules([("batch", "data"), *_REPLICATED_ACTIVATIONS]),
    )


def fsdp() -> Recipe:
    """Fully sharded data parallel (ZeRO-3) over ``fsdp``.

    Parameters, gradients and optimizer state are sharded over ``fsdp`` (each
    matrix along ``embed``; the embedding along ``vocab``); XLA gathers each
    layer's weights when needed and reduce-scatters the gradients. Use when
    the state does not fit one device. Memory per device: 16Ψ/N bytes of state
    plus activations of B/N examples. Wire: 3Ψ·4·(N−1)/N bytes per device per
    step (two all-gathers of the weights, forward and backward, and one
    reduce-scatter of the gradients).

    The logits are laid out per step (``logits="auto"``,
    :meth:`~shardkit.recipes.Recipe.step_activation_rules`). Split over the vocabulary,
    like the stored embedding, each device gathers the hidden states of all the step's
    T tokens (T·d values) and the head's weight stays split; split over the tokens, each
    device gathers the head's weight (V·d) once, as it does every layer's. The first
    is cheaper while T ≤ V (GPT-2-small, 8 × 512 tokens against 50,304) and grows with
    the device count at a fixed batch per device beyond (gpt-7b, one sequence of 2,048
    per device, full remat: 7,615 MiB per device on 64 devices, 34,909 on 512); so the
    recipe splits the logits over the vocabulary while the step has at most as many
    tokens as the vocabulary, and over the tokens past that (7,842 and 6,463 MiB). The
    rule compares what is gathered (T·d against V·d, and as many wire bytes); it does
    not promise the lower total: on 64 devices the token split holds 3 % more (7,842
    against 7,615 MiB, the head not being the peak) for 4 % fewer wire bytes.
    ``fsdp().with_logits("vocab")`` or ``"tokens"`` fixes either layout.
    """
    return Recipe(
        name="fsdp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-gather", "reduce-scatter"}),
        summary="ZeRO-3: params, grads and optimizer state sharded over 'fsdp'",
        mesh_axes=(("fsdp", -1),),
        rules=Rules([("vocab", "fsdp"), ("embed", "fsdp")]),
        # The vocabulary rule applies to the logits only while a step's tokens are at most
        # the vocabulary (logits="auto", see the docstring).
        activation_rules=Rules([("vocab", "fsdp"), ("batch", "fsdp"), *_REPLICATED_ACTIVATIONS]),
    )


def zero1() -> Recipe:
    """ZeRO-1: parameters replicated, optimizer state sharded over ``data``.

    Memory per device: 4Ψ params + 4Ψ grads + 8Ψ/N moments. Wire: as DP,
    2Ψ·4·(N−1)/N (a reduce-scatter of gradients and an all-gather of updated
    parameters replace the all-reduce).
    """
    return Recipe(
        name="zero1",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-reduce", "reduce-scatter", "all-gather"}),
        summary="ZeRO-1: optimizer state sharded over 'data', params replicated",
        mesh_axes=(("data", -1),),
        rules=Rules([]),
        activation_rules=Rules([("batch", "data"), *_REPLICATED_ACTIVATIONS]),
        optimizer_rules=Rules([("vocab", "data"), ("embed", "data")]),
    )


def dp_fsdp() -> Recipe:
    """Hybrid sharded data parallel (HSDP): FSDP within ``fsdp``, replicas over ``data``.

    State is sharded over ``fsdp`` and replicated over ``data``; the batch is split over
    both. Memory per device: 16Ψ/F (F = fsdp size). Wire: 3Ψ·4·(F−1)/F within each fsdp
    group, plus an all-reduce of the Ψ/F gradient shard over ``data``:
    2(Ψ/F)·4·(D−1)/D. Use when one fsdp group is enough to fit the model and the
    network across groups is slower than within them.
    """
    return Recipe(
        name="dp_fsdp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-gather", "reduce-scatter", "all-reduce"}),
        summary="HSDP: FSDP over 'fsdp', replicas over 'data' (2×4 on 8 devices)",
        mesh_axes=(("data", 2), ("fsdp", -1)),
        rules=Rules([("vocab", "fsdp"), ("embed", "fsdp")]),
        activation_rules=Rules([("batch", ("data", "fsdp")), *_REPLICATED_ACTIVATIONS]),
    )


def tp() -> Recipe:
    """Megatron tensor parallel over ``tensor`` (Shoeybi et al. 2019).

    Column-parallel q/k/v and MLP-up kernels, row-parallel attention-out and MLP-down
    kernels, vocab-parallel embedding and loss. Memory per device: 16Ψ/T of state (the
    layer weights; norms are replicated and small). Wire per layer and step: 2
    all-reduces of b·s·h forward and 2 backward, plus the embedding and the
    vocab-parallel loss. Needs heads (and kv heads) divisible by T.
    """
    return Recipe(
        name="tp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-reduce"}),
        summary="Megatron tensor parallel: heads, MLP and vocab split over 'tensor'",
        mesh_axes=(("tensor", -1),),
        rules=Rules(_TENSOR),
        activation_rules=Rules([("batch", None), *_TENSOR, *_REPLICATED_ACTIVATIONS]),
    )


def tp_sp() -> Recipe:
    """Megatron tensor parallel plus sequence parallel (Korthikanti et al. 2022).

    As ``tp``, and the regions between the tensor-parallel blocks (LayerNorm, residual,
    dropout) are split along ``length`` over ``tensor``: activation memory per layer
    drops from sbh(10 + 24/t + 5as/(ht)) to sbh(34/t + 5as/(ht)); each all-reduce
    becomes a reduce-scatter, and the column-parallel projections' inputs are
    all-gathered, forward and again backward for the weight gradients: 6 all-gathers a
    layer, 1.25× TP's bytes with fused projections and no remat
    (:func:`shardkit.report.analytic.wire_bytes`).
    """
    return Recipe(
        name="tp_sp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"reduce-scatter", "all-gather", "all-reduce"}),
        summary="tensor + sequence parallel: 'length' split over 'tensor' between blocks",
        mesh_axes=(("tensor", -1),),
        rules=Rules(_TENSOR),
        activation_rules=Rules(
            [("batch", None), *_TENSOR, ("length", "tensor"), *_REPLICATED_ACTIVATIONS]
        ),
    )


def fsdp_tp() -> Recipe:
    """FSDP over ``fsdp`` combined with Megatron TP over ``tensor`` (2×4 on 8 devices).

    Each weight is split over ``tensor`` the Megatron way and its other (``embed``)
    dimension over ``fsdp``. Memory per device: 16Ψ/(F·T). Wire: FSDP's 3(Ψ/T)·4·(F−1)/F
    plus TP's activation all-reduces over ``tensor`` for a batch of B/F.
    """
    return Recipe(
        name="fsdp_tp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-gather", "reduce-scatter", "all-reduce"}),
        summary="FSDP over 'fsdp' × Megatron TP over 'tensor' (2×4 on 8 devices)",
        mesh_axes=(("fsdp", -1), ("tensor", 4)),
        rules=Rules([*_TENSOR, ("embed", "fsdp")]),
        activation_rules=Rules([("batch", "fsdp"), *_TENSOR, *_REPLICATED_ACTIVATIONS]),
    )


def dp_tp_sp() -> Recipe:
    """Data parallel over ``data`` × tensor + sequence parallel over ``tensor`` (2×4).

    Megatron's usual layout inside and across nodes: TP+SP within a node (``tensor``),
    replicas across (``data``). Wire: TP+SP's reduce-scatters and all-gathers of
    activations over ``tensor``, plus an all-reduce of the Ψ/T gradient over ``data``.
    """
    return Recipe(
        name="dp_tp_sp",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"reduce-scatter", "all-gather", "all-reduce"}),
        summary="data parallel × tensor + sequence parallel (2×4 on 8 devices)",
        mesh_axes=(("data", -1), ("tensor", 4)),
        rules=Rules(_TENSOR),
        activation_rules=Rules(
            [("batch", "data"), *_TENSOR, ("length", "tensor"), *_REPLICATED_ACTIVATIONS]
        ),
    )


def cp() -> Recipe:
    """Context parallel: the sequence split over ``sequence``, ring attention, state ZeRO-3.

    Every activation is split along ``length``; attention passes K/V blocks around the
    ring (``jax.lax.ppermute``, online softmax), so no device ever holds a [seq, seq]
    score matrix. The tokens are placed in the zigzag order once per step
    (``balance="zigzag"``, :mod:`shardkit.balance`: every rank does the same causal
    work, no layer reorders). Parameters, gradients and Adam state are split over
    ``sequence`` as FSDP splits them over ``fsdp`` (``context_state="sharded"``): 16Ψ/N
    bytes per device, each layer's weights all-gathered where used (forward, and again
    backward) and the gradients reduce-scattered, 3Ψ·4·(N−1)/N. Attention adds, per
    layer and pass, N−1 permutes of the local K/V block, 2·b·(s/N)·h_kv·4 bytes each.
    ``with_context_state("replicated")`` keeps the whole state on every device and
    all-reduces the gradients (2Ψ·4·(N−1)/N); ``with_attention("allgather")`` gathers
    K/V instead, ``with_attention("ulysses")`` exchanges heads (:mod:`shardkit.nn.ulysses`).
    """
    return Recipe(
        name="cp",
        optional_names=_REFERENCE_NAMES,
        summary="context parallel: 'length' split over 'sequence', ring attention, ZeRO-3",
        mesh_axes=(("sequence", -1),),
        rules=Rules([("vocab", "sequence"), ("embed", "sequence")]),
        # The logits split over the vocabulary, as the stored tables, while a step's tokens
        # are at most the vocabulary (logits="auto", as fsdp): no device gathers a table.
        activation_rules=Rules(
            [
                ("vocab", "sequence"),
                ("batch", None),
                ("length", "sequence"),
                *_REPLICATED_ACTIVATIONS,
            ]
        ),
        attention="ring",
        balance="zigzag",
        context_state="sharded",
    )


def fsdp_cp() -> Recipe:
    """FSDP over ``fsdp`` × context parallel over ``sequence`` (4×2 on 8 devices).

    The batch split over ``fsdp`` and each sequence over ``sequence`` (zigzag order,
    ring attention); the state split over both (ZeRO-3 over the 8 devices that split
    the tokens: 16Ψ/8). ``with_context_state("replicated")`` splits it over ``fsdp``
    only. For long sequences on models that need FSDP.
    """
    return Recipe(
        name="fsdp_cp",
        optional_names=_REFERENCE_NAMES,
        summary="FSDP over 'fsdp' × context parallel over 'sequence' (4×2 on 8 devices)",
        mesh_axes=(("fsdp", -1), ("sequence", 2)),
        rules=Rules([("vocab", ("fsdp", "sequence")), ("embed", ("fsdp", "sequence"))]),
        activation_rules=Rules(
            [
                ("vocab", ("fsdp", "sequence")),
                ("batch", "fsdp"),
                ("length", "sequence"),
                *_REPLICATED_ACTIVATIONS,
            ]
        ),
        attention="ring",
        balance="zigzag",
        context_state="sharded",
    )


def cp_usp() -> Recipe:
    """Context parallel over two axes: Ulysses over ``ulysses`` × ring over ``sequence``
    (USP, Fang & Zhao 2024; 4×2 on 8 devices: ring 4, Ulysses 2).

    Each sequence is split over ``sequence`` × ``ulysses`` (ring-major: ring rank r holds
    the r-th s/R block, cut U ways); attention runs all-to-alls over ``ulysses`` (each
    device gets its ring rank's s/R tokens of h/U heads), ring attention over
    ``sequence`` with those heads, and all-to-alls back. Per layer and pass the
    all-to-alls move (U−1)/U·b·(s/(U·R))·(2h + 2h_kv)·4 bytes per device, the ring
    (R−1)/R·2·b·s·(h_kv/U)·4. The tokens are placed in the zigzag order over the ring's
    R ranks (``balance="zigzag"``); the state is ZeRO-3 over all U·R devices, as ``cp``.
    Ulysses needs U to divide the (K/V) heads and costs less per byte on a fast link;
    the ring takes any count, its traffic hides behind the blocks' compute: put
    ``ulysses`` within a node and ``sequence`` across
    (``with_mesh({"sequence": -1, "ulysses": 4})``).
    """
    axes = ("sequence", "ulysses")
    return Recipe(
        name="cp_usp",
        optional_names=_REFERENCE_NAMES,
        summary="context parallel, Ulysses over 'ulysses' × ring over 'sequence', ZeRO-3",
        mesh_axes=(("sequence", -1), ("ulysses", 2)),
        rules=Rules([("vocab", axes), ("embed", axes)]),
        activation_rules=Rules(
            [("vocab", axes), ("batch", None), ("length", axes), *_REPLICATED_ACTIVATIONS]
        ),
        attention="usp",
        attention_axis=("ulysses", "sequence"),
        balance="zigzag",
        context_state="sharded",
    )


#: TSP: every weight's ``embed`` dimension (the embedding's ``vocab``) over ``tsp``, as
#: FSDP does; every activation's ``length`` over the same axis, as context parallelism.
_TSP_PARAMS = [("vocab", "tsp"), ("embed", "tsp")]
_TSP_ACTIVATIONS = [("length", "tsp"), *_REPLICATED_ACTIVATIONS]
_TSP_COLLECTIVES = frozenset({"all-gather", "reduce-scatter", "all-reduce", "collective-permute"})


def tsp() -> Recipe:
    """TSP: tensor and sequence parallelism folded onto one axis ``tsp`` (size D).

    Shyam, Golubeva, Anthony (2026), arXiv:2604.26294. Each device holds 1/D of every
    weight (its ``embed`` rows or columns) and S/D of every sequence, so state *and*
    activations fall by D, and the head count need not divide D (gpt-small's 12 heads
    run on 8 devices). The layers run the paper's schedules (``layer_schedule="tsp"``,
    :mod:`shardkit.nn.tsp`): each projection passes the layer's weight shards
    around a ring (``ppermute``) while it multiplies the shard it holds, so at most
    two shards of a weight are live; attention is zigzag ring attention over ``tsp``.
    ``tsp_gspmd`` is the same layout left to XLA (it all-gathers each layer's weights).

    Analytic model (derived in :mod:`shardkit.report.analytic_tsp`; f = (D−1)/D, B bytes
    per value, Ψ_l a layer's attention and MLP kernels, b·S the tokens of one replica,
    h the model width, h_kv the K/V width that travels (n_kv_heads·head_dim: GQA's
    K/V cross the ring with their own heads), V the vocabulary), per layer and device:

    - state: (params + grads + 2 Adam moments) / D; activations: Megatron's per-layer
      count at S/D tokens (under full remat: one layer input, b·(S/D)·h·B).
    - wire, paper's schedule: forward f·Ψ_l·B (weight shards) + f·2·b·S·h_kv·B (K/V
      blocks); backward 2f·Ψ_l·B (the shards again, gradient shards home) +
      f·2·b·S·h_kv·B (dK/dV home): f·(3Ψ_l + 4·b·S·h_kv)·B in all, + f·Ψ_in·B and one
      more K/V pass under full remat (Ψ_in: q/k/v, up, gate). The zigzag layout adds
      4·(h + h_kv)·b·S·B/D a pass. Once per step, the head's vocabulary shards travel
      a ring too (3f·V·h·B, :mod:`shardkit.nn.tsp_head`) and the lookup's
      partial embeddings a ring reduce-scatter (f·b·S·h·B each way): no device holds
      a whole vocabulary table.
    - wire, ``tsp_gspmd``: FSDP's 3f·Ψ·B (all-gather forward and backward,
      reduce-scatter) for the layers, the head gathered once (2f·V·h·B with its
      gradient), XLA's vocab-parallel lookup and the same K/V ring.
    - TP+SP moves 8f·b·S·h·B a layer (4 all-reduces' worth), so the paper's schedule
      moves fewer bytes for b·S > 3fΨ_l/(8f·h − 4f·h_kv − 8(h + h_kv)/D) tokens
      (``analytic_tsp.tsp_crossover_tokens``; the paper's 3Ψ_l/(4h) with h_kv = h,
      without zigzag).

    Use for long sequences on models whose weights do not fit one device, when the
    interconnect is a ring (or all-to-all) among D devices.
    """
    return Recipe(
        name="tsp",
        optional_names=_REFERENCE_NAMES,
        collectives=_TSP_COLLECTIVES,
        summary="TSP: weights and sequence both split over 'tsp', weight-shard ring",
        mesh_axes=(("tsp", -1),),
        rules=Rules(_TSP_PARAMS),
        activation_rules=Rules([("batch", None), *_TSP_ACTIVATIONS]),
        attention="ring",
        attention_axis="tsp",
        layer_schedule="tsp",
    )


def tsp_gspmd() -> Recipe:
    """TSP's layout by rules only: weights and sequence over ``tsp``, XLA does the rest.

    The same rules as ``tsp``, ``layer_schedule="gspmd"``: XLA all-gathers each layer's
    weights (as FSDP: the whole layer live at once), ring attention moves K/V. The
    baseline the paper's schedules are measured against.
    """
    return Recipe(
        name="tsp_gspmd",
        optional_names=_REFERENCE_NAMES,
        collectives=_TSP_COLLECTIVES,
        summary="TSP layout by rules only: XLA all-gathers each layer's weights over 'tsp'",
        mesh_axes=(("tsp", -1),),
        rules=Rules(_TSP_PARAMS),
        activation_rules=Rules([("batch", None), *_TSP_ACTIVATIONS]),
        attention="ring",
        attention_axis="tsp",
    )


def dp_tsp() -> Recipe:
    """Data parallel over ``data`` × TSP over ``tsp`` (2×4 on 8 devices).

    Each TSP group of D devices holds one replica of the state, sharded D ways, and
    trains on its share of the batch; gradients of the Ψ/D shard are all-reduced over
    ``data``: 2(Ψ/D)·B·(N−1)/N per device. The layers run the paper's schedules.
    """
    return Recipe(
        name="dp_tsp",
        optional_names=_REFERENCE_NAMES,
        collectives=_TSP_COLLECTIVES,
        summary="data parallel × TSP (2×4 on 8 devices), weight-shard ring",
        mesh_axes=(("data", -1), ("tsp", 4)),
        rules=Rules(_TSP_PARAMS),
        activation_rules=Rules([("batch", "data"), *_TSP_ACTIVATIONS]),
        attention="ring",
        attention_axis="tsp",
        layer_schedule="tsp",
    )


def dp_tsp_gspmd() -> Recipe:
    """``dp_tsp`` by rules only (XLA all-gathers each layer's weights over ``tsp``)."""
    return Recipe(
        name="dp_tsp_gspmd",
        optional_names=_REFERENCE_NAMES,
        collectives=_TSP_COLLECTIVES,
        summary="data parallel × TSP layout by rules only (2×4 on 8 devices)",
        mesh_axes=(("data", -1), ("tsp", 4)),
        rules=Rules(_TSP_PARAMS),
        activation_rules=Rules([("batch", "data"), *_TSP_ACTIVATIONS]),
        attention="ring",
        attention_axis="tsp",
    )


# -- expert parallelism (shardkit.nn.moe) ---------------------------------------------------
#: A mixture-of-experts layer's experts split over ``expert``, the batch too.
_EXPERT = [("expert", "expert")]
_EXPERT_ACTIVATIONS = [("batch", "expert"), *_REPLICATED_ACTIVATIONS]
_EXPERT_COLLECTIVES = frozenset({"all-to-all", "all-reduce"})


def ep() -> Recipe:
    """Expert parallel: an MoE layer's experts split over ``expert``, the rest data parallel.

    Each device holds E/N experts (their weights, gradients and Adam state: 16·Ψ_e/N
    bytes) and a whole replica of the dense part (16·Ψ_d), and trains on B/N sequences.
    Each MoE layer dispatches its tokens to their experts with an all-to-all over
    ``expert`` inside ``shard_map`` and brings the outputs home with another
    (:mod:`shardkit.nn.moe`): per device and layer, forward, 2·(N−1)/N·(B/N)·E·C·d·B
    bytes (C = ⌈cf·S·k/E⌉ slots per expert and sequence), and as many backward
    (:func:`shardkit.report.analytic_moe.dispatch_bytes`); the dense gradients are
    all-reduced, 2Ψ_d·4·(N−1)/N. ``ep_gspmd`` is the same layout left to XLA.
    """
    return Recipe(
        name="ep",
        optional_names=_REFERENCE_NAMES,
        collectives=_EXPERT_COLLECTIVES,
        summary="experts over 'expert' (all-to-all dispatch), the rest DP",
        mesh_axes=(("expert", -1),),
        rules=Rules(_EXPERT),
        activation_rules=Rules(_EXPERT_ACTIVATIONS),
        expert_dispatch="alltoall",
    )


def ep_gspmd() -> Recipe:
    """``ep``'s layout by rules only: the one-hot dispatch einsums left to XLA.

    The same rules as ``ep``; XLA chooses how the tokens, split over ``expert`` by the
    batch, meet the experts, split over it too (on XLA:CPU: all-gathers of the tokens and
    all-to-alls). The baseline ``ep`` is measured against.
    """
    return Recipe(
        name="ep_gspmd",
        optional_names=_REFERENCE_NAMES,
        collectives=_EXPERT_COLLECTIVES | {"all-gather"},
        summary="ep's layout by rules only: XLA places the dispatch",
        mesh_axes=(("expert", -1),),
        rules=Rules(_EXPERT),
        activation_rules=Rules(_EXPERT_ACTIVATIONS),
    )


def fsdp_ep() -> Recipe:
    """Experts over ``expert``, the dense weights and all the rest of the state FSDP over it.

    One axis: each expert's weights live whole on one device (E/N per device), every
    dense matrix 1/N per device along ``embed`` (the tables along ``vocab``); the state
    is 16·(Ψ_e + Ψ_d)/N per device. Wire: ``ep``'s all-to-alls, and FSDP's all-gathers
    and reduce-scatter of the dense part, 3Ψ_d·4·(N−1)/N.
    """
    return Recipe(
        name="fsdp_ep",
        optional_names=_REFERENCE_NAMES,
        collectives=frozenset({"all-to-all", "all-gather", "reduce-scatter"}),
        summary="experts over 'expert' (all-to-all), the rest FSDP",
        mesh_axes=(("expert", -1),),
        rules=Rules([*_EXPERT, ("vocab", "expert"), ("embed", "expert")]),
        activation_rules=Rules(_EXPERT_ACTIVATIONS),
        expert_dispatch="alltoall",
    )


def ep_tp() -> Recipe:
    """Experts over ``expert``, each expert's MLP and the dense layers Megatron TP over
    ``tensor`` (expert 4 × tensor 2 on 8 devices).

    Inside the dispatch each device runs its experts' slice of ``mlp`` and the partial
    outputs are all-reduced over ``tensor`` before the all-to-all home; the tokens are
    split over ``expert`` only (replicated over ``tensor``).
    """
    return Recipe(
        name="ep_tp",
        optional_names=_REFERENCE_NAMES,
        collectives=_EXPERT_COLLECTIVES,
        summary="experts over 'expert' × TP over 'tensor' (4×2 on 8)",
        mesh_axes=(("expert", -1), ("tensor", 2)),
        rules=Rules([*_EXPERT, *_TENSOR]),
        activation_rules=Rules([("batch", "expert"), *_TENSOR, *_REPLICATED_ACTIVATIONS]),
        expert_dispatch="alltoall",
    )


# -- pipeline recipes (shardkit.parallel) ---------------------------------------------------
#: The scanned layer stack's leading ``layers`` axis cut into stages.
_STAGE = [("layers", "stage")]


def pp() -> Recipe:
    """Pipeline parallel: the layer stack cut into ``p`` stages over ``stage``.

    Each stage holds ``L/p`` layers' parameters, gradients and Adam state; the embedding,
    head and final norm are replicated. Train with ``shardkit.train.train_step`` (micro-batches
    and a schedule: ``gpipe``, ``1f1b``, ``interleaved``). Wire per step: one activation
    ``b_micro·s·h`` forward and one gradient backward between neighbouring stages per
    micro-batch and tick (collective-permutes), plus an all-reduce over ``stage`` of the
    non-layer parameters' gradient. Bubble ``(p − 1)/(m + p − 1)``.
    """
    return Recipe(
        name="pp",
        optional_names=_REFERENCE_NAMES | {"layers"},
        collectives=frozenset({"collective-permute", "all-reduce"}),
        summary="pipeline: the layer stack cut into stages over 'stage'",
        mesh_axes=(("stage", -1),),
        rules=Rules(_STAGE),
        activation_rules=Rules([("batch", None), *_REPLICATED_ACTIVATIONS]),
    )


def dp_pp() -> Recipe:
    """Data parallel over ``data`` × pipeline over ``stage`` (stage 2 × data 4 on 8 devices).

    As ``pp``, each stage replicated over ``data``; the batch split over ``data``, each
    stage's gradient all-reduced over ``data``: 2·(Ψ/p)·4·(D − 1)/D bytes.
    """
    return Recipe(
        name="dp_pp",
        optional_names=_REFERENCE_NAMES | {"layers"},
        collectives=frozenset({"collective-permute", "all-reduce"}),
        summary="data parallel × pipeline (stage 2 × data 4 on 8 devices)",
        mesh_axes=(("stage", 2), ("data", -1)),
        rules=Rules(_STAGE),
        activation_rules=Rules([("batch", "data"), *_REPLICATED_ACTIVATIONS]),
    )


def zeropp() -> Recipe:
    """ZeroPP (Tang et al. 2024): pipeline over ``stage`` × ZeRO-3 over ``fsdp``, no tensor axis.

    Each stage's parameters, gradients and Adam state are sharded over ``fsdp`` (16Ψ/(p·F)
    bytes per device); the batch is split over ``fsdp`` (and ``data`` if the mesh has
    ``recipe.with_mesh({"data": 2})``). A stage's weights are all-gathered once per
    scheduling unit of ``U`` micro-batches and their gradients reduce-scattered once:
    2·(Ψ/p)·4·(F − 1)/F·⌈m/U⌉ bytes per device per step
    (:mod:`shardkit.report.pipeline_analytic`); under ``precision="bf16"`` the gathers
    move the weights already cast to bfloat16, 2 bytes a value. Stage 2 × fsdp 4 on 8
    devices.
    """
    return Recipe(
        name="zeropp",
        optional_names=_REFERENCE_NAMES | {"layers"},
        collectives=frozenset({"collective-permute", "all-gather", "reduce-scatter", "all-reduce"}),
        summary="ZeroPP: pipeline × ZeRO-3 within each stage (stage 2 × fsdp 4 on 8 devices)",
        mesh_axes=(("data", 1), ("stage", 2), ("fsdp", -1)),
        rules=Rules([*_STAGE, ("vocab", "fsdp"), ("embed", "fsdp")]),
        activation_rules=Rules(
            [("batch", ("data", "fsdp")), ("vocab", None), *_REPLICATED_ACTIVATIONS]
        ),
    )


def dp_tp_sp_pp() -> Recipe:
    """3D parallelism: data × pipeline × tensor + sequence parallel (2 × 2 × 2 on 8 devices).

    Megatron-LM's layout: the layer stack cut into stages over ``stage`` (as ``pp``),
    each stage's layers split the Megatron way over ``tensor`` with the regions between
    them split along ``length`` (as ``tp_sp``), replicas over ``data``. The pipeline
    engine is manual over ``stage`` and ``data`` only; XLA shards inside each stage by
    the rules (:func:`shardkit.parallel.pipeline.mesh_value_and_grad`'s ``auto_axes``).
    Memory per device: 16Ψ/(p·T) of layer state (the embedding and head vocab-parallel
    over ``tensor``, replicated over ``stage``). Wire per step: the pipeline's permutes
    of each micro-batch's activation, b_micro·s·h/T (split along the sequence over
    ``tensor``); TP+SP's reduce-scatters and all-gathers of activations over ``tensor``;
    the stage's Ψ/(p·T) gradient all-reduced over ``data``. Train with
    ``shardkit.train.train_step``.
    """
    return Recipe(
        name="dp_tp_sp_pp",
        optional_names=_REFERENCE_NAMES | {"layers"},
        collectives=frozenset({"collective-permute", "reduce-scatter", "all-gather", "all-reduce"}),
        summary="3D: data × pipeline × tensor + sequence parallel (2×2×2 on 8 devices)",
        mesh_axes=(("data", -1), ("stage", 2), ("tensor", 2)),
        rules=Rules([*_STAGE, *_TENSOR]),
        activation_rules=Rules(
            [("batch", "data"), *_TENSOR, ("length", "tensor"), *_REPLICATED_ACTIVATIONS]
        ),
    )
