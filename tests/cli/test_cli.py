import json
import os
import subprocess
import sys

import pytest

from shardkit.cli import main


def shardkit(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_help_and_recipes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "run" in capsys.readouterr().out
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"dp", "fsdp", "zero1"}
    assert main(["recipes"]) == 0
    assert "fsdp" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "ddp"], "--recipe ddp: no such recipe"),
        (["--model", "gpt-huge"], "--model gpt-huge: no such reference model"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--devices", "64"], "only 8 emulated CPU device(s)"),
        (["--batch", "4"], "batch"),  # 4 examples over fsdp=8 does not divide
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    assert main(["run", "--steps", "1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("shardkit run: error:")


def test_run_50_steps_loss_falls_toward_entropy_bound(tmp_path):
    out = tmp_path / "run.json"
    proc = shardkit(
        "run",
        "--model",
        "gpt-tiny",
        "--recipe",
        "fsdp",
        "--devices",
        "8",
        "--steps",
        "50",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result) >= {
        "model",
        "recipe",
        "mesh",
        "devices",
        "losses",
        "entropy_bound",
        "tokens_per_s",
    }
    assert result["mesh"] == {"fsdp": 8} and result["devices"] == 8
    losses, bound = result["losses"], result["entropy_bound"]
    assert len(losses) == 50 and result["tokens_per_s"] > 0
    # Starts near ln(vocab); at least 60% of the gap to the bound is closed, never below it.
    assert losses[0] - bound > 2.0
    assert losses[-1] - bound < 0.4 * (losses[0] - bound)
    assert min(losses) > bound - 0.05
    assert "entropy bound" in proc.stdout and "memory / device" in proc.stdout
    # ...and the layout report of the step it trained with
    assert "wire bytes per device per step" in proc.stdout
    assert result["report"]["mesh"] == {"fsdp": 8} and result["report"]["warnings"] == []


def test_plan_command_shows_every_leaf(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--recipe", "fsdp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == {"fsdp": 8}
    wte = next(leaf for leaf in d["leaves"] if leaf["path"] == "params/wte/embedding")
    assert wte["logical"] == ["vocab", "embed"] and wte["spec"] == "P('fsdp', None)"
    assert wte["bytes_per_device"] == 256 * 64 * 4 // 8
    assert main(["plan", "--model", "gpt-tiny", "--recipe", "fsdp", "--all"]) == 0
    assert "opt_state" in capsys.readouterr().out


def test_report_of_a_users_model_from_its_factory(tmp_path):
    # From another directory, as a user would run it: the module is found from the cwd.
    import shutil
    from pathlib import Path

    shutil.copytree(Path(__file__).resolve().parents[2] / "examples", tmp_path / "examples")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "report",
            "--model",
            "examples.my_model:build",
            "--recipe",
            "fsdp",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    # Everything needed to reproduce the report: what ran, on what, with which sizes.
    assert d["model"] == "examples.my_model:build" and d["recipe"] == "fsdp"
    assert d["mesh"] == {"fsdp": 8} and d["devices"] == 8
    w = d["workload"]
    assert (w["model"], w["batch"], w["seq"], w["precision"]) == (
        "examples.my_model:build",
        8,
        128,
        "f32",
    )
    # The model carries no annotations: its PathAxes alone shard it (fc_in: embed x mlp).
    fc_in = next(p for p in d["params"] if p["path"] == "params/blocks_0/fc_in/kernel")
    assert fc_in["logical"] == ["embed", "mlp"] and fc_in["spec"] == "P('fsdp', None)"
    assert d["replicated_fraction"] < 0.05 and d["warnings"] == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ("examples.my_model", "no such reference model"),
        ("examples.nope:build", "cannot import 'examples.nope'"),
        ("examples.my_model:nope", "has no attribute 'nope'"),
        (":build", "package.module:factory"),
    ],
)
def test_bad_user_models_exit_2_with_the_fix(spec, message, capsys):
    assert main(["plan", "--model", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("shardkit plan: error:")


def test_remat_is_for_reference_models_only(capsys):
    assert main(["report", "--model", "examples.my_model:build", "--remat", "full"]) == 2
    assert "only the reference models take it" in capsys.readouterr().err
