"""Multi-process runs: ``jax.distributed.initialize`` with CPU collectives and a clean death.

Call :func:`initialize` once per process, before any JAX computation; then use shardkit
unchanged (``plan.shard_batch`` takes each process's own rows, ``sk.make_mesh(...,
dcn=...)`` lays axes across processes). On a cluster JAX finds the coordinator, the
process count and this process's id itself (SLURM, Open MPI, Kubernetes, Cloud TPU);
``shardkit launch -n N`` sets them for N local processes, and they can be passed
explicitly.

When a process dies, JAX's coordination service notices (within
``heartbeat_timeout_seconds`` for a lost peer, at once for a lost coordinator) and ends
every other process with a C++ fatal error and stack trace (or gloo, the CPU
collectives, ends it first on a half-received message). ``initialize(guard=True)``
routes this process's stderr through a small watcher process that swallows that stack
trace and prints one line instead, naming the dead process and the checkpoint to
restart from (the directory of the last ``checkpoint.save``).

Example (one process: nothing to coordinate, so nothing happens):
  >>> from shardkit import distributed
  >>> distributed.initialize(num_processes=1)
  >>> distributed.is_main_process()
  True
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

from shardkit.errors import DeviceError

__all__ = [
    "initialize",
    "is_main_process",
    "launched",
    "note_checkpoint",
    "wait_for_fatal_error",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_HEARTBEAT",
]

#: Set by ``shardkit launch`` for each process it starts.
ENV_COORDINATOR = "SHARDKIT_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDKIT_PROCESS_ID"
ENV_HEARTBEAT = "SHARDKIT_HEARTBEAT_TIMEOUT"

#: Seconds without a heartbeat before a process counts as dead (JAX's default is 100).
_DEFAULT_HEARTBEAT_TIMEOUT = 10

_state: dict = {"initialized": False, "guard": None, "heartbeat": _DEFAULT_HEARTBEAT_TIMEOUT}
_CONTROL = b"\x00shardkit-checkpoint="


def launched() -> bool:
    """Whether ``shardkit launch`` started this process (its variables are set)."""
    return all(os.environ.get(k) for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))


def is_main_process() -> bool:
    """Process 0, the one that prints reports and logs."""
    return jax.process_index() == 0


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cpu_devices: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int = 60,
    initialization_timeout: int = 300,
    guard: bool = True,
) -> None:
    """Join this process to a multi-process run (``jax.distributed.initialize``).

    Args:
      coordinator_address, num_processes, process_id: as for
        ``jax.distributed.initialize``; default: ``shardkit launch``'s environment
        variables, else JAX's cluster auto-detection.
      local_device_ids: this process's accelerators (default: JAX's choice).
      cpu_devices: emulate this many CPU devices in this process (CPU runs only).
      heartbeat_timeout_seconds: how long a silent process may stay silent before the
        others stop (default 10 s, or ``SHARDKIT_HEARTBEAT_TIMEOUT``).
      guard: print one clear line instead of JAX's C++ stack trace when a peer dies.

    Raises:
      DeviceError: the JAX backend already started (call this first), or arguments
        that do not describe a run.
    """
    if _state["initialized"]:
        return
    env = os.environ
    if coordinator_address is None and num_processes is None and process_id is None and launched():
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID])
    if heartbeat_timeout_seconds is None:
        heartbeat_timeout_seconds = int(env.get(ENV_HEARTBEAT, _DEFAULT_HEARTBEAT_TIMEOUT))
    _state["heartbeat"] = heartbeat_timeout_seconds
    if num_processes == 1:
        _state["initialized"] = True
        return
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise DeviceError(
            f"distributed.initialize: process_id={process_id} is not in "
            f"[0, num_processes={num_processes})."
        )
    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", int(cpu_devices))
        # CPU collectives across processes go over gloo (TCP); GPU/TPU ignore this.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as e:
        raise DeviceError(
            "distributed.initialize() must run before the JAX backend starts "
            f"({e}).\nFix: call it right after the imports, before any array is made."
        ) from None
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            shutdown_timeout_seconds=shutdown_timeout_seconds,
        )
    except RuntimeError as e:
        if "must be called before" not in str(e):
            raise
        raise DeviceError(
            "distributed.initialize() must run before the JAX backend starts.\nFix: call it "
            "right after the imports, before any array is made or jax.devices() is called."
        ) from None
    except ValueError as e:  # JAX found no cluster and was given too little
        raise DeviceError(
            f"distributed.initialize: {e} (no cluster detected).\nFix: pass "
            "coordinator_address='host:port', num_processes and process_id, or start the "
            "processes with `shardkit launch -n N -- ...`."
        ) from None
    _state["initialized"] = True
    if guard and jax.process_count() > 1:
        _install_guard(jax.process_index(), jax.process_count())


def note_checkpoint(directory: str) -> None:
    """Tell the guard where this run checkpoints (it names the restart point)."""
    guard = _state["guard"]
    if guard is not None and guard.poll() is None:
        os.write(2, _CONTROL + os.fsencode(directory) + b"\n")


def wait_for_fatal_error(seconds: float | None = None) -> None:
    """After a failed collective: give JAX's runtime time to name the dead peer.

    A step whose peer died fails at once (the connection resets), before the
    coordination service has declared the peer dead; it then ends this process. Returns
    after ``seconds`` (default: the heartbeat timeout plus 5 s) if nothing ended it.
    """
    if _state["initialized"] and jax.process_count() > 1:
        time.sleep(_state["heartbeat"] + 5 if seconds is None else seconds)


# -- the guard: a watcher process on this process's stderr -------------------------------
_GUARD = r"""
import os, re, sys
me, n = sys.argv[1], sys.argv[2]
CONTROL = b"\x00shardkit-checkpoint="
FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
# A peer killed mid-message can also end this process inside gloo (CPU collectives): a
# size check on the half-received message throws and C++ terminates (seen in CI).
GLOO = (b"instance of 'gloo::", b"[enforce fail at external/gloo/")
out = sys.stdout.buffer
directory, fatal, pending, recent = None, False, b"", []
def last_step(d):
    try:
        steps = [int(x) for x in os.listdir(d) if x.isdigit()]
    except OSError:
        return None
    return max(steps) if steps else None
