"""The analytic model of a layout: what one step *should* cost per device.

:func:`analytic_costs` gives any model's memory and wire bytes under a recipe from its
workload and state bytes, by what the layout runs (read from the recipe's rules): the
dense layouts here, a ``stage`` axis by :mod:`~shardkit.report.pipeline_analytic`, a TSP
axis by :mod:`~shardkit.report.analytic_tsp`; :func:`with_phases` sets its total to the
peak of the step's phases (:mod:`~shardkit.report.phases`); :func:`analytic_model` does
both from a model's :class:`~shardkit.dims.ModelDims`. A guide to the limit a layout can
reach, not a bound. The formulas and records are :mod:`~shardkit.report.formulas`'.

Example:
  >>> from shardkit.workload import Workload
  >>> m = analytic_costs("fsdp", {"fsdp": 8}, workload=Workload(batch=8),
  ...                    param_bytes=4e6, optimizer_bytes=8e6)
  >>> m.wire_bytes_by_kind
  {'all-gather': 7000000.0, 'reduce-scatter': 3500000.0}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.nn.loss import LOGITS
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe
from shardkit.report.analytic_tsp import positions_travel, tsp_wire_bytes
from shardkit.report.formulas import (
    AnalyticMemory,
    AnalyticModel,
    activation_bytes,
    hybrid_wire,
    logits_bytes,
    megatron_activations_per_layer,
    wire_bytes,
    wire_bytes_hybrid,
    zero_memory,
)
from shardkit.report.phases import phase_peaks
from shardkit.report.pipeline_analytic import pipeline_model
from shardkit.workload import Workload

__all__ = [
    # the records and formulas, from shardkit.report.formulas
    "AnalyticMemory",
    "AnalyticModel",
    "activation_bytes",
    "megatron_activations_per_layer",
    "wire_bytes",
    "wire_bytes_hybrid",
    "zero_memory",
    # the model
    "analytic_costs",
    "analytic_model",
    "with_phases",
    "workload_of",
]


def _vocab_head_wire(
    recipe, mesh, w, act, nb, wire, terms, vocab_tables=2, tables_all_reduced=False
) -> list[str]:
    """Add the wire of a head that computes in the vocabulary layout over a data or fsdp
    axis (:meth:`Recipe.step_activation_rules`; a tensor axis's is in :func:`~shardkit.report.formulas.hybrid_wire`'s
    TP+SP collectives of the head) to ``wire`` and ``terms``, and return its notes.

    Each device gathers the hidden states of the ``T_g`` tokens of the ``g`` devices that
    split the vocabulary, ``T_g·h·A·(g−1)/g`` forward (A: activation bytes) and as many
    reduce-scattered backward, plus the cross-entropy's 3 all-reduces of ``T_g`` f32
    statistics; in exchange the head's weight (``vocab × d_model``) computes on its
    shard: one all-gather and one reduction of it fewer. Measured against the
    ``tokens`` layout on gpt-small and llama-small over fsdp 8: −118.4 / −71.5 MiB of
    all-gathers and of reduce-scatters each, the formula −118.4 / −71.5. With
    ``vocab_tables=1`` (``xla_counts``' reading of a tied table) nothing is taken off:
    the token lookup still gathers and reduces the table.

    Over fsdp and a context axis at once (``fsdp_cp``) the states' gradient is
    all-reduced whole over each axis in turn instead, ``Σ 2(n−1)/n·T_g·h·A``. With
    ``tables_all_reduced`` (XLA's counts with the tables whole:
    :func:`~shardkit.report.analytic_tsp.tsp_wire_bytes` all-reduces each table's
    gradient over both axes) that all-reduce stands in for the table's, a tied one's too.
    """
    tokens = w.batch * w.seq
    on_vocab = _vocab_axes(recipe, mesh, w)
    splits = [a for a in recipe.vocab_gather_axes(mesh) if a in on_vocab]
    # "tsp": a context axis that splits the state by rules (cp, fsdp_cp; a TSP recipe's
    # activation rules split no vocabulary)
    gather = [a for a in splits if recipe.axis_role(a) in ("data", "fsdp", "tsp")]
    if not gather:
        return []
    g = math.prod(mesh[a] for a in gather)
    rest = [a for a in recipe.vocab_gather_axes(mesh) if a not in gather]
    t_g = recipe.gathered_tokens(mesh, tokens) / math.prod(mesh[a] for a in rest)
    frac = (g - 1) / g
    hidden, stats = t_g * w.d_model * act * frac, 3 * 2 * t_g * 4 * frac
    table = w.vocab * w.d_model * nb / recipe.parallelism(mesh).tensor
    # tied: the token lookup still gathers and reduces the table
    weight = 0.0 if vocab_tables == 1 else table * frac
    backward, reduced = ("reduce-scatter", hidden), ("reduce-scatter", weight)
    states = f"gathered forward and reduce-scattered backward, 2·T_g·h·{act}·(g−1)/g"
    weight_note = (
        "the head's weight is neither gathered nor reduced, −2·V·h·B·(g−1)/g"
        if weight
        else "the tied table still gathered and reduced for the lookup"
    )
    if {recipe.axis_role(a) for a in gather} == {"fsdp", "tsp"}:
        # fsdp × sequence (fsdp_cp; not cp_usp's two context axes, which reduce-scatter
        # it): XLA all-reduces the states' gradient whole over each axis in turn, and
        # with the tables all-reduced that stands in for the table's all-reduce over
        # both, a tied table's too. The estimate's total wire against compiled
        # programs: Llama and GPT at h 512 over 64 and 512 devices, 1.000-1.001; at h
        # 128 over fsdp 4 × sequence 2 (1,024 tokens on vocabularies of 896, 1,024 and
        # 1,152, 2,048 on 1,024), 0.994-0.999.
        rings = sum(2 * (mesh[a] - 1) / mesh[a] for a in gather)
        backward = ("all-reduce", t_g * w.d_model * act * rings)
        states = (
            f"gathered forward, T_g·h·{act}·(g−1)/g, and their gradient all-reduced over "
            f"each axis in turn, Σ 2(n−1)/n·T_g·h·{act}"
        )
        if tables_all_reduced:
            reduced = ("all-reduce", table * rings)
            weight_note = (
                "the head's weight is not gathered, −V·h·B·(g−1)/g, nor"
                if weight
                else "the tied table still gathered for the lookup; its gradient not"
            ) + " all-reduced over each axis, −Σ 2(n−1)/n·V·h·B"
    for kind, term, x in (
        ("all-gather", "logits / loss collectives", hidden),
        (backward[0], "activation collectives", backward[1]),  # the head's line
        ("all-reduce", "logits / loss collectives", stats),
        ("all-gather", "weight all-gathers", -weight),
        (reduced[0], "gradient reductions", -reduced[1]),
    ):
        _add(wire, terms, kind, term, x)
    return [
        f"vocab-split head over {'×'.join(gather)} ({g}): hidden states of T_g = {t_g:,.0f} "
        f"tokens {states}, + 3 f32 all-reduces of T_g; {weight_note}"
    ]


def _vocab_lookup_wire(recipe, mesh, w, nbytes, vocab_tables, wire, terms) -> list[str]:
    """Add the wire of a token lookup that XLA runs on the table's rows, and return its
    notes. Past a step's tokens (a vocabulary larger than ``T_g``, the tokens of the
    ``g`` devices whose shards split the table's rows), without tensor or sequence axes:

    - the table stored as fsdp shards: each device looks the tokens up on its rows and
      XLA reduce-scatters the partial rows forward, ``T_g·h·B·(g−1)/g``, and all-gathers
      their gradient backward, as many bytes; no table is gathered or reduced for the
      lookup (an untied one: one table's all-gather and reduce-scatter fewer; a tied one
      only where the head splits the vocabulary too, else the head gathers it whole and
      the lookup reads it there);
    - ZeRO-1 (the table whole, its optimizer state on data shards): the rows' gradient
      all-gathered over data and scattered into the shard, ``T_g·h·B·(d−1)/d``, in place
      of an untied table's reduce-scatter.

    Read from XLA's collectives at h 128 and vocabulary 8,192 over 1,024 tokens: fsdp 8,
    gpt and llama, a [16, 64, 128] f32 reduce-scatter from the lookup's gather and an
    all-gather in its transpose, no collective of a table's shape; llama zero1 over 4,
    the all-gather alone and no reduce-scatter of the token table."""
    par = recipe.parallelism(mesh)
    if math.prod((par.tensor, par.sequence, par.tsp)) > 1:
        return []
    stored = par.fsdp > 1
    if not stored and not (par.data_kind == "zero1" and vocab_tables == 2):
        return []
    # the axes whose shards split the table's rows: the stored ones, or the optimizer's
    rules, role = (recipe.rules, "fsdp") if stored else (recipe.optimizer_rules, "data")
    (rows_on,) = rules.spec(("vocab",))
    rows_on = rows_on if isinstance(rows_on, tuple) else (rows_on,)
    split = [a for a in rows_on if mesh.get(a, 1) > 1 and recipe.axis_role(a) == role]
    if not split:
        return []
    if stored and vocab_tables == 1 and not set(split) <= _vocab_axes(recipe, mesh, w):
        return []  # a tied table the head gathers whole: the lookup reads it there
    g = math.prod(mesh[a] for a in split)
    t_g = w.batch * w.seq / (par.data * par.fsdp) * g  # the tokens of those g devices
    if w.vocab <= t_g:
        return []
    frac = (g - 1) / g
    rows = t_g * w.d_model * nbytes * frac
    table = w.vocab * w.d_model * nbytes * frac if vocab_tables == 2 else 0.0
    moves = [
        ("all-gather", "activation collectives", rows),
        ("reduce-scatter", "gradient reductions", -table),
    ]
    if stored:
        moves += [
            ("reduce-scatter", "activation collectives", rows),
            ("all-gather", "weight all-gathers", -table),
        ]
    for kind, term, x in moves:
        _add(wire, terms, kind, term, x)
    where = f"{'×'.join(split)} ({g})"
    rows_note = (
        "reduce-scattered forward and gathered backward, 2·T_g·h·"
        if stored
        else "gradient gathered, T_g·h·"
    )
    table_note = "neither gathered nor reduced" if stored else "not reduce-scattered"
    return [
        f"token lookup on the table's rows over {where}: the rows of T_g = {t_g:,.0f} tokens "
        f"{rows_note}{nbytes}·(g−1)/g" + (f"; the lookup's table {table_note}" if table else "")
    ]


def _add(wire, terms, kind: str, term: str, x: float) -> None:
    """Add ``x`` bytes of ``kind`` to ``wire`` and of ``term`` to ``terms``."""
    wire[kind] = wire.get(kind, 0.0) + x
    terms[term] = terms.get(term, 0.0) + x


def _vocab_axes(recipe, mesh, w) -> set[str]:
    """The mesh axes that split the step's logits' vocabulary
    (:meth:`Recipe.step_activation_rules`: ``logits="auto"`` leaves it split while the
    tokens the head gathers, T_g, are at most the vocabulary)."""
    spec = recipe.step_activation_rules(mesh, tokens=w.batch * w.seq, vocab=w.vocab).spec(LOGITS)
    return set(spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],)) - {None}


def _tied_table_wire(w, nbytes, group, wire, terms) -> list[str]:
    """Add the second reduction of a tied table's gradient under a head in the tokens
    layout, where ``group`` devices (fsdp, or a context axis that splits the state) split
    the table: the token lookup's scatter-add and the head's matmul each leave a partial
    sum of it, and XLA reduce-scatters the two apart (counted in gpt's compiled fsdp and
    cp steps: two reduce-scatters of vocab × d_model; not where data replicas share the
    reduction: dp_fsdp adds the two first). ``nbytes``: bytes per value of the table
    (÷ a tensor axis that splits it)."""
    if group <= 1:
        return []
    x = w.vocab * w.d_model * nbytes * (group - 1) / group
    _add(wire, terms, "reduce-scatter", "gradient reductions", x)
    return [
        f"reduce-scatter over {group}: the tied table's head gradient apart from its "
        f"lookup's, V·h·B·(g−1)/g = {x:,.0f} B"
    ]


def _replicated_tables_wire(
    par, w, nbytes, vocab_tables, wire, terms, split_head=True
) -> list[str]:
    """Move the reductions that data replicas all-reduce whole (counted in XLA's compiled
    programs, both grids of the estimator's benchmark): under data × fsdp an untied
    token table's (its lookup's scatter-add) is all-reduced over all ``d·f`` devices at
    once, not reduce-scattered over fsdp and all-reduced over data; under data × tensor
    it is all-reduced whole over tensor, then over data (``split_head=False``: not
    reduce-scattered over tensor first, as a head in the tokens' layout has it).
    ``nbytes``: bytes per value of a ``1/(t·f)`` shard."""
    d, f, t = par.data, par.fsdp, par.tensor
    if par.data_kind == "dp" and vocab_tables == 2 and d > 1 and f > 1:
        x, g = w.vocab * w.d_model * nbytes, d * f
        moves = {
            "reduce-scatter": -f * x * (f - 1) / f,
            "all-reduce": 2 * f * x * (g - 1) / g - 2 * x * (d - 1) / d,
        }
        note = f"all-reduce over {g}: the token table's gradient, 2·V·h·B/t·(g−1)/g"
    elif par.data_kind == "dp" and vocab_tables == 2 and d > 1 and t > 1 and f == par.expert == 1:
        x = w.vocab * w.d_model * nbytes * t  # the whole table's gradient
        moves = {
            "all-reduce": 2 * x * ((t - 1) / t + (d - 1) / d) - 2 * x / t * (d - 1) / d,
            # the tokens' layout reduce-scattered it over tensor (hybrid_wire)
            "reduce-scatter": 0.0 if split_head else -x * (t - 1) / t,
        }
        note = (
            f"all-reduce over tensor ({t}), then over data ({d}): the token table's whole "
            "gradient, 2·V·h·B·((t−1)/t + (d−1)/d)"
        )
    else:
        return []
    for kind, value in moves.items():
        _add(wire, terms, kind, "gradient reductions", value)
    return [note]


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
    xla_counts: bool = False,
) -> AnalyticModel:
    """The analytic memory per device and wire bytes per step of any model under a recipe.

    What the layout runs is read from the recipe's rules (:meth:`Recipe.parallelism`),
    never from its name. State: ``param_bytes`` (and as many gradient bytes) divided by
    the degrees that shard parameters (tensor × fsdp), ``optimizer_bytes`` by those that
    shard optimizer state (× data under ZeRO-1). Wire: the ring model of
    :func:`wire_bytes_hybrid` (a layer's column-parallel projections for the tensor
    axis's collectives: ``workload.in_projections``). Activations (Megatron, Korthikanti et al. 2022, plus the
    logits) and the tensor/sequence activation traffic need the workload's dimensions;
    without them they are left out, and a note says so. The remat's recomputed forward
    re-runs the context axis's K/V traffic under ``full`` and ``save_dots`` (the
    blocks it moves are not matmul outputs), the tensor axis's under ``full`` only. A
    head in the tokens' layout (:meth:`Recipe.step_activation_rules`, ``logits="auto"``
    past ``T_g > vocab``) under TP+SP gathers the vocabulary tables over the tensor
    axis in place of the embedding's and the head's b·s·h collectives.

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
      vocab_tables: vocabulary tables in Ψ: 1 tied (GPT), 2 untied; what a TSP axis
        rings or gathers, and what TP+SP's head gathers in the tokens' layout.
      pipeline, stack_param_bytes, stack_optimizer_bytes: for a recipe with a ``stage``
        axis (required there): the pipeline's options (``{"microbatches": m, "schedule":
        ..., "virtual_stages": v, "unit": U}``) and the layer stack's share of the
        parameter and optimizer bytes; the model is
        :func:`shardkit.report.pipeline_analytic.pipeline_model` (per-stage state, the
        schedule's activations in flight, stage-to-stage and ZeroPP wire).
      tensor_rest_bytes: with ``stage`` and ``tensor`` axes, the bytes of the non-layer
        parameters split over ``tensor`` (default: ``vocab_tables`` vocabulary tables).
      xla_counts: count the weights' collectives as XLA's compiled programs move them,
        where they depart from ZeRO's 2Ψ + Ψ (the pre-compile estimate's reading; needs
        ``stack_param_bytes``): the parameters outside the scanned stack (tables, the
        final norm) gathered once a step, not twice; under context parallelism the
        tables gathered whole for the lookup and the head; a tied table's two partial
        gradients (lookup, head) reduced apart where the head gathers its weight, and
        its weight still gathered (for the lookup) where the head splits the
        vocabulary; the reductions that replicas all-reduce whole (an untied token
        table under data × fsdp, over all their devices at once, and under data ×
        tensor, over each axis in turn; under fsdp × a context axis every gradient
        outside the stack, over each axis in turn, the tables' but where a head on
        vocabulary shards all-reduces its states' gradient instead); bfloat16 values
        gathered in float32 (XLA:CPU's float normalisation: the vocabulary head's
        hidden states, ZeroPP's cast weights; a pipeline's only departure). Without
        ``stack_param_bytes`` the dense and TSP layouts keep the formulas.

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
    # xla_counts' table moves (the lookup's table gathered whole, its gradient reduced
    # whole, a tied table's two partial gradients apart) while a step's tokens are at
    # least the vocabulary; past them XLA moves the tokens' rows to the tables instead,
    # as ZeRO's counts have it, but for a lookup on fsdp's or ZeRO-1's rows
    # (_vocab_lookup_wire). Compiled at h 128 on 8 devices: GPT cp and Llama
    # dp_tp_sp within 3 % at vocab 2,048 over 1,024 tokens and 1,024 over 512 with ZeRO's
    # counts, at 1,024 over 2,048 and 4,096 over 4,096 with XLA's (ZeRO's: 0.94 and 0.85
    # on dp_tp_sp).
    w = workload
    tables_whole = xla_counts and not (w.has_dims and w.vocab > w.batch * (w.seq or 0))
    counted = xla_counts and bool(stack_param_bytes)
    # TP+SP's head on vocabulary shards (else in the tokens' layout)
    split_head = (
        not workload.has_dims
        or t == 1
        or any(recipe.axis_role(a) == "tensor" for a in _vocab_axes(recipe, mesh, workload))
    )
    if par.stage > 1:
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
            gather_bytes=bytes_per_value if xla_counts else None,
            vocab_split_head=split_head,
        )
    if par.tsp > 1:  # TSP: its own model (shardkit.report.analytic_tsp)
        return _tsp_costs(
            recipe,
            mesh,
            par,
            workload,
            param_bytes,
            optimizer_bytes,
            psi,
            bytes_per_value,
            layer_params,
            in_params,
            vocab_tables,
            stack_params=stack_param_bytes / bytes_per_value
            if tables_whole and stack_param_bytes
            else None,
            xla_counts=counted,
        )
    nb = bytes_per_value
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
        activations = w.layers * per_layer + logits_bytes(b=b, s=s, vocab=w.vocab, nbytes=nb, t=t)
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
    attention = recipe.attention if recipe.attention in ("ring", "ulysses", "usp") else "allgather"
    terms: dict[str, float] = {}
    wire, wire_notes = hybrid_wire(
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
        kv_recompute=remat in ("full", "save_dots"),
        attention=attention,
        activations=w.has_dims,
        terms=terms,
        in_projections=w.in_projections,
        positions=positions_travel(recipe.balance == "zigzag", attention),
        ulysses=_ulysses_size(recipe, mesh),
        gathered_once=(param_bytes - stack_param_bytes) / nb if counted else 0.0,
        vocab_split_head=split_head,
        tables=vocab_tables,
    )
    if w.has_dims:
        tied = 1 if counted and tables_whole and vocab_tables == 1 else 2
        head = _vocab_head_wire(recipe, mesh, w, nb if counted else act, nb, wire, terms, tied)
        if not head and tied == 1 and d * c == 1:
            head = _tied_table_wire(w, nb / t, f, wire, terms)
        if counted and not tables_whole:
            head += _vocab_lookup_wire(recipe, mesh, w, nb, vocab_tables, wire, terms)
        if counted and tables_whole:
            head += _replicated_tables_wire(
                par, w, nb / (t * f), vocab_tables, wire, terms, split_head
            )
        wire_notes += head
    notes = (
        f"Ψ = {psi:,.0f} parameters, {recipe.name} as {par}, B = {nb} bytes per value",
        f"state: params and grads {param_bytes:,.0f} B/{t * f}, optimizer "
        f"{optimizer_bytes:,.0f} B/{opt_degree} (ZeRO, Rajbhandari et al. 2019)",
        act_note,
        *wire_notes,
    )
    return AnalyticModel(memory=memory, wire_bytes_by_kind=wire, notes=notes, wire_terms=terms)


