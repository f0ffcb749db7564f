"""The pipeline flags of ``shardkit run`` / ``report``."""

import argparse
import json

import jax
import pytest

import shardkit as sk
from shardkit import train
from shardkit.cli import main
from shardkit.models import get
from shardkit.parallel import cli


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_to_options():
    assert cli.options(parse()) is None
    assert cli.options(parse("--schedule", "interleaved", "--microbatches", "8")) == {
        "microbatches": 8, "schedule": "interleaved", "virtual_stages": 2, "unit": None}  # fmt: skip


def test_flags_with_a_recipe_that_cannot_pipeline_name_the_fix():
    model, tx = get("gpt-tiny"), train.adamw()
    plan = sk.Plan("fsdp", devices=jax.devices()[:2])
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    assert cli.step_for(model, tx, plan, abstract, None) is None  # no flags: the plain step
    with pytest.raises(
        sk.parallel.NotPipelinableError, match="--recipe pp, dp_pp, zeropp or dp_tp_sp_pp"
    ):
        cli.step_for(model, tx, plan, abstract, cli.options(parse("--microbatches", "4")))


def test_report_of_the_3d_pipeline_has_its_analytic_wire(capsys):
    # The CLI's pre-flight sized the batch check's length at 1, which tensor=2 (TP+SP
    # splits the length) does not divide: the 3D report stopped there.
    argv = ["report", "--model", "gpt-tiny", "--recipe", "dp_tp_sp_pp", "--batch", "16",
            "--seq", "32", "--json"]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    # m = p = 2 micro-batches of 16 / (2·2) rows; a permute moves 4 × (32 / 2) × 64 f32
    # after every tick but the last, forward and backward: 2 · (3 − 1) of them.
    assert got["analytic_wire_bytes_by_kind"]["collective-permute"] == 2 * 2 * 4 * 16 * 64 * 4
    assert got["wire_bytes_by_kind"]["collective-permute"] == 2 * 2 * 4 * 16 * 64 * 4
