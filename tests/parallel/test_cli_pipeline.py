"""The pipeline flags of ``shardkit run`` / ``report``."""

import argparse
import dataclasses
import json

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit.cli import main
from shardkit.models.config import CONFIGS
from shardkit.parallel import cli


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_to_options():
    assert cli.options(parse()) is None
    assert cli.options(parse("--schedule", "interleaved", "--microbatches", "8")) == {
        "microbatches": 8,
        "schedule": "interleaved",
        "virtual_stages": 2,
        "unit": None,
    }
    assert cli.options(parse("--rolled"))["rolled"] is True
    assert cli.options(parse("--unrolled"))["rolled"] is False
    assert "rolled" not in cli.options(parse("--microbatches", "8"))  # the default: rolled
    plan = sk.Plan("pp", devices=jax.devices()[:2])
    assert cli.for_plan(plan, cli.options(parse("--microbatches", "4")))["rolled"] is True
    assert cli.for_plan(plan, cli.options(parse("--unrolled")))["rolled"] is False


def test_flags_with_a_recipe_that_cannot_pipeline_name_the_fix():
    plan = sk.Plan("fsdp", devices=jax.devices()[:2])
    assert cli.for_plan(plan, None) is None  # no flags: the plain step
    with pytest.raises(
        sk.parallel.NotPipelinableError, match="--recipe pp, dp_pp, zeropp or dp_tp_sp_pp"
    ):
        cli.for_plan(plan, cli.options(parse("--microbatches", "4")))


def test_report_of_the_3d_pipeline_has_its_analytic_wire(capsys):
    # The CLI's pre-flight sized the batch check's length at 1, which tensor=2 (TP+SP
    # splits the length) does not divide: the 3D report stopped there.
    argv = [
        "report",
        "--model",
        "gpt-tiny",
        "--recipe",
        "dp_tp_sp_pp",
        "--batch",
        "16",
        "--seq",
        "32",
        "--json",
    ]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    # m = p = 2 micro-batches of 16 / (2·2) rows; a permute moves 4 × (32 / 2) × 64 f32
    # after every tick but the last, forward and backward: 2 · (3 − 1) of them.
    assert got["analytic_wire_bytes_by_kind"]["collective-permute"] == 2 * 2 * 4 * 16 * 64 * 4
    assert got["wire_bytes_by_kind"]["collective-permute"] == 2 * 2 * 4 * 16 * 64 * 4


@pytest.fixture
def gpt_tiny_layers(monkeypatch):
    """``--model gpt-tiny`` with ``n`` layers (it has 2: too few for p·v > 2 chunks)."""

    def patch(n):
        monkeypatch.setitem(
            CONFIGS, "gpt-tiny", dataclasses.replace(CONFIGS["gpt-tiny"], n_layers=n)
        )

    return patch


@pytest.mark.parametrize("recipe,devices,layers,m", [("pp", 4, 8, 4), ("dp_pp", 8, 4, 2)])
def test_interleaved_report_moves_no_weights(recipe, devices, layers, m, gpt_tiny_layers, capsys):
    # Stored in layer order, the stack (and its gradient) was reordered across stages every
    # step: pp stage=4 moved 2.4 MB of all-gathers (4.3x the analytic wire), dp_pp's
    # permutes were 7x the analytic. Stored interleaved, only the activations move.
    gpt_tiny_layers(layers)
    argv = [
        "report",
        "--model",
        "gpt-tiny",
        "--recipe",
        recipe,
        "--devices",
        str(devices),
        "--batch",
        "16",
        "--seq",
        "16",
        "--schedule",
        "interleaved",
        "--microbatches",
        str(m),
        "--json",
    ]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    wire, want = got["wire_bytes_by_kind"], got["analytic_wire_bytes_by_kind"]
    # permutes, and the all-reduce of the non-layer gradients (and of the data axis)
    assert set(wire) == set(want) == {"collective-permute", "all-reduce"}
    # The rolled engine (the default) moves measured 1.10x the analytic permutes on pp's
    # 4 stages, 1.00x on dp_pp's 2 (the unrolled engine: within 5 % on both).
    assert 0.95 <= wire["collective-permute"] / want["collective-permute"] <= 1.15
    assert wire["all-reduce"] / want["all-reduce"] == pytest.approx(1.0, abs=0.05)


def test_run_interleaved_trains_as_one_device_and_saves_in_layer_order(
    gpt_tiny_layers, tmp_path, capsys
):
    gpt_tiny_layers(4)  # 2 stages × 2 virtual stages

    def run(*flags, steps):
        argv = [
            "run",
            "--model",
            "gpt-tiny",
            "--batch",
            "4",
            "--seq",
            "16",
            "--steps",
            str(steps),
            "--json",
            *flags,
        ]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    ref = run("--recipe", "dp", "--devices", "1", steps=3)["losses"]  # the plain step
    pp = ["--recipe", "pp", "--devices", "2", "--microbatches", "2"]
    ckpt = str(tmp_path / "ckpt")
    got = run(*pp, "--schedule", "interleaved", "--checkpoint-dir", ckpt, steps=2)
    # the tolerance of tests/parallel/test_pipeline.py (a pipeline against one device)
    np.testing.assert_allclose(got["losses"], ref[:2], rtol=1e-5)
    wire = got["report"]["wire_bytes_by_kind"]
    assert "all-gather" not in wire  # the stack trained in its stored order
    want = got["report"]["analytic_wire_bytes_by_kind"]["collective-permute"]
    assert wire["collective-permute"] == pytest.approx(want, rel=0.05)
    # saved in layer order: 1F1B resumes it (a stack saved interleaved gives other losses)
    resumed = run(*pp, "--schedule", "1f1b", "--checkpoint-dir", ckpt, "--resume", steps=3)
    assert resumed["first_step"] == 2
    np.testing.assert_allclose(resumed["losses"], ref[2:], rtol=1e-5)


def test_zero_bubble_flags_run_rolled_and_train_as_one_device(gpt_tiny_layers, capsys):
    plan = sk.Plan("zeropp", devices=jax.devices()[:8])
    opts = cli.for_plan(plan, cli.options(parse("--schedule", "zbv")))
    assert (opts["rolled"], opts["virtual_stages"], opts["stack_order"]) == (True, 2, "interleaved")
    assert cli.for_plan(plan, cli.options(parse("--schedule", "zb1")))["rolled"] is True
    gpt_tiny_layers(4)  # zbv: 2 stages × 2 chunks

    def run(*flags):
        argv = ["run", "--model", "gpt-tiny", "--batch", "8", "--seq", "16", "--steps", "2"]
        assert main([*argv, "--json", "--no-report", *flags]) == 0
        return json.loads(capsys.readouterr().out)["losses"]

    ref = run("--recipe", "dp", "--devices", "1")
    got = run("--recipe", "zeropp", "--devices", "8", "--microbatches", "2", "--schedule", "zbv")
    np.testing.assert_allclose(got, ref, rtol=1e-5)
