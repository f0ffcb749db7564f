"""Two processes on loopback train like one: JAX's own multi-controller runtime."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardkit as sk

WORKER = Path(__file__).with_name("worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _load_worker():
    """``worker.py`` as a module, without running its ``main``."""
    spec = importlib.util.spec_from_file_location("multiprocess_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


@pytest.mark.parametrize("recipe", ["fsdp"])
def test_two_processes_match_one(recipe):
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), port, recipe],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["mesh"] == {"fsdp": 8}
    np.testing.assert_allclose(results[0]["losses"], results[1]["losses"], rtol=0)
    single = _load_worker().train_losses(sk.Plan(recipe), process_index=0, process_count=1)
    np.testing.assert_allclose(results[0]["losses"], single, rtol=1e-5)
