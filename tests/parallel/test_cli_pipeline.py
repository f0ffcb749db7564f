"""The pipeline flags of ``shardkit run`` / ``report``."""

import argparse

import jax
import pytest

import shardkit as sk
from shardkit import train
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
