"""``shardkit report --itemise``: the temp memory at its peak by term, in tables and JSON."""

import json

from shardkit.cli import main
from shardkit.report.memory_terms import TERMS
from shardkit.report.records import human_bytes


def test_itemise_splits_the_temp_memory_into_terms(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "report",
                "--devices",
                "2",
                "--seq",
                "16",
                "--remat",
                "full",
                "--itemise",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    terms = d["memory_terms"]
    # The terms add up to XLA's own temp size (its memory analysis, not the itemiser).
    assert sum(t["bytes"] for t in terms) == d["memory_per_device_bytes"]["temp"]
    assert [t["term"] for t in terms] == [t for t in TERMS if t in {x["term"] for x in terms}]
    assert d["memory_peak_phase"] == "layers"
    # The table: one row per term with its bytes, at 80 columns.
    assert "temp memory at its peak (layers phase), by term" in text
    rows = {
        line.split("  ")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("  ") and line.split("  ")[1].strip() in TERMS
    }
    assert set(rows) == {t["term"] for t in terms}
    for t in terms:
        assert human_bytes(t["bytes"]) in rows[t["term"]]
    assert max(len(line) for line in text.splitlines()) <= 80


def test_the_collectives_by_cause_keep_kind_leaf_and_source_line_at_80_columns(monkeypatch, capsys):
    # cp's ring permutes are made by shardkit's attention block (the "where" column names
    # it) at a line of the model, gpt.py: both must survive the 80-column cut.
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["report", "--recipe", "cp", "--devices", "2", "--seq", "16"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 80
    start = text.index("largest collectives by cause")
    rows = [line.split() for line in text[start:].splitlines()[3:] if line.strip()]
    permutes = [r for r in rows if r[0] == "permute"]
    assert permutes and all(r[1] in {"fwd", "bwd", "remat"} for r in permutes)
    assert all(r[2].startswith("attention.") for r in permutes)
    assert all(r[3].startswith("gpt.py:") and r[3][7:].isdigit() for r in permutes)
    header = text[start:].splitlines()[1].split()
    assert header == ["kind", "pass", "where", "source", "runs", "wire"]
