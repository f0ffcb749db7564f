"""Every table the command line prints fits the terminal with its names whole.

At 80 columns no row wraps and no name (recipe, mesh, path) is cut; numbers are short
(``1.4G``) with the unit in the title; columns that do not fit are named under the table
and shown by ``--wide``.
"""

import json
import re
from types import SimpleNamespace

import pytest

from shardkit import recipes
from shardkit.cli import main
from shardkit.cli.recipes_cmd import recipes_table
from shardkit.cli.report_cmd import comparison_table
from shardkit.report.tables import short_bytes, to_lines

GIB, MIB, KIB = 2**30, 2**20, 2**10


def test_short_bytes_by_hand():
    assert short_bytes(999) == "999"
    assert short_bytes(1000) == "1.0K"  # 0.98 KiB: four characters, never "1000"
    assert short_bytes(1536) == "1.5K"
    assert short_bytes(654 * MIB) == "654M"
    assert short_bytes(1.43 * GIB) == "1.4G"
    assert short_bytes(1023.9 * KIB) == "1.0M"
    assert short_bytes(12 * 2**40) == "12T"


def _fake_report(mesh, arguments, temp, wire):
    """What the comparison table reads of a report, with numbers set by hand."""
    return SimpleNamespace(
        mesh=mesh,
        memory=SimpleNamespace(arguments=arguments, temp=temp, total=arguments + temp),
        wire_bytes=wire,
        ratios=lambda: {"wire_bytes": 1.25},
        analytic=None,
        workload=None,
        replicated_fraction=0.5,
        warnings=["a warning"],
    )


#: The recipes whose names and meshes the old table cut to ``fsdp_…`` and ``dp_tp…``.
NAMES = ("fsdp_tp", "fsdp_cp", "dp_tp_sp", "dp_tp_sp_pp", "dp_tsp_gspmd", "zeropp")


@pytest.fixture(scope="module")
def fake_reports():
    out = {}
    for i, name in enumerate(NAMES):
        mesh = recipes.get(name).axis_sizes(8)
        out[name] = _fake_report(mesh, 1.43 * GIB, 654 * MIB, (i + 1) * 100 * MIB)
    return out


def _rows(lines, names):
    return {n: [line for line in lines if line.split()[:1] == [n]] for n in names}


@pytest.mark.parametrize("width", [80, 120, 200])
def test_compare_table_one_line_per_recipe_names_whole(fake_reports, width):
    lines = to_lines(comparison_table(fake_reports, width=width), width)
    assert max(map(len, lines)) <= width
    assert not any(cell.endswith("…") for line in lines for cell in line.split())
    rows = _rows(lines, NAMES)
    for name, report in fake_reports.items():
        (row,) = rows[name]  # one line, the name whole in the first cell
        mesh = "×".join(f"{a}={s}" for a, s in report.mesh.items())
        assert row.split()[1] == mesh
        assert "1.4G" in row and "654M" in row  # 1.43 GiB state, 654 MiB temp
    assert "K/M/G = KiB/MiB/GiB" in lines[0]  # the unit in the heading
    header = lines[1].split()
    assert header[:2] == ["recipe", "mesh"] and "total" in header and "wire/step" in header
    if width == 200:
        assert "warnings" in header and not any("--wide" in line for line in lines)
    if width == 80:  # what was left out is named, and --wide shows it
        (note,) = [line for line in lines if line.startswith("--wide adds:")]
        left_out = note.removeprefix("--wide adds:").split(",")
        assert "warnings" in [x.strip() for x in left_out]
        wide = to_lines(comparison_table(fake_reports, width=80, wide=True), 80)
        assert "warnings" in wide[1].split() and "wire/analytic" in wide[1].split()
        assert len(_rows(wide, NAMES)["fsdp_cp"]) == 1  # wider than 80, still one line


