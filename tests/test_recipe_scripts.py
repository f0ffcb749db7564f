"""The scripts in recipes/: one per recipe, each calling the shared entry point with its own
recipe, and a short run (2 steps, with the report) of one script per engine.

Every script is the same three lines around ``common.train_and_report`` (or its pipelined
twin) with its own recipe name, model and overrides; what each recipe computes is checked
against one device in tests/test_train.py, tests/parallel/test_pipeline.py and
tests/test_moe.py. So all scripts are read here and the scripts of different engines run.
"""

import ast
import runpy
import sys
from pathlib import Path

import pytest

import shardkit as sk
from shardkit.models import get

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SCRIPTS = sorted(p.stem for p in RECIPES.glob("*.py") if p.stem != "common")
#: One script per engine: plain GSPMD, TSP's ring, context parallelism (ring × Ulysses),
#: the pipelined step with TP + SP (3D), MoE's all-to-all.
RUN = ("dp", "tsp", "cp_usp", "dp_tp_sp_pp", "ep")


def test_one_script_per_recipe():
    assert set(SCRIPTS) == set(sk.recipes.names())
    assert set(RUN) <= set(SCRIPTS)


def entry_call(name: str) -> ast.Call:
    """The one call under the script's ``if __name__ == "__main__":``."""
    tree = ast.parse((RECIPES / f"{name}.py").read_text())
    (main,) = [n for n in tree.body if isinstance(n, ast.If)]
    assert ast.unparse(main.test) == "__name__ == '__main__'"
    (stmt,) = main.body
    assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
    return stmt.value


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_trains_its_own_recipe_on_a_model_that_exists(name):
    call = entry_call(name)
    pipelined = "stage" in dict(sk.recipes.get(name).mesh_axes)
    want = "train_pipelined_and_report" if pipelined else "train_and_report"
    assert ast.unparse(call.func) == want, f"recipes/{name}.py calls {ast.unparse(call.func)}"
    assert [ast.literal_eval(a) for a in call.args] == [name]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    overrides = {k: v for k, v in kwargs.items() if k not in ("model", "devices", "seq")}
    get(kwargs.get("model", "gpt-tiny"), **overrides)  # the model and its overrides resolve


@pytest.mark.scripts
@pytest.mark.parametrize("name", RUN)
def test_recipe_script_runs(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--steps", "2"])
    monkeypatch.syspath_prepend(str(RECIPES))
    runpy.run_path(str(RECIPES / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "step   1  loss" in out and "entropy bound" in out
    assert "wire bytes per device per step" in out and "memory per device" in out
