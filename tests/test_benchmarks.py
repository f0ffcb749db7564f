"""Every benchmark script runs on its tiny config, so none of them can rot."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = [
    "layout",
    "memory_terms",
    "overhead",
    "compile_scaling",
    "planning",
    "pipeline",
    "tsp",
    "moe",
    "explicit",
    "autoplan",
    "gpu",
]


def test_run_all_lists_every_script():
    on_disk = {p.stem for p in BENCH.glob("*.py")} - {
        "bench_util",
        "run_all",
        "flax_baseline",
        "pages",
    }
    assert on_disk == set(SCRIPTS)
    tree = ast.parse((BENCH / "run_all.py").read_text())
    [listed] = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SCRIPTS"
    ]
    assert listed == tuple(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_runs_tiny(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if name == "gpu":  # no GPU in CI: it must say so and succeed
        assert "no GPU here" in proc.stdout
        return
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["rows"] and result["machine"]["backend"] == "cpu"
    assert "|---|" in proc.stdout
