"""The stderr guard turns JAX's fatal error and C++ stack trace into one line.

The inputs are what JAX 0.10.2 printed when a peer, then the coordinator, was killed
(stack frames shortened); the guard runs as it does in a real run, as a process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit import distributed

ROOT = Path(__file__).resolve().parents[1]

PEER_DIED = """\
E1130 07:23:19.947739 coordination_service.cc:1549] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.
F1130 07:23:19.948476 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.
*** Check failure stack trace: ***
    @     0x7f68aee40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f68b62a71f5  (unknown)
"""
COORDINATOR_DIED = """\
F1130 07:23:45.796812 client.h:80] Terminating process because the JAX distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
*** Check failure stack trace: ***
    @     0x7f68aee40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""

#: What CI's process 0 printed when its peer was SIGKILLed mid-collective (gloo, the CPU
#: collectives, checks a half-received message's size and C++ terminates).
GLOO_ABORT = """\
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 16 vs 4. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
Fatal Python error: Aborted
"""


def _guard(text: str, me: int, n: int, checkpoint_dir=None) -> list[str]:
    control = (
        b""
        if checkpoint_dir is None
        else b"\x00shardkit-checkpoint=" + str(checkpoint_dir).encode() + b"\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", distributed._GUARD, str(me), str(n)],
        input=b"step 1 done\n" + control + text.encode(),
        capture_output=True,
        timeout=30,
    )
    return proc.stdout.decode().splitlines()


@pytest.mark.parametrize(
    "text, me, n, who",
    [
        (PEER_DIED, 0, 3, "process 1 of 3"),
        (COORDINATOR_DIED, 2, 3, "process 0 (the coordinator) of 3"),
        (
            "E0 x] Task /job:jax_worker/replica:0/task:2 has disconnected from coordination service.\n"
            "F0 client.h] Terminating process because the JAX distributed service detected fatal errors.\n",
            0,
            3,
            "process 2 of 3",
        ),
        (
            "F0 client.h] Terminating process because the JAX distributed service detected fatal errors. DEADLINE\n",
            0,
            2,
            "process 1 of 2",
        ),
        (GLOO_ABORT, 0, 2, "process 1 of 2"),
    ],
)
def test_guard_names_the_dead_process_and_drops_the_stack_trace(tmp_path, text, me, n, who):
    (tmp_path / "20").mkdir()
    (tmp_path / "30.orbax-checkpoint-tmp-1").mkdir()  # an uncommitted save is not a restart point
    lines = _guard(text, me, n, tmp_path)
    assert lines[0] == "step 1 done"  # ordinary output passes through
    assert not any("@" in line or "Check failure" in line or "F1130" in line for line in lines)
    assert lines[-1] == (
        f"shardkit: {who} died or stopped responding, so process {me} stopped too; the last "
        f"checkpoint, step 20 in {tmp_path}, is the restart point: rerun the same command "
        "with --resume."
    )


def test_guard_without_a_fatal_error_only_forwards():
    assert _guard("a\nb", 0, 2) == ["step 1 done", "a", "b"]
    assert _guard(PEER_DIED, 0, 2)[-1].endswith(
        "no checkpoint was saved in this run, so a restart begins at step 0."
    )


@pytest.mark.parametrize(
    "code, message",
    [
        ("distributed.initialize()", "no cluster detected"),
        (
            "import jax; jax.devices(); distributed.initialize(num_processes=2, process_id=0, coordinator_address='127.0.0.1:1')",
            "must run before the JAX backend starts",
        ),
    ],
    ids=["no-cluster", "too-late"],
)
def test_initialize_errors_say_what_to_do(code, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env["PYTHONPATH"], env["JAX_PLATFORMS"] = str(ROOT), "cpu"
    script = f"from shardkit import distributed, errors\ntry:\n    {code}\nexcept errors.DeviceError as e:\n    print(e)"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert message in proc.stdout and "Fix:" in proc.stdout, proc.stdout + proc.stderr
