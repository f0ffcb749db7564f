"""One process of a 2-process run on loopback (JAX's multi-controller runtime, gloo).

Each process owns 4 CPU devices; the mesh spans all 8. Every process passes only its own
rows of the batch to ``plan.shard_batch``. Prints the losses as JSON on the last line.

Importing this file runs nothing: ``train_losses`` is also the test's single-process
reference.
"""

import json
import sys


def train_losses(plan, process_index: int, process_count: int) -> list[float]:
    """The losses of three AdamW steps of ``gpt-tiny`` under ``plan`` on Markov batches
    (8 x 32 in all), this process passing only its own rows."""
    import jax

    from shardkit import train
    from shardkit.data import MarkovSource
    from shardkit.models import get

    model, tx = get("gpt-tiny"), train.adamw()
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx))
    source = MarkovSource(vocab=model.config.vocab)
    losses = []
    for i in range(3):
        local = source.batch(8, 32, i, process_index=process_index, process_count=process_count)
        assert local["inputs"].shape == (8 // process_count, 32)
        state, metrics = step(state, plan.shard_batch(local))
        losses.append(float(metrics["loss"]))
    return losses


def main(process_id: int, port: str, recipe: str) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    import shardkit as sk

    # Explicit coordinator, count and id; 4 emulated CPU devices here, gloo between.
    sk.distributed.initialize(
        f"localhost:{port}", num_processes=2, process_id=process_id, cpu_devices=4
    )

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    assert len(jax.local_devices()) == 4
    plan = sk.Plan(recipe)
    losses = train_losses(plan, jax.process_index(), jax.process_count())
    print(json.dumps({"process": process_id, "mesh": dict(plan.mesh.shape), "losses": losses}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
