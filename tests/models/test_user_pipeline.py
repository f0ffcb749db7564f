"""A model of the user's own (examples/scanned_lm.py) pipelines from the command line.

The reference is the same command on one device (``--recipe dp --devices 1``: the model's
own ``loss`` under ``jax.value_and_grad``), never the pipeline; the model is not a
shardkit reference model, and shardkit gets its cut and its sizes from the factory.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from examples import my_model, scanned_lm
from shardkit import models
from shardkit.cli import main

SPEC = "examples.scanned_lm:build"
RUN = ["--steps", "3", "--batch", "8", "--seq", "32"]
#: 2 stages of the model's 4 layers everywhere (dp_tp_sp_pp: data 2 × stage 2 × tensor 2)
DEVICES = {"pp": 2, "dp_pp": 8, "zeropp": 8, "dp_tp_sp_pp": 8}


def losses(tmp_path, recipe, devices):
    out = tmp_path / f"{recipe}.json"
    argv = ["run", "--model", SPEC, "--recipe", recipe, "--devices", str(devices), *RUN]
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("one"), "dp", 1)["losses"]


@pytest.mark.parametrize("recipe", list(DEVICES))
def test_every_pipeline_recipe_trains_to_the_one_device_losses(recipe, one_device, tmp_path):
    result = losses(tmp_path, recipe, DEVICES[recipe])
    assert result["mesh"]["stage"] == 2
    np.testing.assert_allclose(result["losses"], one_device, rtol=1e-5)
    assert one_device[-1] < one_device[0]  # it trains


def test_report_of_the_users_model_has_an_analytic_column(capsys):
    argv = ["report", "--model", SPEC, "--recipe", "dp_pp", "--seq", "32", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    w = d["workload"]
    assert (w["layers"], w["d_model"], w["n_heads"], w["vocab"]) == (4, 64, 4, 256)
    # the pipeline's analytic model, from the declared dims: its wire matches the program's
    assert d["analytic_wire_bytes_by_kind"]["collective-permute"] > 0
    assert abs(d["ratios"]["wire_bytes"] - 1) < 0.05, d["ratios"]


def build(**changes):
    model = scanned_lm.build()
    model.update(changes)
    return model


def test_a_factory_without_a_loss_names_what_is_missing():
    with pytest.raises(sk.ShardingError, match=r"needs 'init' and 'loss' \(or 'stages'"):
        models.user.as_user_model({"init": scanned_lm.init}, name="f")
    with pytest.raises(sk.ShardingError, match=r"returned object \(no init or loss\)"):
        models.user.as_user_model(object(), name="f")
    # the loss is derived from the cut when only that is given
    model = models.user.as_user_model({k: v for k, v in build().items() if k != "loss"}, name="f")
    tokens = jnp.zeros((2, 8), jnp.int32)
    params = jax.jit(scanned_lm.init)(jax.random.key(0))
    batch = {"inputs": tokens, "targets": tokens}
    np.testing.assert_allclose(model.loss(params, batch), scanned_lm.loss(params, batch), 1e-6)


def test_a_model_without_a_stack_or_a_cut_cannot_pipeline_and_says_how(capsys):
    # examples/my_model.py: no cut, and its blocks are separate parameters (blocks_0, ...)
    assert main(["report", "--model", "examples.my_model:build", "--recipe", "pp"]) == 2
    err = capsys.readouterr().err
    assert "gives no pipeline cut" in err and "Fix: return 'stages'" in err
    cut = {"pre": scanned_lm.pre, "layer": scanned_lm.layer, "post": scanned_lm.post}
    model = models.UserModel(my_model.init, my_model.loss, vocab=256, stages=cut)
    with pytest.raises(sk.parallel.NotPipelinableError, match=r"No stacked layers under 'layers'"):
        model.stages()
    ragged = sk.parallel.Stages(*cut.values())
    with pytest.raises(sk.parallel.NotPipelinableError, match="not a stack of identical layers"):
        ragged.split({"layers": {"a": jnp.zeros((4, 2)), "b": jnp.zeros((3, 2))}})


def test_dims_that_contradict_the_parameters_name_both():
    dims = dict(scanned_lm.DIMS)
    with pytest.raises(sk.ShardingError, match=r"layers=3, but the stack .* has \[4\] layers"):
        models.user.as_user_model(build(dims={**dims, "layers": 3}), name="f")
    with pytest.raises(sk.ShardingError, match=r"dims declare 172,608 parameters .* gives 238,144"):
        models.user.as_user_model(build(dims={**dims, "d_ff": 128}), name="f")
    with pytest.raises(sk.ShardingError, match=r"lacks \['d_ff'\]"):
        models.user.as_user_model(
            build(dims={k: v for k, v in dims.items() if k != "d_ff"}), name="f"
        )
    # by hand: tables 2·256·64 + 128·64, final norm 64, 4 × (4·64² + 2·64·256 + 2·64)
    assert models.load(SPEC).dims.param_count == 238144  # the declared dims hold
