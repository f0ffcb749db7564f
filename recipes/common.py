"""What every recipe script does: train a reference model on emulated devices under
one recipe, then print the compile-time report of that layout.

This is the code to copy into your own project: a model with logical axes, a
``sk.Plan``, ``plan.init`` (state born sharded), ``plan.jit`` (an ordinary step) and
``plan.shard_batch``.
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
    from rich.console import Console

    from shardkit import train
    from shardkit.data import MarkovSource
    from shardkit.models import get

    net, tx = get(model, **overrides), train.adamw(1e-2)
    plan = sk.Plan(recipe, devices=jax.devices()[:devices])
    state = plan.init(train.init_fn(net, tx), jax.random.key(0))
    step = plan.jit(train.train_step(net, tx))
    source = MarkovSource(vocab=net.config.vocab)
    console = Console()
    for i in range(args.steps):
        state, metrics = step(state, plan.shard_batch(source.batch(args.batch, args.seq, i)))
        if i % 5 == 0 or i == args.steps - 1:
            console.print(f"step {i:3d}  loss {float(metrics['loss']):.4f}")
    console.print(f"entropy bound {source.entropy_rate():.4f} nats/token\n")
    console.print(sk.report.build_report(plan, model=net, tx=tx, batch=args.batch, seq=args.seq))


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
    from rich.console import Console

    from shardkit import train
    from shardkit.data import MarkovSource
    from shardkit.models import get

    net, tx = get(model, **overrides), train.adamw(1e-2)
    plan = sk.Plan(recipe, devices=jax.devices()[:devices])
    abstract = plan.abstract_init(train.init_fn(net, tx), jax.random.key(0))
    state = plan.init(abstract)
    options = {
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "virtual_stages": args.virtual_stages,
        "unit": args.unit,
    }
    pipelined = train.train_step(net, tx, plan=plan, abstract=abstract, pipeline=options)
    step = plan.jit(pipelined, state=abstract)
    source = MarkovSource(vocab=net.config.vocab)
    console = Console()
    console.print(pipelined.schedule.timeline())
    for i in range(args.steps):
        batch = plan.shard_batch(source.batch(args.batch, args.seq, i))
        state, metrics = step(state, batch)
        if i % 5 == 0 or i == args.steps - 1:
            console.print(f"step {i:3d}  loss {float(metrics['loss']):.4f}")
    console.print(f"entropy bound {source.entropy_rate():.4f} nats/token\n")
    console.print(sk.report.build_report(plan, pipelined, abstract, batch))
