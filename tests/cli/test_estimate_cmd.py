"""``shardkit estimate``: the pre-compile estimate on the command line."""

import json

import shardkit as sk
from shardkit import models
from shardkit.cli import main


def test_estimate_json_is_sk_estimate(capsys):
    argv = ["estimate", "--model", "gpt-tiny", "--recipe", "fsdp", "--devices", "256"]
    assert main([*argv, "--seq", "64", "--remat", "full", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    model = models.get("gpt-tiny", remat="full")
    e = sk.estimate("fsdp", model, mesh={"fsdp": 256}, batch=256, seq=64)
    assert d["mesh"] == {"fsdp": 256} and d["batch"] == 256
    assert d["total"] == e.total and d["wire_bytes_by_kind"] == e.wire_bytes_by_kind
    assert set(d["terms"]) >= {"gradients", "saved activations"}
    assert main(argv) == 0  # the table
    out = capsys.readouterr().out
    assert "arguments + temp" in out and "saved activations" in out


def test_estimate_of_a_users_model_that_declares_its_dims(capsys):
    argv = ["estimate", "--model", "examples.scanned_lm:build", "--recipe", "fsdp"]
    assert main([*argv, "--devices", "256", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    dims = models.load("examples.scanned_lm:build").dims
    # f32 params and Adam's m and v over 256 devices, inputs and targets of 128 tokens.
    assert d["state"]["params"] == 4 * dims.param_count / 256
    assert d["arguments"] == 12 * dims.param_count / 256 + 2 * 128 * 4


def test_a_model_without_dims_is_told_what_to_declare(capsys):
    argv = ["estimate", "--model", "examples.my_model:build", "--recipe", "fsdp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "declares no dimensions" in err and "d_model=" in err and "shardkit report" in err


def test_pipeline_flags_reach_the_estimate(capsys):
    # --unrolled: the unrolled engine's terms.
    argv = ["estimate", "--recipe", "dp_pp", "--seq", "64", "--json", "--unrolled"]
    assert main([*argv, "--microbatches", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main([*argv, "--microbatches", "8"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert two["mesh"] == {"stage": 2, "data": 4}
    # 1F1B on 2 stages holds min(m, 3) micro-batches of 8/(4·m) rows: 2 × 1 against 3 × 1/4.
    saved = "saved activations"
    assert two["terms"][saved] / eight["terms"][saved] == 2 / 0.75
    # The rolled default is estimated too (no refusal), with the flags' schedule.
    rolled = [*argv[:-1], "--microbatches", "4", "--schedule", "gpipe", "--remat", "full"]
    assert main(rolled) == 0
    d = json.loads(capsys.readouterr().out)
    e = sk.estimate(
        "dp_pp",
        models.get("gpt-tiny", remat="full"),
        mesh={"stage": 2, "data": 4},
        batch=8,
        seq=64,
        pipeline={"microbatches": 4, "schedule": "gpipe"},
    )
    assert d["total"] == e.total and d["terms"] == e.terms
    # gpipe on 2 stages, m = 4 of 8/(4·4) rows: its own 4 slots + 1, residuals (the layer
    # input under full remat) and d loss / d y, 64 wide, f32.
    assert d["terms"][saved] == 2 * 5 * 0.5 * 64 * 64 * 4
