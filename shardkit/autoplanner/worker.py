"""Compile candidates in a process with as many emulated devices as the plan needs.

A process's CPU device count is fixed when JAX's backend starts, so the planner
runs this module as ``python -m shardkit.autoplanner.worker`` when it needs more
devices than its own process has. It reads one JSON job on stdin
(``{"model", "batch", "seq", "devices", "candidates"}``) and prints one JSON line
per candidate as soon as it is compiled (``{"index", "evidence"}`` or
``{"index", "pruned"}``), which the planner turns into progress.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator

import jax

from shardkit.autoplanner.candidates import Candidate
from shardkit.autoplanner.evaluate import Evidence, Subject, compile_candidate
from shardkit.devices import compile_only_env
from shardkit.models import resolve

__all__ = ["compile_elsewhere", "main"]


def compile_elsewhere(job: dict, *, timeout_s: float | None = None) -> Iterator[dict]:
    """Run ``job`` in a worker process; yield its result lines as they come.

    A candidate that takes longer than ``timeout_s`` to compile, or whose compile kills
    the worker (out of memory), is given up (reported as ``pruned`` with the reason) and
    a new worker goes on with the rest.
    """
    candidates, done = job["candidates"], 0
    while done < len(candidates):
        rest = {**job, "candidates": candidates[done:]}
        for line in _run(rest, timeout_s):
            line["index"] += done
            yield line
            if "timeout" in line:
                break
        else:
            return
        done = line["index"] + 1


def _run(job: dict, timeout_s: float | None) -> Iterator[dict]:
    # Compile only, never run: LLVM at level 0 (shardkit.devices.COMPILE_ONLY_XLA_FLAGS)
    env = compile_only_env({**os.environ, "JAX_PLATFORMS": "cpu"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardkit.autoplanner.worker"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True
    ).start()
    # stderr drained as it comes (its last lines kept for the reason a worker died): left
    # unread, a worker's warnings fill the pipe and it blocks on its next write.
    err: collections.deque[str] = collections.deque(maxlen=20)
    drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    drain.start()
    index = 0
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            proc.kill()
            proc.wait()
            yield {
                "index": index,
                "timeout": True,
                "pruned": f"compiling took longer than {timeout_s:g} s (compile_timeout_s)",
            }
            return
        if line is None:
            break
        if line.startswith("{"):
            index += 1
            yield json.loads(line)
    returncode = proc.wait()
    drain.join()
    if returncode != 0 and index < len(job["candidates"]):  # the compiler died on one
        tail = " ".join(line.strip() for line in list(err)[-2:])[-300:]
        yield {
            "index": index,
            "timeout": True,
            "pruned": f"the compiling process stopped (exit status {proc.returncode}, "
            f"e.g. out of memory){': ' + tail if tail else ''}",
        }


def main() -> int:
    job = json.loads(sys.stdin.read())
    jax.config.update("jax_num_cpu_devices", job["devices"])  # before any device is used

    subject = Subject.of(resolve(job["model"]), batch=job["batch"], seq=job["seq"])
    for index, c in enumerate(job["candidates"]):
        got = compile_candidate(subject, Candidate.from_json(c))
        out = {"evidence": got.to_json()} if isinstance(got, Evidence) else {"pruned": got.reason}
        print(json.dumps({"index": index, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
