"""Checkpoints restore bit for bit into other layouts, and refuse what they do not hold."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import checkpoint, errors, train
from shardkit.models import get

ROOT = Path(__file__).resolve().parents[1]

# (recipe, number of devices) the fsdp@8 checkpoint is restored into.
LAYOUTS = [("tp", 4), ("dp", 2), ("dp_fsdp", 8)]


def _trained(model_name):
    """fsdp@8 state (params and AdamW moments) with every element distinct, so a permuted
    or misplaced chunk changes the bits; and its init. Built from the planned layout
    (no init or training step to compile)."""
    model, tx = get(model_name), train.adamw()
    init = train.init_fn(model, tx)
    plan = sk.Plan("fsdp")
    abstract = plan.abstract_init(init, jax.random.key(0)).tree

    def distinct(i, x):
        values = (np.arange(x.size) + 1000 * i).reshape(x.shape) / 7
        return jax.device_put(values.astype(x.dtype), x.sharding)

    leaves, treedef = jax.tree.flatten(abstract)
    return plan, init, jax.tree.unflatten(treedef, [distinct(i, x) for i, x in enumerate(leaves)])


@pytest.mark.parametrize("model_name", ["gpt-tiny", "llama-tiny"])
def test_restore_into_three_other_layouts_is_bit_identical(model_name, tmp_path):
    plan, init, state = _trained(model_name)
    saved = {
        k: np.asarray(v)
        for k, v in zip(checkpoint.leaf_paths(state), jax.tree.leaves(state), strict=True)
    }
    saved_shardings = [x.sharding for x in jax.tree.leaves(state)]
    checkpoint.save(plan, tmp_path, state, step=1, data_state={"next_batch": 1})
    for recipe, n in LAYOUTS:
        new = sk.Plan(recipe, devices=jax.devices()[:n])
        abstract = new.abstract_init(init, jax.random.key(0))
        restored = checkpoint.restore(new, tmp_path, like=abstract)  # an AbstractState
        like = abstract.tree
        assert restored.step == 1 and restored.data_state == {"next_batch": 1}
        assert jax.tree.structure(restored.state) == jax.tree.structure(state)
        names = checkpoint.leaf_paths(restored.state)
        leaves, targets = jax.tree.leaves(restored.state), jax.tree.leaves(like)
        for name, x, target in zip(names, leaves, targets, strict=True):
            assert x.sharding == target.sharding, name  # the new plan's layout
            assert set(x.sharding.device_set) == set(jax.devices()[:n]), name
            got = np.asarray(x)
            assert got.dtype == saved[name].dtype
            assert got.tobytes() == saved[name].tobytes(), name  # bit for bit
        changed = [a != b.sharding for a, b in zip(saved_shardings, leaves, strict=True)]
        assert all(changed)  # every leaf is laid out anew (another mesh)


def test_restore_takes_a_tree_or_an_abstract_state_and_the_latest_step(tmp_path):
    plan = sk.Plan("fsdp", annotations=[("w$", ("embed", None))])
    abstract = plan.abstract_init(lambda: {"w": jnp.zeros((8, 8))})
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), abstract.tree["w"].sharding)}
    for step in (3, 7):
        checkpoint.save(plan, tmp_path, {"w": state["w"] * step}, step=step)

    restored = checkpoint.restore(plan, tmp_path, like=abstract)
    assert restored.step == 7
    np.testing.assert_array_equal(
        np.asarray(restored.state["w"]), np.arange(64.0).reshape(8, 8) * 7
    )
    earlier = checkpoint.restore(plan, tmp_path, like=abstract.tree, step=3)
    np.testing.assert_array_equal(np.asarray(earlier.state["w"]), np.arange(64.0).reshape(8, 8) * 3)


def test_restore_refuses_an_abstract_state_of_another_mesh(tmp_path):
    plan = sk.Plan("fsdp", annotations=[("w$", ("embed", None))])
    checkpoint.save(plan, tmp_path, {"w": jnp.zeros((8, 8))}, step=1, block=True)
    other = sk.Plan("fsdp", devices=jax.devices()[:4], annotations=[("w$", ("embed", None))])
    like = other.abstract_init(lambda: {"w": jnp.zeros((8, 8))})
    with pytest.raises(
        sk.ShardingError,
        match=r"(?s)planned on mesh \{'fsdp': 4\}, not on the plan's \{'fsdp': 8\}",
    ):
        checkpoint.restore(plan, tmp_path, like=like)
    assert checkpoint.restore(other, tmp_path, like=like).step == 1


def test_keep_last_n_and_best_n_by_metric(tmp_path):
    plan = sk.Plan("dp")
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0}  # step 2 is the best
    for step, loss in losses.items():
        checkpoint.save(
            plan,
            tmp_path,
            {"x": jnp.full((8,), loss)},
            step=step,
            metrics={"loss": loss},
            keep=2,
            keep_best=1,
        )
    checkpoint.wait(tmp_path)
    assert checkpoint.steps(tmp_path) == [2, 4, 5]


def _small_checkpoint(tmp_path):
    plan = sk.Plan("fsdp")
    shard = plan.shardings({"w": jnp.zeros((256, 256))})["w"]
    state = {
        "b": jnp.ones((8,)),
        "w": jax.device_put(jnp.arange(256.0 * 256).reshape(256, 256), shard),
    }
    checkpoint.save(plan, tmp_path, state, step=5, block=True)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    return plan, like


@pytest.mark.parametrize(
    "change, names",
    [
        (
            lambda like: {
                **like,
                "w": jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=like["w"].sharding),
            },
            ["w: checkpoint (256, 256) float32, like (256, 128) float32"],
        ),
        (
            lambda like: {
                **like,
                "w": jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=like["w"].sharding),
            },
            ["w: checkpoint (256, 256) float32, like (256, 256) bfloat16"],
        ),
        (lambda like: {"w": like["w"]}, ["leaf(s) of the checkpoint are not in `like`: b"]),
        (
            lambda like: {**like, "extra": like["b"]},
            ["leaf(s) of `like` are not in the checkpoint: extra"],
        ),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_mismatched_checkpoint_names_the_leaf(tmp_path, change, names):
    plan, like = _small_checkpoint(tmp_path)
    with pytest.raises(errors.CheckpointMismatchError) as e:
        checkpoint.restore(plan, tmp_path, like=change(like))
    assert isinstance(e.value, sk.ShardingError)
    for name in names:
        assert name in str(e.value)


def test_another_model_is_a_mismatch(tmp_path):
    plan, _, state = _trained("gpt-tiny")
    checkpoint.save(plan, tmp_path, state, step=1)
    other = train.init_fn(get("llama-tiny"), train.adamw())
    with pytest.raises(errors.CheckpointMismatchError) as e:
        checkpoint.restore(plan, tmp_path, like=plan.abstract_init(other, jax.random.key(0)))
    assert "not in the checkpoint: params/embed/embedding" in str(e.value)  # llama's
    assert "not in `like`: params/layers/attn/out/bias" in str(e.value)  # gpt's


def _data_files(path):
    return sorted(
        (p for p in Path(path).rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )


def test_corrupt_values_name_the_leaf(tmp_path):
    plan, like = _small_checkpoint(tmp_path)
    biggest = _data_files(tmp_path)[-1]  # holds w, 256 KiB
    data = bytearray(biggest.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x55
    biggest.write_bytes(bytes(data))
    with pytest.raises(errors.CheckpointCorruptError, match=r"leaf 'w'"):
        checkpoint.restore(plan, tmp_path, like=like)


def test_missing_manifest_or_files_is_corrupt_not_partial(tmp_path):
    plan, like = _small_checkpoint(tmp_path)
    for f in _data_files(tmp_path):
        f.unlink()
    with pytest.raises(errors.CheckpointCorruptError, match=r"leaf '(w|b)'"):
        checkpoint.restore(plan, tmp_path, like=like)
    (tmp_path / "5" / "shardkit" / "metadata").write_text("{not json")
    with pytest.raises(errors.CheckpointCorruptError, match="manifest"):
        checkpoint.restore(plan, tmp_path, like=like)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    plan = sk.Plan("dp")
    like = {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with pytest.raises(errors.CheckpointNotFoundError, match="No checkpoint directory"):
        checkpoint.restore(plan, tmp_path / "nowhere", like=like)
    with pytest.raises(errors.CheckpointError, match="JSON cannot hold"):
        checkpoint.save(plan, tmp_path, {"x": jnp.ones(8)}, step=1, data_state={"rng": object()})
    checkpoint.save(plan, tmp_path, {"x": jnp.ones(8)}, step=1)
    with pytest.raises(errors.CheckpointError, match="already holds a checkpoint for step 1"):
        checkpoint.save(plan, tmp_path, {"x": jnp.ones(8)}, step=1)


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import shardkit as sk
    sk.emulate_devices(8)
    import jax, jax.numpy as jnp
    from shardkit import checkpoint
    path = sys.argv[1]
    plan = sk.Plan("fsdp")
    shard = plan.shardings({"w": jnp.zeros((4096, 4096))})["w"]
    w = jax.device_put(jnp.full((4096, 4096), 1.0), shard)          # 64 MiB
    checkpoint.save(plan, path, {"w": w}, step=1, block=True)
    checkpoint.save(plan, path, {"w": w * 2}, step=2)               # returns at once
    os.kill(os.getpid(), signal.SIGKILL)                            # mid-write
    """
)


