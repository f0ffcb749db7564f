"""``shardkit launch -n N -- COMMAND``: N local processes on loopback, one multi-process run.

For development and tests: each process gets the coordinator address, the process count
and its id in environment variables that ``sk.distributed.initialize()`` (and
``shardkit run``) read, and ``--devices`` emulated CPU devices are split between them.
When one process dies, the others stop (JAX's runtime ends them within a heartbeat
timeout; the launcher ends any that linger) and the launcher says which one died and
where the last checkpoint is.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from shardkit import distributed
from shardkit.cli.devices_arg import DEFAULT_CPU_DEVICES
from shardkit.errors import ShardingError

#: Heartbeat timeout for launched processes: a dead peer is noticed within seconds.
LOCAL_HEARTBEAT_SECONDS = 5


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as N processes of one multi-process JAX run on this machine",
        description="Example: shardkit launch -n 2 -- shardkit run --devices 8 --dcn data=2 "
        "--recipe dp",
    )
    p.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument(
        "--grace",
        type=float,
        default=15.0,
        help="seconds the others get to stop by themselves after one dies",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(handler=main)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _checkpoint_dir(command: list[str]) -> str | None:
    for i, arg in enumerate(command):
        if arg == "--checkpoint-dir" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--checkpoint-dir="):
            return arg.split("=", 1)[1]
    return None


def _restart_point(command: list[str]) -> str:
    directory = _checkpoint_dir(command)
    if directory is None:
        return "No checkpoint was saved (no --checkpoint-dir): a restart begins at step 0."
    try:
        steps = [int(x) for x in os.listdir(directory) if x.isdigit()]
    except OSError:
        steps = []
    if not steps:
        return f"No checkpoint was committed in {directory}: a restart begins at step 0."
    return (
        f"The last checkpoint, step {max(steps)} in {directory}, is the restart point: "
        "rerun the same command with --resume."
    )


def main(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ShardingError("launch: no command. Fix: shardkit launch -n 2 -- shardkit run ...")
    if args.processes < 1:
        raise ShardingError(f"launch: -n must be at least 1, got {args.processes}.")
    if command[0] == "shardkit":  # this installation's shardkit, whatever PATH says
        command = [sys.executable, "-m", "shardkit.cli", *command[1:]]
    port = args.port or _free_port()
    procs = []
    for i in range(args.processes):
        env = {
            **os.environ,
            distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
            distributed.ENV_NUM_PROCESSES: str(args.processes),
            distributed.ENV_PROCESS_ID: str(i),
        }
        env.setdefault(distributed.ENV_HEARTBEAT, str(LOCAL_HEARTBEAT_SECONDS))
        env.setdefault("JAX_PLATFORMS", "cpu")
        procs.append(subprocess.Popen(command, env=env))
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated launcher ends its processes
    return _watch(procs, command, args.grace)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _watch(procs: list[subprocess.Popen], command: list[str], grace: float) -> int:
    failed: tuple[int, int] | None = None
    deadline = None
    ended_by_launcher = []
    try:
        while [p.poll() for p in procs].count(None):  # poll every one, no short circuit
            if failed is None:
                failed = root_cause([p.returncode for p in procs])
                if failed is not None:
                    deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                ended_by_launcher = [i for i, p in enumerate(procs) if p.poll() is None]
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    for p in procs:
        p.wait()
    if failed is None:
        failed = root_cause([p.returncode for p in procs])
    if failed is None:
        return 0
    i, code = failed
    others = (
        "the launcher ended " + ", ".join(map(str, ended_by_launcher))
        if ended_by_launcher
        else "the others stopped"
    )
    print(
        f"shardkit launch: process {i} of {len(procs)} {_describe(code)}; {others}. "
        + _restart_point(command),
        file=sys.stderr,
        flush=True,
    )
    return 1


def root_cause(codes: list[int | None]) -> tuple[int, int] | None:
    """(index, exit code) of the process whose failure to report, of those seen failed at
    once: one killed by a signal from outside first, then one that exited with an error,
    then one that aborted (SIGABRT: what a process's collective library does when a peer
    vanishes mid-collective, a consequence rather than the cause). ``None`` if none failed.

    Example:
      >>> root_cause([-signal.SIGABRT, -signal.SIGKILL])   # the peer's abort came first
      (1, -9)
      >>> root_cause([None, 0]) is None
      True
    """

    def rank(code: int) -> int:
        return 2 if code == -signal.SIGABRT else 0 if code < 0 else 1

    failed = [(rank(c), i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    return min(failed)[1:] if failed else None


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + 3
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def join_launched_run(requested_devices: int | None):
    """In a process ``shardkit launch`` started: join the run; its devices, else ``None``.

    ``requested_devices`` (default 8) emulated CPU devices are split evenly between the
    processes.
    """
    if not distributed.launched():
        return None
    processes = int(os.environ[distributed.ENV_NUM_PROCESSES])
    total = requested_devices or DEFAULT_CPU_DEVICES
    if total % processes:
        from shardkit.cli.fixes import FlagError

        nearest = max(1, round(total / processes)) * processes
        raise FlagError(
            f"--devices {total} does not split over {processes} processes.",
            [{"--devices": str(nearest)}],
        )
    distributed.initialize(cpu_devices=total // processes)
    import jax

    return jax.devices()