def _ulysses_size(recipe, mesh) -> int:
    """USP's Ulysses axis size (its first context axis), else 1."""
    return int(dict(mesh).get(recipe.context_axes[0], 1)) if recipe.attention == "usp" else 1


def _tsp_costs(
    recipe,
    mesh,
    par,
    w,
    param_bytes,
    optimizer_bytes,
    psi,
    nb,
    layer_params,
    in_params,
    vocab_tables=2,
    stack_params=None,
    xla_counts=False,
) -> AnalyticModel:
    """:func:`analytic_costs` for a recipe with a TSP axis (size ``par.tsp``);
    ``stack_params`` given: XLA's counts with the tables whole, ``xla_counts`` alone: XLA's
    counts past a step's tokens (the head's bf16 states moved in f32, as on XLA:CPU)."""
    fsdp = par.fsdp if par.tsp_kind == "gspmd" else 1  # fsdp_cp: ZeRO-3 over fsdp × sequence
    if par.fsdp != fsdp or par.tensor > 1 or par.sequence > 1:
        raise ShardingError(
            f"{recipe.name}: the analytic model covers TSP with data parallelism (and, by "
            f"rules only, FSDP) only, got {par}."
        )
    d, data = par.tsp, par.data
    psi = param_bytes / nb if psi is None else psi
    remat = w.remat or "none"
    memory = AnalyticMemory(
        params=param_bytes / (d * fsdp),
        grads=param_bytes / (d * fsdp),
        optimizer=optimizer_bytes / (d * fsdp),
        activations=0.0,
    )
    notes = [
        f"Ψ = {psi:,.0f} parameters, {recipe.name} as {par}, B = {nb} bytes per value",
        f"state: params, grads and optimizer / {d * fsdp} (every weight split over the "
        f"context axis{' and fsdp' if fsdp > 1 else ''})",
    ]
    if not w.has_dims:
        notes.append(
            "activations and TSP traffic not modelled: the workload gives no model "
            "dimensions (layers, d_model, seq)"
        )
        return AnalyticModel(memory=memory, wire_bytes_by_kind={}, notes=tuple(notes))
    b, s = w.batch / (data * fsdp), w.seq / d
    mode = "full_recompute" if remat == "full" else "none"
    per_layer = megatron_activations_per_layer(
        s, b, w.d_model, w.n_heads, mode=mode, bytes_per_value=activation_bytes(w.precision, nb)
    )
    logits = logits_bytes(b=b, s=s, vocab=w.vocab, nbytes=nb)
    memory = dataclasses.replace(memory, activations=w.layers * per_layer + logits)
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
        kv_recompute=remat in ("full", "save_dots"),
        h_kv=h_kv,
        vocab=w.vocab,
        tables=vocab_tables,
        terms=terms,
        attention=recipe.attention,
        zigzag=recipe.balance != "zigzag",
        fsdp=fsdp,
        ulysses=_ulysses_size(recipe, mesh),
        stack_params=stack_params,
    )
    if par.tsp_kind == "gspmd":  # cp's head in the vocabulary layout (logits="auto")
        tied = 1 if stack_params is not None and vocab_tables == 1 else 2
        act = nb if xla_counts else activation_bytes(w.precision, nb)
        head = _vocab_head_wire(
            recipe, dict(mesh), w, act, nb, wire, terms, tied, stack_params is not None
        )
        if not head and tied == 1 and data == 1 and fsdp == 1:
            head = _tied_table_wire(w, nb, d, wire, terms)
        wire_notes += head
    notes += [
        f"activations: {w.layers} layers × Megatron '{mode}' at b={b:g}, s={s:g} "
        "(Korthikanti et al. 2022), + logits b·s·V·B; a guide, not a bound",
        *wire_notes,
    ]
    return AnalyticModel(
        memory=memory, wire_bytes_by_kind=wire, notes=tuple(notes), wire_terms=terms
    )


