"""The import direction is a test: the layers contract in pyproject.toml, and no import
inside a function outside the command line (ruff's PLC0415, configured in pyproject.toml),
and the tree as `ruff format` writes it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install '.[test]'")
    return found


def test_imports_follow_the_layers_contract():
    done = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and " kept" in done.stdout


def test_no_function_level_imports_outside_the_command_line():
    done = subprocess.run(
        [_tool("ruff"), "check", "--select", "PLC0415", "shardkit"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_tree_is_formatted():
    # ruff is pinned to a minor version in pyproject.toml: its style changes between them.
    paths = ["shardkit", "tests", "benchmarks", "examples", "recipes", "docs", "notebooks"]
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", *paths, "conftest.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + "\nFix: ruff format " + " ".join(paths)