def dead_process(text):
    # TSL names tasks /job:jax_worker/replica:0/task:N; a heartbeat failure lists the
    # ids one per line after "unhealthy"; a lost leader is process 0.
    found = [m.decode() for m in re.findall(rb"task:(\d+)", text)]
    after = text.split(b"unhealthy", 1)[1] if b"unhealthy" in text else b""
    found += [m.decode() for m in re.findall(rb"\n\s*(\d+)\s*(?=\n|$)", after)]
    if b"leader task" in text or b"leader incarnation" in text.lower():
        found.append("0")
    others = [f for f in found if f != me]
    if not others and n == "2":  # two processes: the dead one is the other one
        others = [str(1 - int(me))]
    if not others:
        return None
    return others[0] + (" (the coordinator)" if others[0] == "0" else "")
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
        if line.startswith(CONTROL):
            directory = line[len(CONTROL):].decode(errors="replace")
            continue
        if FATAL in line or any(g in line for g in GLOO):
            fatal = True
        if fatal:
            recent.append(line)
            continue
        recent = (recent + [line])[-200:]
        out.write(line + b"\n")
        out.flush()
if pending and not fatal:
    out.write(pending)
if fatal:
    dead = dead_process(b"\n".join(recent))
    who = f"process {dead}" if dead else "another process"
    if directory is None:
        where = "no checkpoint was saved in this run, so a restart begins at step 0"
    else:
        step = last_step(directory)
        where = (f"the last checkpoint, step {step} in {directory}, is the restart point: "
                 "rerun the same command with --resume") if step is not None else (
                 f"no checkpoint was committed in {directory} yet, so a restart begins at step 0")
    out.write(f"shardkit: {who} of {n} died or stopped responding, so process {me} "
              f"stopped too; {where}.\n".encode())
out.flush()
"""


def _install_guard(process_id: int, num_processes: int) -> None:
    """Route fd 2 through a watcher process (see the module docstring)."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    original = os.dup(2)
    guard = subprocess.Popen(
        [sys.executable, "-c", _GUARD, str(process_id), str(num_processes)],
        stdin=read_end,
        stdout=original,
        stderr=original,
        close_fds=True,
        start_new_session=True,  # a Ctrl-C to the job reaches it through our EOF instead
    )
    os.close(read_end)
    os.close(original)
    os.dup2(write_end, 2)
    os.close(write_end)
    _state["guard"] = guard