def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.isdigit()]
    assert any(name.startswith("2.") for name in leftovers), os.listdir(tmp_path)  # step 2 begun
    plan = sk.Plan("dp", devices=jax.devices()[:2])  # and restored elsewhere
    like = {
        "w": jax.ShapeDtypeStruct(
            (4096, 4096), jnp.float32, sharding=plan.shardings({"w": jnp.zeros((4096, 4096))})["w"]
        )
    }
    restored = checkpoint.restore(plan, tmp_path, like=like)
    assert restored.step == 1
    assert float(jnp.min(restored.state["w"])) == float(jnp.max(restored.state["w"])) == 1.0


def test_resumed_run_in_a_new_process_continues_exactly(tmp_path):
    from shardkit.run import run

    ckpt, out = tmp_path / "ckpt", tmp_path / "resumed.json"
    common = {"steps": 6, "batch": 8, "seq": 32}
    # 6 steps in one go, saving after step 3 (and at the end): the reference.
    uninterrupted = run("gpt-tiny", "fsdp", **common, checkpoint_dir=str(ckpt), save_every=3)
    assert checkpoint.steps(ckpt) == [3, 6]
    shutil.rmtree(ckpt / "6")  # as if the process had died after saving step 3
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    args = [
        "run",
        "--steps",
        "6",
        "--seq",
        "32",
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        "--save-every",
        "2",
        "--no-report",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["first_step"] == 3
    assert resumed["losses"] == uninterrupted.losses[3:]  # bit for bit: data position and state
    assert checkpoint.steps(ckpt) == [3, 4, 6]  # saved at 4 (every 2) and at the end
    with pytest.raises(errors.CheckpointMismatchError, match=r"seq: saved 32, now 16"):
        run("gpt-tiny", "fsdp", **{**common, "seq": 16}, checkpoint_dir=str(ckpt), resume=True)
