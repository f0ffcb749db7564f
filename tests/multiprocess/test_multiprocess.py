"""Two processes on loopback train like one: JAX's own multi-controller runtime."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import shardkit as sk

WORKER = Path(__file__).with_name("worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# The coordinator's runtime (process 0 hosts it) can abort while it tears down its gRPC
# server, after the run printed its result: `Check failed: queue.Pop() == nullptr` under
# xla::DistributedRuntimeService::Shutdown, a race inside JAX's runtime seen once in CI
# (jaxlib 0.10.2, loaded machine) and not in 12 runs here. That exit alone is let through,
# with a warning; any other failure, in either process, fails the test.
_RUNTIME_TEARDOWN = "DistributedRuntimeService::Shutdown"


def _check_exit(process_id: int, p: subprocess.Popen, out: str, err: str) -> None:
    """The worker finished: exit 0, or process 0's runtime teardown abort after its result."""
    if p.returncode == 0:
        return
    printed = out.strip().splitlines()[-1:]  # the worker's result, its last line
    if (
        process_id == 0
        and p.returncode == -signal.SIGABRT
        and printed
        and printed[0].startswith('{"process": 0')
        and _RUNTIME_TEARDOWN in err
    ):
        warnings.warn(
            f"process 0 finished, then JAX's runtime aborted in {_RUNTIME_TEARDOWN}", stacklevel=2
        )
        return
    raise AssertionError(f"process {process_id} exited with {p.returncode}:\n{err[-3000:]}")


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
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=240)
        _check_exit(i, p, out, err)
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["mesh"] == {"fsdp": 8}
    np.testing.assert_allclose(results[0]["losses"], results[1]["losses"], rtol=0)
    single = _load_worker().train_losses(sk.Plan(recipe), process_index=0, process_count=1)
    np.testing.assert_allclose(results[0]["losses"], single, rtol=1e-5)
