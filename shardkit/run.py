"""The main job: train a model under a recipe and measure it.

Library code: it returns data and reports progress through a callback; the
``shardkit run`` command renders both.

Example:
  >>> from shardkit.run import run
  >>> result = run("gpt-tiny", "fsdp", steps=2, batch=8, seq=32)
  >>> result.mesh, len(result.losses)
  ({'fsdp': 8}, 2)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from shardkit import checkpoint, models, train
from shardkit.data import MarkovSource
from shardkit.errors import CheckpointMismatchError, ShardingError
from shardkit.packing import (
    LogNormal,
    attention_work,
    balance_permutation,
    imbalance,
    packed_batch,
    permute_rows,
)
from shardkit.parallel.cli import for_plan
from shardkit.plan import Plan
from shardkit.recipes import get as get_recipe
from shardkit.report import build_report
from shardkit.report.report import Report
from shardkit.step import PipelinedStep
from shardkit.workload import Workload

__all__ = ["DROP_WARNING", "DroppedTokensWarning", "RunResult", "run"]

#: Share of an MoE model's routed choices dropped (over capacity) above which ``run``
#: warns, once, with the load of each expert.
DROP_WARNING = 0.01


class DroppedTokensWarning(UserWarning):
    """An MoE model's experts dropped more tokens than :data:`DROP_WARNING` of them."""


