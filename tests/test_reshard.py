"""reshard-plan's counts: chunk shapes as orbax writes them, reads counted by hand."""

import json

import jax
import numpy as np

import shardkit as sk
from shardkit import checkpoint, train
from shardkit.cli import main
from shardkit.models import get
from shardkit.reshard import reshard_plan

INIT = train.init_fn(get("gpt-tiny"), train.adamw())


def _abstract(recipe, n):
    abstract = sk.Plan(recipe, devices=jax.devices()[:n]).abstract_init(INIT, jax.random.key(0))
    return getattr(abstract, "tree", abstract)  # an AbstractState's tree, once there is one


def test_chunk_shapes_are_the_ones_orbax_writes(tmp_path):
    plan = sk.Plan("fsdp")
    checkpoint.save(plan, tmp_path, plan.init(INIT, jax.random.key(0)), step=0, block=True)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as reader:
        written = reader.metadata(tmp_path / "0" / "state").item_metadata.tree
    planned = {
        leaf.path: leaf.chunk_shape
        for leaf in reshard_plan(_abstract("fsdp", 8), _abstract("tp", 4)).leaves
    }
    assert planned == {k: tuple(v.storage.chunk_shape) for k, v in written.items()}


def test_bytes_read_per_device_counted_by_hand():
    leaves = {
        leaf.path: leaf for leaf in reshard_plan(_abstract("fsdp", 8), _abstract("tp", 4)).leaves
    }
    # wte (256, 64) f32: fsdp@8 writes 32-row chunks; tp@4 holds 64 rows = 2 chunks.
    wte = leaves["params/wte/embedding"]
    assert (wte.chunk_shape, wte.held_per_device, wte.read_per_device) == (
        (32, 64),
        64 * 64 * 4,
        64 * 64 * 4,
    )
    # mlp/up (2, 64, 256): chunks split dim 1 in 8; tp@4 splits dim 2 in 4, so each
    # device overlaps all 8 chunks: it reads the whole array to keep a quarter of it.
    up = leaves["params/layers/mlp/up/kernel"]
    assert up.held_per_device == 2 * 64 * 64 * 4 and up.read_per_device == 2 * 64 * 256 * 4
    assert up.read_total == 4 * 2 * 64 * 256 * 4  # 4 distinct shards in one process

    to_dp = reshard_plan(_abstract("fsdp", 8), _abstract("dp", 2))
    dp = {leaf.path: leaf for leaf in to_dp.leaves}
    assert dp["params/wte/embedding"].read_per_device == 256 * 64 * 4  # replicated: all 8 chunks
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(_abstract("dp", 2)))
    assert to_dp.peak_host_bytes == state_bytes  # one process reads each replica once
    assert set(to_dp.read_by_device.values()) == {state_bytes}


def test_reshard_plan_command(capsys):
    assert main(["reshard-plan", "--from", "fsdp@8", "--to", "tp@4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["read_by_device"]) == 4 and out["processes"] == 1
    assert (
        main(["reshard-plan", "--from", "fsdp@8", "--to", "tp@4", "--processes", "2", "--json"])
        == 0
    )
    two = json.loads(capsys.readouterr().out)
    assert two["processes"] == 2 and two["peak_host_bytes"] < out["peak_host_bytes"]
    assert main(["reshard-plan", "--from", "fsdp@8", "--to", "tp@4"]) == 0
    text = capsys.readouterr().out
    assert "params/layers/mlp/up/kernel" in text and "Peak host memory" in text
    assert main(["reshard-plan", "--from", "fsdp8", "--to", "tp@4"]) == 2
    assert "expected RECIPE@DEVICES" in capsys.readouterr().err
    np.testing.assert_equal(sorted(out["held_by_device"]), sorted(two["held_by_device"]))