def workload_of(
    dims: ModelDims,
    *,
    batch: int,
    seq: int,
    remat: str | None = "none",
    precision: str = "f32",
    model: str | None = None,
) -> Workload:
    """The :class:`~shardkit.workload.Workload` of a step of a model of ``dims``.

    Example:
      >>> import shardkit as sk
      >>> w = workload_of(sk.models.CONFIGS["llama-tiny"].dims(), batch=8, seq=32)
      >>> w.layers, w.n_kv_heads, w.in_projections, w.has_dims
      (2, 8, 5, True)
    """
    return Workload(
        batch=batch,
        seq=seq,
        layers=dims.layers,
        d_model=dims.d_model,
        n_heads=dims.n_heads,
        n_kv_heads=dims.n_kv_heads,
        vocab=dims.vocab,
        in_projections=dims.in_projections,
        remat=remat or "none",
        precision=precision,
        model=model,
    )


def analytic_model(
    dims: ModelDims,
    recipe: Recipe | str,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    bytes_per_value: int = 4,
    remat: str = "none",
    precision: str = "f32",
    pipeline: Mapping[str, Any] | None = None,
) -> AnalyticModel:
    """The analytic memory per device and wire bytes per step of a model of ``dims``.

    :func:`analytic_costs` with the state counted from ``dims`` for f32 Adam: params
    ``BΨ``, grads ``BΨ``, optimizer ``2BΨ`` (m and v). Activations:
    :func:`megatron_activations_per_layer` × ``n_layers`` at the per-device micro-batch
    and sequence (mode ``tp`` or ``tp_sp`` under tensor recipes, ``full_recompute``
    with remat ``"full"``), plus the logits ``b·s·vocab·B`` (÷t, vocab-parallel). This
    is a guide, not a bound: it ignores XLA's temporaries and ``save_dots`` (counted as
    no remat). ``memory.phases`` holds the peak of each phase of the step
    (:func:`with_phases`: the layer being recomputed, the chunked head and loss, the
    optimizer step) and the total is the largest.

    Args:
      dims: the model's dimensions (:class:`~shardkit.dims.ModelDims`; a reference
        model's ``config.dims()``).
      recipe: a ``Recipe`` or a registered recipe's name.
      mesh: mesh axis sizes; axes the recipe does not declare must be absent or 1.
      batch: global batch; seq: sequence length.
      bytes_per_value: bytes B of a parameter, gradient and activation value.
      remat: ``"none"``, ``"full"`` or ``"save_dots"`` (counted as none).
      precision: ``"f32"`` or ``"bf16"`` (activations at 2 bytes per value, the state
        and the logits as ``bytes_per_value``; :func:`activation_bytes`).
      pipeline: a pipelined step's options (recipes with a ``stage`` axis; see
        :func:`analytic_costs`).

    Returns:
      An :class:`AnalyticModel`.

    References:
      Rajbhandari et al. 2019; Korthikanti et al. 2022.

    Example:
      >>> import shardkit as sk
      >>> dims = sk.models.CONFIGS["gpt-tiny"].dims()
      >>> m = analytic_model(dims, "fsdp", {"fsdp": 8}, batch=8, seq=128)
      >>> m.memory.params == 4 * dims.param_count / 8
      True
    """
    psi = dims.param_count
    workload = workload_of(dims, batch=batch, seq=seq, remat=remat, precision=precision)
    ringed, ringed_in = dims.ringed_layer_params
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
        vocab_tables=dims.vocab_tables,
        pipeline=pipeline,
        stack_param_bytes=bytes_per_value * dims.layers * dims.layer_params,
        stack_optimizer_bytes=2 * bytes_per_value * dims.layers * dims.layer_params,
    )
    return with_phases(model, dims, recipe, mesh, workload)


def with_phases(
    model: AnalyticModel,
    dims: ModelDims | None,
    recipe: Recipe | str,
    mesh: Mapping[str, int],
    workload: Workload,
) -> AnalyticModel:
    """``model`` with the peak of each phase of the step as its total.

    The phase model (:func:`shardkit.report.phases.phase_peaks`) is that of a model whose
    head and loss are shardkit's chunked cross-entropy (``dims.chunked_head``, in
    ``dims.loss_chunks`` chunks). A no-op for any other model, without a sequence, or
    for a pipeline.
    """
    if dims is None or not dims.chunked_head or not workload.seq:
        return model
    if get_recipe(recipe).parallelism(mesh).stage > 1:  # the phase model knows no pipelines
        return model
    phases = phase_peaks(
        dims,
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
