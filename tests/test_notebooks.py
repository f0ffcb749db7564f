"""Every notebook in notebooks/ runs top to bottom in a fresh kernel without an error."""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


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
        nb,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
