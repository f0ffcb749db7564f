"""Every command reads well at 80 columns and spells --json, --mesh and outputs alike."""

import json

import pytest

from shardkit.cli import main
from shardkit.cli.options import parse_mesh


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


def lines_of(text):
    return [line for line in text.splitlines() if line.strip()]


def test_report_fits_80_columns_and_keeps_leaf_names(narrow, capsys):
    assert (
        main(
            [
                "report",
                "--model",
                "gpt-tiny",
                "--recipe",
                "dp_tp_sp",
                "--mesh",
                "tensor=2",
                "--remat",
                "full",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    assert "dp_tp_sp on data=4 × tensor=2" in out
    # Collectives name the layer that caused them, not a truncated op name.
    assert "layers/mlp/down" in out or "layers/attn/out" in out


def test_plan_table_keeps_every_path_whole(narrow, capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    args = ["plan", "--model", "llama-tiny", "--recipe", "fsdp", "--all", "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    paths = [leaf["path"] for leaf in json.loads(out_json.read_text())["leaves"]]
    starts = [line.split()[0] for line in lines_of(out)]
    # mu and nu's leaves differ only in the middle: a cut there would make two rows alike.
    assert "opt_state/1/0/mu/layers/mlp/down/kernel" in paths
    assert all(starts.count(p) == 1 for p in paths)


def test_compare_fits_80_columns(narrow, capsys):
    assert main(["compare", "--model", "gpt-tiny", "--recipes", "dp,fsdp", "--itemise"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    assert out.count("temp memory at its peak") == 2  # --itemise: one table per recipe


def test_run_fits_80_columns(narrow, capsys):
    assert main(["run", "--steps", "1", "--devices", "2", "--seq", "16", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    assert "memory / device" in out and "largest collectives by cause" in out


def test_recipes_fit_80_columns(narrow, capsys):
    from shardkit import recipes

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    lines = lines_of(out)
    first = next(i for i, line in enumerate(lines) if "────" in line) + 1
    names = [line.split()[0] for line in lines[first:] if not line.startswith("--wide")]
    assert names == recipes.names()


def test_reshard_plan_fits_80_columns_and_keeps_leaf_names(narrow, capsys):
    argv = ["reshard-plan", "--from", "fsdp@8", "--to", "tp@4"]
    assert main([*argv, "--json"]) == 0
    paths = [leaf["path"] for leaf in json.loads(capsys.readouterr().out)["leaves"]]
    assert main(argv) == 0
    lines = lines_of(capsys.readouterr().out)
    assert max(len(line) for line in lines) <= 80
    first = next(i for i, line in enumerate(lines) if "────" in line) + 1
    last = next(i for i, line in enumerate(lines) if "--json" in line)
    rows = [line.split()[0] for line in lines[first:last]]
    assert rows == paths  # whole: mu's and nu's leaves differ only in the middle


def test_autoplan_fits_80_columns(narrow, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path))
    assert (
        main(
            [
                "autoplan",
                "--devices",
                "2",
                "--batch",
                "2",
                "--seq",
                "16",
                "--recipes",
                "dp",
                "--remat",
                "none",
                "--memory-gb",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert max(len(line) for line in lines_of(out)) <= 80
    assert "dp data=2 remat=none f32" in out


def test_json_means_the_same_in_every_command(tmp_path, capsys):
    # Alone: JSON on stdout, no tables.
    assert main(["plan", "--model", "gpt-tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == {"fsdp": 8}
    # With a path: the file, and the tables on the terminal as usual.
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--json", str(out)]) == 0
    assert "per device" in capsys.readouterr().out
    assert json.loads(out.read_text())["recipe"] == "fsdp"
    assert main(["report", "--model", "gpt-tiny", "--recipe", "dp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recipe"] == "dp" and d["workload"]["batch"] == 8
    assert d["memory_terms"] == []  # itemised only when asked (--itemise)
    # recipes and reshard-plan too.
    assert main(["recipes", "--json", str(tmp_path / "recipes.json")]) == 0
    assert "shardkit recipes" in capsys.readouterr().out
    assert json.loads((tmp_path / "recipes.json").read_text())[0]["name"] == "dp"
    assert main(["reshard-plan", "--from", "fsdp@8", "--to", "tp@4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["processes"] == 1


def test_mesh_flag_sizes_the_recipes_axes(capsys):
    assert (
        main(["plan", "--model", "gpt-tiny", "--recipe", "fsdp_tp", "--mesh", "tensor=2", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["mesh"] == {"fsdp": 4, "tensor": 2}
    assert parse_mesh("data=-1, tensor=4") == {"data": -1, "tensor": 4}


@pytest.mark.parametrize("bad", ["data", "data=x", "data=2,data=4", ","])
def test_bad_mesh_flags_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--mesh", bad])
    assert e.value.code == 2
    assert "NAME=SIZE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--json", "/nonexistent/dir/r.json"], "does not exist"),
        (["compare", "--recipes", "dp", "--plot", "out.txt"], "matplotlib as .png"),
        (["run", "--steps", "1", "--json", "/nonexistent/r.json"], "does not exist"),
        (["plan", "--json", "/"], "is a directory"),
    ],
)
def test_output_paths_are_checked_before_any_work(argv, message, capsys, monkeypatch):
    # Nothing may resolve a model, plan or compile first: a bad output path fails fast.
    # (Work that starts later, to check the fix the error suggests, fails here too.)
    from shardkit.cli import preflight
    from shardkit.errors import ShardingError

    def no_work(*args, **kwargs):
        raise ShardingError("work started before the output path was checked")

    monkeypatch.setattr(preflight, "resolve_model", no_work)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "work started" not in err


@pytest.mark.parametrize(
    "argv",
    [["run", "--steps", "1"], ["report", "--recipe", "fsdp"], ["compare", "--recipes", "fsdp"]],
)
@pytest.mark.parametrize("flag", [True, False])
def test_explicit_flag_reaches_the_plan(argv, flag, capsys, monkeypatch):
    # Nothing compiles: the plan each command builds is caught where it is used.
    from shardkit import errors, run
    from shardkit.cli import report_cmd

    plans = []

    def caught(*args, **kwargs):
        plans.append(next(a for a in args if hasattr(a, "mesh")))
        raise errors.ShardingError("caught")

    monkeypatch.setattr(run, "run", caught)
    monkeypatch.setattr(report_cmd, "build_report", caught)
    assert main([*argv, "--model", "gpt-tiny", *(["--explicit"] if flag else [])]) == 2
    assert [p.explicit for p in plans] == [flag]