StepCallback = Callable[[int, float, float], None]
BalanceCallback = Callable[[int, float, float], None]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one training run did and measured."""

    model: str
    recipe: str
    mesh: dict[str, int]
    devices: int
    platform: str
    losses: list[float]
    entropy_bound: float
    tokens_per_s: float
    memory_per_device_bytes: dict[str, int]
    report: Report
    first_step: int = 0  # > 0 when resumed: losses[0] is the loss of this step
    #: Packed runs: per step, max ÷ mean of the unmasked attention pairs per context rank,
    #: of the split trained on (balanced) and of the plain contiguous split.
    imbalance: list[float] = dataclasses.field(default_factory=list)
    imbalance_contiguous: list[float] = dataclasses.field(default_factory=list)
    context_ranks: int = 1
    #: an MoE model's routers on the last step's batch, after training: ``load`` and
    #: ``dropped`` tokens per layer and expert (``[layers][experts]``); ``None`` otherwise
    router: dict[str, list[list[float]]] | None = None

    @property
    def dropped_fraction(self) -> float | None:
        """Share of the routed choices the experts dropped (``None`` without experts)."""
        if self.router is None:
            return None
        routed = sum(map(sum, self.router["load"]))
        return sum(map(sum, self.router["dropped"])) / routed if routed else 0.0

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "report": self.report.to_json()}


def run(
    model: Any = "gpt-tiny",
    recipe: str | Plan = "fsdp",
    *,
    devices: Sequence[jax.Device] | None = None,
    steps: int = 50,
    batch: int = 8,
    seq: int = 128,
    learning_rate: float = 1e-2,
    seed: int = 0,
    on_step: StepCallback | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    save_every: int | None = None,
    pipeline: dict | None = None,
    precision: str = "f32",
    packed: LogNormal | None = None,
    balance: bool = True,
    on_balance: BalanceCallback | None = None,
) -> RunResult:
    """Train ``model`` with ``recipe`` on synthetic Markov tokens.

    Args:
      model: a reference model name (``shardkit.models.names()``), a user's
        ``package.module:factory``, or a model object (``models.get`` / ``models.load``).
      recipe: a recipe name (``shardkit.recipes.names()``) or a ready ``Plan``.
      devices: devices for the mesh when ``recipe`` is a name (default: all).
      steps, batch, seq: training length, global batch size and sequence length.
      on_step: called as ``on_step(step, loss, tokens_per_s)`` after each step.
      checkpoint_dir: save the state and the data position there after the last step
        and every ``save_every`` steps (``shardkit.checkpoint``).
      resume: continue from the latest checkpoint in ``checkpoint_dir`` (if any) up to
        ``steps`` in all; the losses are those of the steps this call runs.
      precision: ``"f32"`` or ``"bf16"`` (mixed precision) when ``recipe`` is a name
        (a ``Plan`` has its own).
      pipeline: ``{"microbatches", "schedule", "virtual_stages", "unit"}`` for a recipe with
        a ``stage`` axis (``shardkit.parallel.cli``); such recipes pipeline by default.
      packed: train on packed rows of documents with these lengths
        (:func:`shardkit.packing.packed_batch`) instead of one chain per row.
      balance: packed rows under ring or all-gather attention over ``n > 1`` context
        ranks are reordered where the batch is placed so that every rank does the same
        attention work (:func:`shardkit.packing.balance_permutation`); ``False`` keeps
        the contiguous split.
      on_balance: packed runs: called as ``on_balance(step, imbalance, contiguous)``
        with each step's max ÷ mean work per context rank, trained and contiguous.

    Returns:
      A ``RunResult`` with the loss curve, the entropy-rate lower bound on the
      loss, throughput (steps after the first), per-device memory and the full
      ``Report`` of the compiled step (collectives, analytic model, warnings).
    """
    spec = models.resolve(model) if isinstance(model, str) else model
    if isinstance(recipe, Plan) and devices is not None:
        raise ShardingError("run(recipe=Plan(...), devices=...): the plan has its mesh already.")
    if isinstance(recipe, Plan):
        plan = recipe
    else:
        plan = Plan(
            get_recipe(recipe), devices=devices, annotations=spec.annotations, precision=precision
        )
    if spec.vocab is None:
        raise ShardingError(
            f"run({spec.name}): the model gives no vocab, so no tokens can be drawn for it.\n"
            "Fix: return 'vocab': N (the token range of its inputs) from the factory."
        )
    source = MarkovSource(vocab=spec.vocab, seed=seed)
    ranks = _context_ranks(plan) if packed is not None else 1
    balances: tuple[list[float], list[float]] = ([], [])

    def batch_of(i: int) -> Any:
        if packed is None:
            return plan.shard_batch(_local_batch(source, batch, seq, i))
        rows = packed_batch(
            source,
            batch,
            seq,
            i,
            lengths=packed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        if ranks == 1:  # no context split (dense, Ulysses, no sequence axis): no balance
            return plan.shard_batch(rows)
        contiguous = imbalance(attention_work(rows["segment_ids"], rows["positions"], ranks))
        if balance:
            perm = balance_permutation(rows["segment_ids"], rows["positions"], ranks)
            rows = permute_rows(rows, perm)
        trained = imbalance(attention_work(rows["segment_ids"], rows["positions"], ranks))
        balances[0].append(trained)
        balances[1].append(contiguous)
        if on_balance is not None:
            on_balance(i, trained, contiguous)
        return plan.shard_batch(rows)

    tx = train.adamw(learning_rate)
    abstract = plan.abstract_init(train.init_fn(spec, tx), jax.random.key(seed))
    first_step, state = _resume(
        plan, abstract, checkpoint_dir, resume, steps, spec.name, batch, seq, seed, packed
    )
    if state is None:
        state = plan.init(abstract)
    first = batch_of(first_step)
    # Compile once; the same executable trains and is reported on. A recipe with a stage
    # axis pipelines (micro-batches, schedule: shardkit.parallel.cli).
    step = train.train_step(
        spec, tx, plan=plan, abstract=abstract, pipeline=for_plan(plan, pipeline)
    )
    # interleaved: the stack trained in the schedule's order, saved in layer order
    pipelined = step if isinstance(step, PipelinedStep) else None
    to_layers = pipelined.to_layers if pipelined else None
    if pipelined and pipelined.to_stored is not None:
        state = pipelined.to_stored(state)
    compiled = plan.jit(step, state=abstract).lower(state, first).compile()
    workload = Workload.of_model(spec, batch=batch, seq=seq, precision=plan.precision)
    report = build_report(
        plan,
        compiled,
        abstract,
        workload=workload,
        dims=spec.dims,
        pipeline=pipelined.options if pipelined else None,
    )

    def step_fn(state, batch):
        with jax.set_mesh(plan.mesh):
            return compiled(state, batch)

    losses: list[float] = []
    batch_i = first
    tokens_per_s = 0.0
    timed_tokens, timed_seconds = 0, 0.0
    for i in range(first_step, steps):
        batch_i = first if i == first_step else batch_of(i)
        start = time.perf_counter()
        state, metrics = step_fn(state, batch_i)
        loss = float(metrics["loss"])  # blocks until the step is done
        elapsed = time.perf_counter() - start
        if i > first_step:
            timed_tokens += batch * seq
            timed_seconds += elapsed
            tokens_per_s = timed_tokens / timed_seconds
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss, tokens_per_s)
        if checkpoint_dir and (i + 1 == steps or (save_every and (i + 1) % save_every == 0)):
            position = _data_state(spec.name, batch, seq, seed, i + 1, packed)
            saved = state if to_layers is None else to_layers(state)
            checkpoint.save(
                plan, checkpoint_dir, saved, step=i + 1, data_state=position, metrics={"loss": loss}
            )
    if checkpoint_dir:
        checkpoint.wait(checkpoint_dir)
    router = _router_stats(spec, plan, state, batch_i)
    return RunResult(
        model=spec.name,
        recipe=plan.recipe.name,
        mesh={k: int(v) for k, v in plan.mesh.shape.items()},
        devices=int(plan.mesh.devices.size),
        platform=plan.mesh.devices.flat[0].platform,
        losses=losses,
        entropy_bound=source.entropy_rate(),
        tokens_per_s=tokens_per_s,
        memory_per_device_bytes=report.memory.to_dict(),
        report=report,
        first_step=first_step,
        imbalance=balances[0],
        imbalance_contiguous=balances[1],
        context_ranks=ranks,
        router=router,
    )


def _router_stats(spec: Any, plan: Plan, state: Any, batch: dict) -> dict | None:
    """An MoE model's tokens routed and dropped per layer and expert on ``batch``; warns
    (:class:`DroppedTokensWarning`) when more than :data:`DROP_WARNING` of them drop."""
    stats_of = getattr(spec, "router_stats", None)
    if stats_of is None or getattr(getattr(spec, "config", None), "family", None) != "moe":
        return None
    stats = plan.jit(lambda p, b: (p, stats_of(p, b)), donate_state=False)(state.params, batch)[1]
    out = {k: [[float(v) for v in row] for row in stats[k]] for k in ("load", "dropped")}
    routed = sum(map(sum, out["load"]))
    dropped = sum(map(sum, out["dropped"]))
    if routed and dropped / routed > DROP_WARNING:
        per_expert = [sum(col) for col in zip(*out["load"], strict=True)]
        warnings.warn(
            f"{spec.name}: the experts dropped {dropped:,.0f} of {routed:,.0f} routed tokens "
            f"({dropped / routed:.1%} > {DROP_WARNING:.0%}) on the last batch; tokens sent to "
            f"each expert (all layers): {[round(x) for x in per_expert]}.\nFix: raise the "
            "capacity factor (capacity_factor=...), route dropless (capacity_factor=None), "
            "or raise the load-balancing loss weight (aux_loss_weight=...).",
            DroppedTokensWarning,
            stacklevel=3,
        )
    return out


def _context_ranks(plan: Plan) -> int:
    """Ranks the sequence is split over for attention (ring / all-gather; USP's ring),
    else 1 (Ulysses attends the whole sequence for a share of the heads: balanced as it
    is)."""
    recipe, shape = plan.recipe, dict(plan.mesh.shape)
    if recipe.attention not in ("ring", "allgather", "usp"):
        return 1
    return int(shape.get(recipe.balance_axis, 1))


def _local_batch(source: MarkovSource, batch: int, seq: int, step: int) -> dict:
    return source.batch(
        batch, seq, step, process_index=jax.process_index(), process_count=jax.process_count()
    )


def _data_state(
    model: str, batch: int, seq: int, seed: int, next_step: int, packed: LogNormal | None = None
) -> dict:
    """Where the data stream is: batch ``i`` is a function of (seed, i) alone (and of the
    document lengths when packed)."""
    state = {"model": model, "batch": batch, "seq": seq, "seed": seed, "next_step": next_step}
    if packed is not None:
        state["packed"] = [packed.mu, packed.sigma, packed.min_length]
    return state


def _resume(plan, abstract, directory, resume, steps, model, batch, seq, seed, packed=None):
    """``(first step, restored state or None)``."""
    if not (directory and resume and checkpoint.steps(directory)):
        return 0, None
    restored = checkpoint.restore(plan, directory, like=abstract)
    saved = restored.data_state or {}
    expected = _data_state(model, batch, seq, seed, restored.step, packed)
    differ = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
    if differ:
        shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise CheckpointMismatchError(
            f"{directory}/{restored.step} was saved by another run ({shown}); resuming would "
            "not continue it.\nFix: pass the saved values, or another --checkpoint-dir."
        )
    if restored.step >= steps:
        raise CheckpointMismatchError(
            f"{directory} already holds step {restored.step}, and --steps is {steps} in all."
            f"\nFix: pass --steps above {restored.step} to train further."
        )
    return restored.step, restored.state
