"""``shardkit report --itemise``: the temp memory at its peak by term, in tables and JSON."""

import json

from shardkit.cli import main
from shardkit.report.lint import human_bytes
from shardkit.report.memory_terms import TERMS


def test_itemise_splits_the_temp_memory_into_terms(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "report.json"
    assert main(["report", "--devices", "2", "--seq", "16", "--remat", "full", "--itemise",
                 "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    terms = d["memory_terms"]
    # The terms add up to XLA's own temp size (its memory analysis, not the itemiser).
    assert sum(t["bytes"] for t in terms) == d["memory_per_device_bytes"]["temp"]
    assert [t["term"] for t in terms] == [t for t in TERMS if t in {x["term"] for x in terms}]
    assert d["memory_peak_phase"] == "layers"
    # The table: one row per term with its bytes, at 80 columns.
    assert "temp memory at its peak (layers phase), by term" in text
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()
            if line.startswith("  ") and line.split("  ")[1].strip() in TERMS}  # fmt: skip
    assert set(rows) == {t["term"] for t in terms}
    for t in terms:
        assert human_bytes(t["bytes"]) in rows[t["term"]]
    assert max(len(line) for line in text.splitlines()) <= 80
