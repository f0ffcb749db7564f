"""shardkit.devices: compiling at LLVM level 0 (what the planner's workers and this suite
do, tests/conftest.py) does not change what a compile-only report measures."""

import json
import os
import subprocess
import sys

from shardkit.devices import COMPILE_ONLY_XLA_FLAGS

PROBE = """
import json, shardkit as sk
sk.emulate_devices(8)
from shardkit import models
out = {}
for recipe in ("dp_tp_sp", "dp_pp"):
    r = sk.report.build_report(sk.Plan(recipe), model=models.get("gpt-tiny"), batch=16, seq=64)
    out[recipe] = [r.memory.temp, r.memory.arguments,
                   sorted((c.kind, c.pass_, c.source, list(c.shape), c.wire_bytes, c.count) for c in r.collectives)]
print(json.dumps(out))
"""


def measured(xla_flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_llvm_level_0_leaves_memory_and_collectives_as_they_are():
    # LLVM's optimisation level acts after XLA's HLO passes and buffer assignment: the
    # compiled memory and every collective (kind, pass, source line, shape, bytes) of a
    # data+tensor+sequence step and a pipeline step are the same at level 0 and default.
    assert COMPILE_ONLY_XLA_FLAGS in os.environ["XLA_FLAGS"]  # the suite's own setting
    o0 = measured(os.environ["XLA_FLAGS"])
    default = measured(os.environ["XLA_FLAGS"].replace(COMPILE_ONLY_XLA_FLAGS, ""))
    assert o0 == default
    assert all(o0[r][2] for r in o0)  # each step moves something: the comparison is not empty
