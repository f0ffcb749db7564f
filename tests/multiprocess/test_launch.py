"""``shardkit launch``: 2 processes × 4 CPU devices with a DCN axis train like 1 × 8, and a
killed peer stops the survivor within seconds with one clear line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from shardkit import distributed
from shardkit.cli.launch_cmd import _free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
SHARDKIT = [sys.executable, "-m", "shardkit.cli"]


def test_two_processes_with_dcn_train_like_one(tmp_path):
    out = tmp_path / "run.json"
    run_args = ["run", "--recipe", "dp", "--devices", "8", "--steps", "3", "--seq", "32",
                "--no-report", "--json", str(out)]  # fmt: skip
    proc = subprocess.run([*SHARDKIT, "launch", "-n", "2", "--", "shardkit", *run_args, "--dcn", "data=2"],
                          env=ENV, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = json.loads(out.read_text())
    assert launched["mesh"] == {"data": 8} and launched["devices"] == 8
    assert proc.stdout.count("shardkit run: gpt-tiny under dp") == 1  # process 0 prints

    from shardkit.run import run

    single = run("gpt-tiny", "dp", steps=3, batch=8, seq=32).losses  # 1 process × 8 devices
    np.testing.assert_allclose(launched["losses"], single, rtol=1e-6)


def test_killed_peer_stops_the_survivor_with_one_clear_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    port = _free_port()
    run_args = ["run", "--recipe", "dp", "--devices", "8", "--steps", "100000", "--seq", "32",
                "--checkpoint-dir", str(ckpt), "--save-every", "2", "--no-report"]  # fmt: skip
    procs = []
    for i in range(2):  # what `shardkit launch -n 2` does, with the pids at hand
        env = {**ENV, distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
               distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(i),
               distributed.ENV_HEARTBEAT: "5"}  # fmt: skip
        procs.append(subprocess.Popen([*SHARDKIT, *run_args], env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
    survivor, victim = procs
    try:
        deadline = time.monotonic() + 180
        while not (ckpt.is_dir() and any(p.isdigit() for p in os.listdir(ckpt))):
            assert survivor.poll() is None and time.monotonic() < deadline, survivor.stderr.read()
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode != 0
    assert seconds < 15, seconds
    last = err.strip().splitlines()[-1]
    assert last.startswith("shardkit: process 1 of 2 died or stopped responding"), err[-3000:]
    assert f"in {ckpt}, is the restart point" in last and "--resume" in last
    assert "Check failure stack trace" not in err and "    @ " not in err
    print(f"survivor stopped {seconds:.1f} s after its peer was killed")


def test_launcher_names_the_dead_process_and_ends_the_rest(tmp_path):
    # No JAX here: process 1 fails, process 0 would run for a minute.
    child = "import os, sys, time; sys.exit(3) if os.environ['SHARDKIT_PROCESS_ID'] == '1' else time.sleep(60)"  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run([*SHARDKIT, "launch", "-n", "2", "--grace", "1", "--", sys.executable, "-c", child],
                          env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shardkit launch: process 1 of 2 exited with status 3"), proc.stderr
    assert "the launcher ended 0" in last and "no --checkpoint-dir" in last
