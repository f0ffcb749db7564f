"""Every script in recipes/ runs (a short run: 2 steps) and prints its report."""

import runpy
import sys
from pathlib import Path

import pytest

import shardkit as sk

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_one_script_per_recipe():
    scripts = {p.stem for p in RECIPES.glob("*.py")} - {"common"}
    assert scripts == set(sk.recipes.names())


@pytest.mark.parametrize("name", sk.recipes.names())
def test_recipe_script_runs(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--steps", "2"])
    monkeypatch.syspath_prepend(str(RECIPES))
    runpy.run_path(str(RECIPES / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "step   1  loss" in out and "entropy bound" in out
    assert "wire bytes per device per step" in out and "memory per device" in out