def test_compare_command_at_80_columns(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    names = ["fsdp_tp", "fsdp_cp"]  # the old table cut both to "fsdp_…"
    out_json = tmp_path / "compare.json"
    args = ["compare", "--recipes", ",".join(names), "--seq", "16", "--json", str(out_json)]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert max(map(len, lines)) <= 80
    data = json.loads(out_json.read_text())["reports"]
    rows = _rows(lines, names)
    (header,) = [line.split() for line in lines if line.split()[:2] == ["recipe", "mesh"]]
    for name in names:
        (row,) = rows[name]
        cells = row.split()
        mesh = "×".join(f"{a}={s}" for a, s in data[name]["mesh"].items())
        assert cells[1] == mesh
        # The total cell, read back as bytes (K/M/G = KiB/MiB/GiB), is the JSON's total.
        total = data[name]["memory_per_device_bytes"]["total"]
        number, unit = re.fullmatch(r"([\d.]+)([KMGT]?)", cells[header.index("total")]).groups()
        shown = float(number) * 1024 ** " KMGT".index(unit or " ")
        assert abs(shown - total) <= 0.05 * total, (cells, total)
        assert all(re.fullmatch(r"[\d.]+[KMGT]?|[\d.]+%|–", c) for c in cells[2:]), row


def test_plan_at_80_columns_specs_on_one_line(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--model", "gpt-tiny", "--recipe", "fsdp_tp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    (header,) = [line.split() for line in lines if line.startswith("path ")]
    row = {
        line.split()[0]: dict(zip(header, line.split(), strict=True))
        for line in lines
        if line.startswith("params/")
    }
    # qkv kernel (layers, embed, 3, heads, kv): embed over fsdp=2, heads over tensor=4;
    # 2×64×3×8×8 f32 over 8 devices is 2·64·3·8·8·4 / 8 = 12,288 bytes (hand count).
    qkv = row["params/layers/attn/qkv/kernel"]
    assert qkv["shape"] == "2×64×3×8×8" and qkv["spec"] == "·,fsdp,·,tensor,·"
    assert qkv["bytes"] == "12K"
    assert row["params/wte/embedding"]["spec"] == "tensor,fsdp"
    assert len(row) == 16  # gpt-tiny's 16 parameters, one line each
    # --wide shows the shard's shape too: 2×(64/2)×3×(8/4)×8.
    assert main(["plan", "--model", "gpt-tiny", "--recipe", "fsdp_tp", "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (header,) = [line for line in lines if line.startswith("path ")]
    (qkv,) = [line for line in lines if line.startswith("params/layers/attn/qkv/kernel ")]
    names = header.replace("logical axes", "logical_axes").split()
    assert dict(zip(names, qkv.split(), strict=True))["shard"] == "2×32×3×2×8"


@pytest.mark.parametrize("width", [80, 120, 200])
def test_recipes_table_names_whole(width):
    rows = [
        {"name": n, "summary": recipes.get(n).summary, "mesh_axes": list(recipes.get(n).mesh_axes)}
        for n in recipes.names()
    ]
    lines = to_lines(recipes_table(rows, width=width), width)
    assert max(map(len, lines)) <= width
    starts = [line.split()[0] for line in lines[3:] if line.strip() and "--wide" not in line]
    assert starts == recipes.names()
    fits = [r for r in rows if len(r["summary"]) <= width - 14]  # 12 + 2: the name column
    for r in fits:
        assert any(r["summary"] in line for line in lines), r["name"]
    if width >= 120:  # room for the meshes and every summary whole
        assert "mesh" in lines[1].split() and len(fits) == len(rows)
        assert any("data=rest,stage=2,tensor=2" in line for line in lines)


def test_recipes_command_at_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    assert sum(line.split()[:1] == ["dp_tsp_gspmd"] for line in lines) == 1


def test_reshard_plan_at_80_columns_paths_whole(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    out_json = tmp_path / "reshard.json"
    args = ["reshard-plan", "--from", "fsdp@8", "--to", "dp_tp_sp@8", "--json", str(out_json)]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    paths = [leaf["path"] for leaf in json.loads(out_json.read_text())["leaves"]]
    starts = [line.split()[0] for line in lines if line.strip()]
    # mu's and nu's leaves differ only in the middle of their paths: both whole, once each.
    assert "opt_state/1/0/nu/layers/attn/out/bias" in paths
    assert all(starts.count(p) == 1 for p in paths)
