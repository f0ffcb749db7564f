"""Compile candidates in a process with as many emulated devices as the plan needs.

A process's CPU device count is fixed when JAX's backend starts, so the planner
runs this module as ``python -m shardkit.autoplanner.worker`` when it needs more
devices than its own process has. It reads one JSON job on stdin
(``{"model", "batch", "seq", "devices", "candidates"}``) and prints one JSON line
per candidate as soon as it is compiled (``{"index", "evidence"}`` or
``{"index", "pruned"}``), which the planner turns into progress.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["compile_elsewhere"]


def compile_elsewhere(job: dict) -> Iterator[dict]:
    """Run ``job`` in a worker process; yield its result lines as they come."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "shardkit.autoplanner.worker"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)
    err = proc.stderr.read()
    if proc.wait() != 0:
        from shardkit.errors import ShardingError

        tail = "\n".join(err.strip().splitlines()[-5:])
        raise ShardingError(f"The autoplan worker ({job['devices']} devices) failed:\n{tail}")


def main() -> int:
    job = json.loads(sys.stdin.read())
    import jax

    jax.config.update("jax_num_cpu_devices", job["devices"])
    from shardkit.autoplanner.candidates import Candidate
    from shardkit.autoplanner.evaluate import Evidence, Subject, compile_candidate
    from shardkit.models import resolve

    subject = Subject.of(resolve(job["model"]), batch=job["batch"], seq=job["seq"])
    for index, c in enumerate(job["candidates"]):
        got = compile_candidate(subject, Candidate.from_json(c))
        out = {"evidence": got.to_json()} if isinstance(got, Evidence) else {"pruned": got.reason}
        print(json.dumps({"index": index, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
