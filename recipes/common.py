"""What every recipe script does: train a reference model on emulated devices under
one recipe, then print the compile-time report of that layout.

This is the code to copy into your own project: a model with logical axes, a
``sk.Plan``, ``plan.init`` (state born sharded), ``plan.jit`` (an ordinary step),
``plan.shard_batch``, and the report of the very program that trained (one compile
serves both).
"""

from __future__ import annotations

import argparse

import shardkit as sk


def train_and_report(
    recipe: str, *, model: str = "gpt-tiny", devices: int = 8, seq: int = 128, **overrides
):
    """Train ``model`` (``ModelConfig`` ``overrides`` applied) under ``recipe``, then report."""
    parser = argparse.ArgumentParser(description=f"Train {model} under the {recipe!r} recipe.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=seq)
    args = parser.parse_args()

    sk.emulate_devices(8)  # before anything touches JAX; on GPUs/TPUs drop this line
    import jax

    from shardkit import train
    from shardkit.models import get
    from shardkit.workload import Workload

    net, tx = get(model, **overrides), train.adamw(1e-2)
    plan = sk.Plan(recipe, devices=jax.devices()[:devices])
    abstract = plan.abstract_init(train.init_fn(net, tx), jax.random.key(0))
    compiled, console = _train(plan, train.train_step(net, tx), abstract, net, args)
    workload = Workload.of_model(net, batch=args.batch, seq=args.seq, precision=plan.precision)
    report = sk.report.build_report(plan, compiled, abstract, workload=workload, dims=net.dims)
    console.print(report)


def train_pipelined_and_report(
    recipe: str, *, model: str = "gpt-tiny", devices: int = 8, seq: int = 64, **overrides
):
    """As ``train_and_report``, with the pipelined step (``sk.parallel``): the layer stack
    cut into stages, the batch into micro-batches, run by a schedule."""
    parser = argparse.ArgumentParser(description=f"Train {model} under the {recipe!r} recipe.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--unit", type=int, default=None)
    args = parser.parse_args()

    sk.emulate_devices(8)  # before anything touches JAX; on GPUs/TPUs drop this line
    import jax

    from shardkit import train
    from shardkit.models import get
    from shardkit.workload import Workload

    net, tx = get(model, **overrides), train.adamw(1e-2)
    plan = sk.Plan(recipe, devices=jax.devices()[:devices])
    abstract = plan.abstract_init(train.init_fn(net, tx), jax.random.key(0))
    options = {
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "virtual_stages": args.virtual_stages,
        "unit": args.unit,
    }
    pipelined = train.train_step(net, tx, plan=plan, abstract=abstract, pipeline=options)
    compiled, console = _train(plan, pipelined, abstract, net, args, pipelined.schedule)
    workload = Workload.of_model(net, batch=args.batch, seq=args.seq, precision=plan.precision)
    report = sk.report.build_report(
        plan, compiled, abstract, workload=workload, pipeline=pipelined.options
    )
    console.print(report)


def _train(plan, step_fn, abstract, net, args, schedule=None):
    """``args.steps`` steps of ``step_fn`` on the synthetic source; returns the compiled
    step (for the report) and the console it printed to."""
    from rich.console import Console

    from shardkit.data import MarkovSource

    source = MarkovSource(vocab=net.config.vocab)
    state = plan.init(abstract)  # born sharded, laid out as the abstract state says
    batch = plan.shard_batch(source.batch(args.batch, args.seq, 0))
    compiled = plan.jit(step_fn, state=abstract).lower(abstract, batch).compile()
    console = Console()
    if schedule is not None:
        console.print(schedule.timeline())
    for i in range(args.steps):
        if i:
            batch = plan.shard_batch(source.batch(args.batch, args.seq, i))
        state, metrics = compiled(state, batch)
        if i % 5 == 0 or i == args.steps - 1:
            console.print(f"step {i:3d}  loss {float(metrics['loss']):.4f}")
    console.print(f"entropy bound {source.entropy_rate():.4f} nats/token\n")
    return compiled, console
