"""Every benchmark script runs on its tiny config, so none of them can rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # run_all's own imports (bench_util, pages) live there
from run_all import SCRIPTS  # noqa: E402  the one list of benchmark scripts


def test_run_all_lists_every_script():
    on_disk = {p.stem for p in BENCH.glob("*.py")} - {
        "bench_util",
        "run_all",
        "flax_baseline",
        "pages",
        "compare_results",
    }
    assert on_disk == set(SCRIPTS)


def _run_tiny(name, out, *extra):
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--tiny", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.scripts
@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_runs_tiny(name, tmp_path):
    # the pipeline table's long runs resume from a cache of finished rows: checked below
    extra = ("--cache", str(tmp_path / "rows.json")) if name == "pipeline" else ()
    proc = _run_tiny(name, tmp_path, *extra)
    if name == "gpu":  # no GPU in CI: it must say so and succeed
        assert "no GPU here" in proc.stdout
        return
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["rows"] and result["machine"]["backend"] == "cpu"
    assert "|---|" in proc.stdout
    if name == "pipeline":  # a rerun takes its rows from the cache instead of compiling
        cache = json.loads((tmp_path / "rows.json").read_text())
        assert len(cache) == len(result["rows"])
        for row in cache.values():
            row["temp"] = 7 * 2**20  # a figure no compile gives: 7 MiB temp in every row
        (tmp_path / "rows.json").write_text(json.dumps(cache))
        _run_tiny(name, tmp_path / "again", "--cache", str(tmp_path / "rows.json"))
        again = json.loads((tmp_path / "again" / f"{name}.json").read_text())
        assert again["rows"] != result["rows"]
        measured = [row for row in again["rows"] if row[2] != "—"]  # not an error row
        assert measured and all(row[4] == 7.0 for row in measured)  # the temp MiB column


def test_compare_results_flags_a_changed_byte_and_nothing_else(tmp_path):
    from compare_results import main

    table = {
        "headers": ["recipe", "total MiB", "compile s"],
        "rows": [["dp", 100.0, 3.0], ["fsdp", 50.0, 4.0]],
        "details": [{"recipe": "dp", "memory": {"temp": 1000, "total": 2000}, "seconds": 1}],
        "machine": {"date": "then"},
    }
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()

    def write(side, changes):
        data = json.loads(json.dumps(table))
        changes(data)
        (side / "layout.json").write_text(json.dumps(data))

    write(before, lambda d: None)
    # timings, dates and seconds differ between any two runs: not figures
    write(after, lambda d: (d["rows"][0].__setitem__(2, 9.0), d["machine"].update(date="now")))
    assert main([str(before), str(after)]) == 0
    write(after, lambda d: d["details"][0]["memory"].update(temp=1001))  # one byte
    assert main([str(before), str(after)]) == 1
    write(after, lambda d: d["rows"][1].__setitem__(1, 50.0 * (1 + 1e-12)))  # float rounding
    assert main([str(before), str(after)]) == 0
    write(after, lambda d: d["rows"].pop())  # a row gone
    assert main([str(before), str(after)]) == 1
    assert main([str(before), str(after), "--partial"]) == 0  # some rows regenerated only
