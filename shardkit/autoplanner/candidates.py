"""The planner's search space: registered recipes × mesh factorisations × remat ×
micro-batches × pipeline schedule × logits layout × precision.

Candidates come from the recipe registry (``sk.recipes.names()``), so a recipe
registered by a user joins the search without touching the planner. Every mesh axis
of a candidate has size at least 2: a size-1 axis is another recipe (``dp_fsdp`` with
``data=1`` is ``fsdp``), already in the space.

A context-parallel recipe (``Recipe.context_state`` set: ``cp``, ``fsdp_cp``) is tried
with each attention strategy over its context axis (``ring``, ``allgather``,
``ulysses``); one with two context axes (``cp_usp``) runs USP (Ulysses × ring) on
every factorisation of the devices into a Ulysses and a ring axis, and the planner
prunes those whose Ulysses size does not divide the heads. Elsewhere ``attention`` is
``None`` (the recipe's own).

A pipelining recipe (a ``stage`` axis) is tried with each schedule in
:data:`SCHEDULES` (1F1B, interleaved over 2, 4 or 8 chunks a stage, the zero-bubble zb1
and zbv) at each micro-batch count; the planner prunes those the layers or the micro-batches
do not allow. Elsewhere ``schedule`` is ``None``.

A mixture-of-experts model (``n_experts``) searches the expert axis: every recipe that
splits the experts (its rules name ``expert``) is tried with each expert-axis size that
divides the experts and the device count, the rest of the devices in a ``data`` axis
that splits the batch with it (:func:`with_data_axis`: ``ep`` on ``data=8×expert=8``);
a dense model gets no expert candidates (on it they are ``dp``'s layout).

The logits layout is a dimension only where it changes the program: a recipe whose
activation rules split the vocabulary over an axis that also splits the tokens
(``Recipe.vocab_gather_axes``, e.g. ``fsdp``) is tried with ``logits="vocab"`` (gather
every token's hidden state of that axis) and ``logits="tokens"`` (gather the head's
weight, as the layers' are); elsewhere ``logits`` is ``None``.

Example:
  >>> from shardkit.autoplanner.candidates import factorisations
  >>> factorisations(8, 2)
  [(2, 4), (4, 2)]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from shardkit import recipes
from shardkit.rules import Rules

__all__ = [
    "Candidate",
    "INTERLEAVED_CHUNKS",
    "LOGITS",
    "PRECISIONS",
    "REMATS",
    "SCHEDULES",
    "enumerate_candidates",
    "expert_recipe",
    "factorisations",
    "with_data_axis",
]

REMATS = ("none", "save_dots", "full")
PRECISIONS = ("f32", "bf16")
LOGITS = ("vocab", "tokens")
#: The schedules a pipelining recipe is tried with. GPipe is left out: 1F1B's bubble, with
#: every micro-batch's activations held instead of at most ``2p - 1``.
SCHEDULES = ("1f1b", "interleaved", "zb1", "zbv")
#: The chunks a stage runs under ``interleaved`` (Megatron's virtual stages): more
#: chunks shrink the bubble (``(p−1)/(v·m+p−1)``) for ``v`` times the point-to-point
#: sends; the planner prunes those the layers do not split into.
INTERLEAVED_CHUNKS = (2, 4, 8)
#: The attention strategies a context-parallel recipe is tried with.
_ATTENTIONS = ("ring", "allgather", "ulysses")


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """One layout to try: a recipe on a mesh, with remat, micro-batches, pipeline
    schedule, logits layout and precision.

    ``remat`` is ``None`` for a user's model (its own code decides); ``microbatches`` and
    ``schedule`` are ``None`` unless the recipe pipelines (has a ``stage`` axis; a
    pipeline without a schedule runs 1F1B); ``logits`` is ``None`` unless the recipe's
    logits layout is a choice on this mesh (``"vocab"`` or ``"tokens"``:
    ``Recipe.with_logits``); ``chunks`` is ``None`` but for ``interleaved`` over other
    than two chunks a stage (:data:`INTERLEAVED_CHUNKS`).
    """

    recipe: str
    mesh: tuple[tuple[str, int], ...]
    remat: str | None = "none"
    microbatches: int | None = None
    precision: str = "f32"
    logits: str | None = None
    attention: str | None = None
    schedule: str | None = None
    chunks: int | None = None

    def recipe_object(self) -> recipes.Recipe:
        """The registered recipe, with this candidate's logits layout when it has one.

        Example:
          >>> Candidate("fsdp", (("fsdp", 8),), logits="tokens").recipe_object().logits
          'tokens'
        """
        recipe = recipes.get(self.recipe)
        if "data" in self.mesh_sizes and "data" not in dict(recipe.mesh_axes):
            recipe = with_data_axis(recipe)
        if self.attention is not None:
            recipe = recipe.with_attention(self.attention)
        return recipe if self.logits is None else recipe.with_logits(self.logits)

    @property
    def virtual_stages(self) -> int:
        """Chunks of the layer stack a stage runs: ``chunks`` where set, else 2 for
        interleaved and zbv, 1 for the others.

        Example:
          >>> [Candidate("pp", (("stage", 4),), schedule=s, chunks=c).virtual_stages
          ...  for s, c in (("1f1b", None), ("zbv", None), ("interleaved", 4))]
          [1, 2, 4]
        """
        if self.chunks is not None:
            return self.chunks
        return 2 if self.schedule in ("interleaved", "zbv") else 1

    @property
    def schedule_label(self) -> str | None:
        """The schedule, with its chunks where they are not its default (``interleaved×4``)."""
        if self.chunks is None or self.schedule is None:
            return self.schedule
        return f"{self.schedule}×{self.chunks}"

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_label(self) -> str:
        return "×".join(f"{a}={s}" for a, s in self.mesh)

    @property
    def label(self) -> str:
        """``fsdp_tp fsdp=16×tensor=4 remat=full bf16`` (what a table row names)."""
        parts = [self.recipe, self.mesh_label]
        if self.remat is not None:
            parts.append(f"remat={self.remat}")
        if self.microbatches is not None:
            parts.append(f"m={self.microbatches}")
        if self.schedule is not None:
            parts.append(self.schedule_label)
        if self.logits is not None:
            parts.append(f"logits={self.logits}")
        if self.attention is not None:
            parts.append(f"attention={self.attention}")
        parts.append(self.precision)
        return " ".join(parts)

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "mesh": self.mesh_sizes,
            "remat": self.remat,
            "microbatches": self.microbatches,
            "precision": self.precision,
            "logits": self.logits,
            "attention": self.attention,
            "schedule": self.schedule,
            "chunks": self.chunks,
        }

    @classmethod
    def from_json(cls, d: dict) -> Candidate:
        return cls(
            d["recipe"],
            tuple(d["mesh"].items()),
            d["remat"],
            d["microbatches"],
            d["precision"],
            d.get("logits"),
            d.get("attention"),
            d.get("schedule"),
            d.get("chunks"),
        )


def expert_recipe(recipe: recipes.Recipe) -> bool:
    """Whether ``recipe``'s rules split a mixture of experts' ``expert`` axis."""
    return any(name == "expert" for name, _ in recipe.rules.pairs())


def with_data_axis(recipe: recipes.Recipe) -> recipes.Recipe:
    """``recipe`` with a ``data`` axis in front that splits the batch next to its own
    batch axes (the state replicated over it): ``ep`` on ``data × expert``.

    Example:
      >>> r = with_data_axis(recipes.get("ep"))
      >>> r.mesh_axes, r.activation_rules.spec(("batch",))
      ((('data', -1), ('expert', -1)), P(('data', 'expert'),))
    """
    pairs = recipe.activation_rules.pairs()
    batch = next((axes for name, axes in pairs if name == "batch"), None)
    batch = (batch,) if isinstance(batch, str) else tuple(batch or ())
    rules = [("batch", ("data", *batch))] + [(n, a) for n, a in pairs if n != "batch"]
    return dataclasses.replace(
        recipe,
        mesh_axes=(("data", -1), *recipe.mesh_axes),
        activation_rules=Rules(rules),
        collectives=None,
    )


def _expert_sizes(mesh: tuple[tuple[str, int], ...], experts: int) -> bool:
    return dict(mesh).get("expert", 1) >= 2 and experts % dict(mesh)["expert"] == 0


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered ``k``-tuples of integers ≥ 2 whose product is ``n`` (``[(1,)]`` for n=k=1)."""
    if k == 1:
        return [(n,)] if n >= 2 or n == 1 else []
    out = []
    for d in range(2, n // 2 + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in factorisations(n // d, k - 1) if rest[0] >= 2)
    return out


def _microbatch_counts(stages: int, batch: int, replicas: int) -> list[int]:
    """``m ∈ {p, 2p, 4p}`` that split the per-replica batch evenly."""
    return [m for m in (stages, 2 * stages, 4 * stages) if batch % (m * replicas) == 0]


def enumerate_candidates(
    devices: int,
    batch: int,
    *,
    recipe_names: Sequence[str] | None = None,
    remats: Iterable[str | None] = REMATS,
    precisions: Iterable[str] = ("f32",),
    n_experts: int = 0,
    schedules: Iterable[str] = SCHEDULES,
) -> list[Candidate]:
    """Every candidate for ``devices`` devices, in registry order.

    A pipelining recipe gets ``m ∈ {p, 2p, 4p}`` micro-batches (those that divide the
    batch evenly over its data replicas), each with every schedule in ``schedules``
    (``interleaved`` with each of :data:`INTERLEAVED_CHUNKS`); a batch that allows none
    leaves it out here and the planner says so. A mesh on which the recipe's logits
    layout is a choice (``Recipe.vocab_gather_axes``, and no ``stage`` axis) gets both
    layouts. With
    ``n_experts`` (an MoE model) a recipe that splits the experts gets every expert-axis
    size dividing them (and a ``data`` axis for the rest of the devices); without, none.

    Example:
      >>> [c.mesh_label for c in enumerate_candidates(16, 16, recipe_names=["ep"],
      ...                                             remats=["full"], n_experts=8)]
      ['data=2×expert=8', 'data=4×expert=4', 'data=8×expert=2']
      >>> enumerate_candidates(16, 16, recipe_names=["ep"], remats=["full"])
      []
    """
    out = []
    remats, precisions, schedules = tuple(remats), tuple(precisions), tuple(schedules)
    for name in recipe_names or recipes.names():
        recipe = recipes.get(name)
        experts = expert_recipe(recipe)
        if experts and not n_experts:
            continue  # a dense model: the layout is dp's
        axes = [a for a, _ in recipe.mesh_axes]
        meshes = [tuple(zip(axes, s, strict=True)) for s in factorisations(devices, len(axes))]
        if not axes:
            meshes = [()]
        if experts and "data" not in axes:  # the expert axis, the rest of the devices data
            wide = with_data_axis(recipe)
            waxes = [a for a, _ in wide.mesh_axes]
            meshes += [
                tuple(zip(waxes, s, strict=True)) for s in factorisations(devices, len(waxes))
            ]
        if experts:
            meshes = [m for m in meshes if _expert_sizes(m, n_experts)]
            meshes = [tuple(sorted(m, key=lambda a: a[0] != "data")) for m in meshes]
        for mesh in meshes:
            sizes = tuple(s for _, s in mesh)
            stages = dict(mesh).get("stage")
            counts, scheds = [None], (None,)
            if stages:
                counts = _microbatch_counts(stages, batch, math.prod(sizes) // stages) or [None]
                scheds = schedules if counts != [None] else (None,)
            # A pipeline's head runs in its last stage's own layout, whatever the rules
            # say (dp_tp_sp_pp compiles the same program under both): no choice there.
            choice = recipe.vocab_gather_axes(dict(mesh)) and not stages
            layouts = LOGITS if choice else (None,)
            attentions = (None,)
            if recipe.context_state is not None and len(recipe.context_axes) == 1:
                attentions = _ATTENTIONS
            scheds = [
                (s, None if v == 2 else v)
                for s in scheds
                for v in (INTERLEAVED_CHUNKS if s == "interleaved" else (None,))
            ]
            for m, (schedule, chunks), remat, logits, precision, attention in itertools.product(
                counts, scheds, remats, layouts, precisions, attentions
            ):
                out.append(
                    Candidate(name, mesh, remat, m, precision, logits, attention, schedule, chunks)
                )
    return out
