"""``shardkit autoplan``: compiles in a worker with the devices asked for, prints JSON."""

import json
import os
import struct
import subprocess
import sys


def test_autoplan_json_for_more_devices_than_this_process_has(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SHARDKIT_CACHE_DIR": str(tmp_path)}
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "autoplan",
        "--model",
        "gpt-tiny",
        "--devices",
        "16",
        "--batch",
        "16",
        "--seq",
        "32",
        "--recipes",
        "dp,fsdp,tp",
        "--remat",
        "none",
        "--memory-gb",
        "1",
        "--json",
        "--plot",
        str(tmp_path / "plan.png"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=True)
    got = json.loads(out.stdout)
    assert got["devices"] == 16 and got["hardware"]["name"] == "h100"
    ranked = {c["recipe"]: c for c in got["candidates"]}
    assert set(ranked) == {"dp", "fsdp"}  # tp: 8 heads, tensor=16
    assert ranked["dp"]["mesh"] == {"data": 16}
    # DP all-reduces every gradient once: 2·(N−1)/N · 4Ψ bytes per device (hand count).
    # Ψ = 124,672 for gpt-tiny, less the 96 × 64 rows of the 128-row position table that
    # a 32-token step never reads (XLA knows their gradient is zero and skips them).
    want = 2 * 15 / 16 * 4 * (124_672 - 96 * 64)
    assert abs(ranked["dp"]["wire_bytes"] - want) / want < 1e-4
    (tp,) = got["rejected"]
    assert tp["recipe"] == "tp" and "heads" in tp["reason"]
    # dp, and fsdp with each logits layout (vocab-parallel or token-parallel head)
    assert sorted(c["logits"] or "-" for c in got["candidates"]) == ["-", "tokens", "vocab"]
    assert len(list((tmp_path / "autoplan").glob("*.json"))) == 3
    png = (tmp_path / "plan.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    width, height = struct.unpack(">II", png[16:24])  # IHDR: between 1:1 and 2:1
    assert 1.0 <= width / height <= 2.0, (width, height)
