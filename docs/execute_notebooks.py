"""Execute the notebooks in notebooks/ and store the executed copies under docs/tutorials/.

The site renders those copies as they are (``nb_execution_mode = "off"`` in conf.py), so
building the docs runs no notebook. tests/test_docs.py checks that each copy's code is the
notebook's code, cell for cell, and that every code cell ran without an error; rerun this
script after editing a notebook.

Run: python docs/execute_notebooks.py [NAME ...]   (all notebooks without names)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
SOURCE, TARGET = ROOT / "notebooks", ROOT / "docs" / "tutorials"


def execute(path: Path) -> float:
    """Run one notebook in a fresh kernel from notebooks/ and write its executed copy."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(SOURCE)}}
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, TARGET / path.name)
    return seconds


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("MPLBACKEND", "Agg")
    # The kernel starts in notebooks/: put this checkout's shardkit first on its path.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    TARGET.mkdir(parents=True, exist_ok=True)
    paths = sorted(SOURCE.glob("*.ipynb"))
    if argv:
        paths = [p for p in paths if p.stem in argv or p.name in argv]
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
