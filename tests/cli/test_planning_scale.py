"""Plan a cluster from a laptop: 7B on 256 emulated devices, nothing allocated."""

import json
import os
import subprocess
import sys


def test_report_gpt_7b_fsdp_on_256_devices():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "report",
            "--model",
            "gpt-7b",
            "--recipe",
            "fsdp",
            "--devices",
            "256",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["devices"] == 256 and d["mesh"] == {"fsdp": 256}
    # params + Adam moments per device at the ZeRO-3 limit, 12Ψ/N bytes in f32
    assert d["ratios"]["state_memory"] < 1.05
    assert d["ratios"]["wire_bytes"] < 1.15
    assert d["warnings"] == []
