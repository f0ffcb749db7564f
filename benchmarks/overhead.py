"""Overhead: shardkit's planned step against the same step jitted by hand in plain JAX.

A = ``plan.jit(step)`` (shardings derived per call structure, contexts entered per call);
B = ``jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=0)`` written by
hand with the same ``NamedSharding``s, traced under the same mesh and rules so XLA
compiles the same program (checked: equal memory and collectives). The steps alternate A B A B in one process
(A B, then B A); the table gives the median of each and the median of the per-pair
ratios A/B. The planned step's own Python work is ~15 µs per call.

Run: python benchmarks/overhead.py [--tiny] [--steps 20]
"""

from __future__ import annotations

import statistics
import sys
import time

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
from bench_util import emit, parser  # noqa: E402

from shardkit import train  # noqa: E402
from shardkit.annotate.constrain import activation_rules, param_rules  # noqa: E402
from shardkit.data import MarkovSource  # noqa: E402
from shardkit.models import get  # noqa: E402
from shardkit.report import parse_collectives  # noqa: E402
from shardkit.report.memory import memory_per_device  # noqa: E402


def hand_written(plan, step, state, batch):
    """The same sharding, written with jax.jit and NamedSharding directly."""
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = jax.tree.map(lambda x: x.sharding, batch)

    def traced(state, batch):
        with activation_rules(plan.activation_rules), param_rules(plan.rules):
            return step(state, batch)

    with jax.set_mesh(plan.mesh):
        return jax.jit(
            traced,
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, None),
            donate_argnums=0,
        )


def measure(recipe: str, model_name: str, steps: int, seq: int) -> list:
    model, tx = get(model_name), train.adamw()
    plan = sk.Plan(recipe)
    source = MarkovSource(vocab=model.config.vocab)
    batch = plan.shard_batch(source.batch(8, seq, 0))
    step = train.train_step(model, tx)
    planned = plan.jit(step)
    state_a = plan.init(train.init_fn(model, tx), jax.random.key(0))
    state_b = plan.init(train.init_fn(model, tx), jax.random.key(0))
    manual = hand_written(plan, step, state_b, batch)
    compiled_a = planned.lower(state_a, batch).compile()
    with jax.set_mesh(plan.mesh):
        compiled_b = manual.lower(state_b, batch).compile()
    same = _signature(compiled_a) == _signature(compiled_b)
    times = {"A": [], "B": []}
    for i in range(steps + 2):  # two warm-up rounds
        # A B, then B A: slow drifts of a shared machine hit both sides alike.
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
            start = time.perf_counter()
            if name == "A":
                state_a, m = planned(state_a, batch)
            else:
                with jax.set_mesh(plan.mesh):
                    state_b, m = manual(state_b, batch)
            jax.block_until_ready(m["loss"])
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    pair = statistics.median(x / y for x, y in zip(times["A"], times["B"], strict=True))
    return [recipe, model_name, steps, a * 1e3, b * 1e3, pair, "yes" if same else "no"]


def _signature(compiled) -> tuple:
    """Memory per device and every collective (kind, bytes, group): equal for one program."""
    collectives = sorted(
        (c.kind, c.bytes, c.group_size, c.count) for c in parse_collectives(compiled.as_text())
    )
    return memory_per_device(compiled), tuple(collectives)


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    model, seq = ("gpt-tiny", 64) if args.tiny else ("gpt-tiny", 128)
    steps = 3 if args.tiny else args.steps
    recipes = ("dp",) if args.tiny else ("dp", "fsdp", "tp")
    rows = [measure(r, model, steps, seq) for r in recipes]
    emit(
        "overhead",
        "Overhead: shardkit step vs the same sharding jitted by hand (A B A B)",
        [
            "recipe",
            "model",
            "steps each",
            "shardkit ms (median)",
            "hand-written ms (median)",
            "ratio (median of pairs)",
            "same program",
        ],
        rows,
        args.out,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
