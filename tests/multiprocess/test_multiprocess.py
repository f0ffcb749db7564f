"""Two processes on loopback train like one: JAX's own multi-controller runtime."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import shardkit as sk
from shardkit import train
from shardkit.data import MarkovSource
from shardkit.models import get

WORKER = Path(__file__).with_name("worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _single_process_losses(recipe):
    model, tx = get("gpt-tiny"), train.adamw()
    plan = sk.Plan(recipe)
    state = plan.init(train.init_fn(model, tx), jax.random.key(0))
    step = plan.jit(train.train_step(model, tx))
    source = MarkovSource(vocab=model.config.vocab)
    losses = []
    for i in range(3):
        state, metrics = step(state, plan.shard_batch(source.batch(8, 32, i)))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("recipe", ["fsdp"])
def test_two_processes_match_one(recipe):
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(i), port, recipe],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["mesh"] == {"fsdp": 8}
    np.testing.assert_allclose(results[0]["losses"], results[1]["losses"], rtol=0)
    np.testing.assert_allclose(results[0]["losses"], _single_process_losses(recipe), rtol=1e-5)
