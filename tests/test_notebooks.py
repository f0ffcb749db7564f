"""Every notebook in notebooks/ runs top to bottom in a fresh kernel without an error.

A notebook whose sizes are set in a cell tagged ``parameters`` (papermill's convention)
runs here with :data:`SMOKE` overrides in a cell right after it: the same code on
gpt-tiny. The full-size run is the executed copy under docs/tutorials/, which
tests/test_docs.py checks is this code, run without an error.
"""

import ast
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))

#: Each parameterised notebook's overrides: gpt-small in notebook 02 (17 recipes) and
#: 03 took 98 s and 38 s here, gpt-tiny 68 s and 31 s, and on five recipes (one of each
#: kind: data, fsdp, tensor with sequence, context, TSP) notebook 02 takes 30 s.
SMOKE = {
    "02_recipes_side_by_side": 'MODEL, BATCH, SEQ = "gpt-tiny", 8, 64\n'
    'RECIPES = ["dp", "fsdp", "tp_sp", "cp", "tsp"]',
    "03_sequence_parallel": 'MODEL, B, S, T = "gpt-tiny", 8, 64, 4\nTSP_SEQ = 128',
}


def _assigned(source: str) -> set[str]:
    """The names a cell's code assigns."""
    tree = ast.parse(source)
    return {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def with_smoke_parameters(nb, stem: str):
    """``nb`` with :data:`SMOKE`'s overrides in a new cell after its ``parameters`` cell."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", ())]
    assert len(tagged) == (stem in SMOKE), f"{stem}: {len(tagged)} parameters cells"
    if tagged:
        extra = _assigned(SMOKE[stem]) - _assigned(nb.cells[tagged[0]].source)
        assert not extra, f"{stem}: SMOKE sets {extra}, which its parameters cell does not"
        override = nbformat.v4.new_code_cell(SMOKE[stem])
        override.id = "smoke-parameters"
        nb.cells.insert(tagged[0] + 1, override)
    return nb


def test_notebooks_exist():
    assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.mark.scripts
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, monkeypatch):
    # The kernel is a fresh process: it inherits this environment, and each notebook
    # makes its own 8 CPU devices with sk.emulate_devices(8).
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them"
    )
    client = NotebookClient(
        with_smoke_parameters(nb, path.stem),
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
