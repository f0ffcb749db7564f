"""The docs site's promises: the how-to guides' code runs, the API reference lists every
public name, the tutorials are the notebooks, and the benchmark pages are generated."""

import importlib
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import shardkit as sk

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted(p for p in (DOCS / "howto").glob("*.md") if p.name != "index.md")
#: A block whose first line starts so is shown, not run (it needs hardware the suite lacks).
NOT_RUN = "# Not run by the tests:"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _check_pipelines(namespace: dict) -> None:
    """The pipelined step trains to the loss of the same model without a pipeline."""
    np.testing.assert_allclose(
        float(namespace["metrics"]["loss"]), float(namespace["want"]), rtol=1e-5
    )


#: What a page's code must leave behind, beyond running (page stem -> check).
CHECKS = {"pipelines": _check_pipelines}


def test_guides_exist():
    assert len(GUIDES) >= 10, [p.name for p in GUIDES]


@pytest.mark.scripts
@pytest.mark.parametrize("path", GUIDES, ids=[p.stem for p in GUIDES])
def test_guide_code_runs(path, monkeypatch, tmp_path, capsys):
    """Every ```python block of the page, top to bottom in one namespace, as a reader
    would paste them; a block marked NOT_RUN is skipped and must say why."""
    from shardkit import recipes

    monkeypatch.chdir(ROOT)  # `from examples import my_model`, as from the repo root
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if hasattr(recipes, "_REGISTRY"):  # a guide may register a recipe: keep it to the page
        monkeypatch.setattr(recipes, "_REGISTRY", dict(recipes._REGISTRY))
    blocks = python_blocks(path.read_text())
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    ran = 0
    for i, block in enumerate(blocks):
        if block.startswith(NOT_RUN):
            reason = block.splitlines()[0][len(NOT_RUN) :].strip()
            assert reason, f"{path.name} block {i}: say why it is not run"
            continue
        exec(compile(block, f"{path.relative_to(ROOT)} (block {i})", "exec"), namespace)
        ran += 1
    capsys.readouterr()
    if path.stem in CHECKS:
        CHECKS[path.stem](namespace)
    if not ran:
        pytest.skip(f"{path.name}: no block runs here (each says why)")


def test_not_run_blocks_say_so_in_the_page():
    """A skipped block carries its marker as its first line, visible on the page."""
    for path in GUIDES:
        for block in python_blocks(path.read_text()):
            if "Not run" in block.split("\n", 1)[0]:
                assert block.startswith(NOT_RUN), (path.name, block.split("\n", 1)[0])


def _api_names() -> list[str]:
    text = (DOCS / "api" / "index.md").read_text()
    names = []
    for body in re.findall(r"\.\. autosummary::\n((?:   .*\n|\n)+)", text):
        names += [
            line.strip()
            for line in body.splitlines()
            if line.strip() and not line.strip().startswith(":")
        ]
    return names


def test_api_reference_lists_every_public_name():
    """Every name of ``shardkit.__all__`` has its page (a module exported under a short
    name, ``sk.loss``, may be listed by its own path, ``nn.loss``)."""
    names = _api_names()
    assert len(names) == len(set(names)), "a name is listed twice"

    def listed(name: str) -> bool:
        obj = getattr(sk, name)
        own = obj.__name__.removeprefix("shardkit.") if isinstance(obj, types.ModuleType) else ""
        return name in names or own in names

    missing = sorted(n for n in sk.__all__ if not listed(n))
    assert not missing, f"add to docs/api/index.md: {missing}"
    # Anything else listed is a public module of the package (never an internal path).
    for extra in sorted(set(names) - set(sk.__all__)):
        module = importlib.import_module(f"shardkit.{extra}")
        assert isinstance(module, types.ModuleType) and getattr(module, "__all__", None), extra


def _code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_tutorial_is_the_notebook_executed(path):
    """docs/tutorials/ holds each notebook as docs/execute_notebooks.py ran it: the same
    code, cell for cell, every code cell executed and none with an error."""
    stored = DOCS / "tutorials" / path.name
    assert stored.exists(), f"run: python docs/execute_notebooks.py {path.stem}"
    assert _code_cells(stored) == _code_cells(path), (
        f"{path.name} changed since its docs copy ran: python docs/execute_notebooks.py {path.stem}"
    )
    cells = [c for c in json.loads(stored.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in cells if "".join(c["source"]).strip())
    assert not [o for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert any(c.get("outputs") for c in cells)
    # The executor draws with Agg, where plt.show() shows nothing: a figure is saved and
    # displayed as an image, and the stored copy holds it.
    sources = ["".join(c["source"]) for c in cells]
    assert not [s for s in sources if "plt.show()" in s], "save the figure and display(Image(...))"
    for cell, source in zip(cells, sources, strict=True):
        if "display(Image(" in source:
            kinds = {k for o in cell.get("outputs", []) for k in o.get("data", {})}
            assert "image/png" in kinds, f"{path.name}: a figure cell stored no image"


@pytest.fixture
def pages(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("pages", None)
    return importlib.import_module("pages")


def test_benchmark_pages_are_generated_from_the_results(pages, tmp_path):
    """Each page under docs/benchmarks/ is exactly what the generator writes from
    benchmarks/results/*.json (so none was edited by hand, and none is stale), and
    carries the date and versions of its run."""
    written = pages.write_pages(ROOT / "benchmarks" / "results", tmp_path)
    assert {p.name for p in written} == {p.name for p in (DOCS / "benchmarks").glob("*.md")}
    for path in written:
        committed = (DOCS / "benchmarks" / path.name).read_text()
        assert committed == path.read_text(), (
            f"docs/benchmarks/{path.name} differs from its results: "
            "python benchmarks/run_all.py --assemble --readme"
        )
    layout = json.loads((ROOT / "benchmarks" / "results" / "layout.json").read_text())
    text = (DOCS / "benchmarks" / "layout.md").read_text()
    assert layout["machine"]["date"] in text and f"jax {layout['machine']['jax']}" in text
    images = {p.name for p in (tmp_path / "_images").iterdir()}
    assert images and images <= {p.name for p in (DOCS / "benchmarks" / "_images").iterdir()}


def test_benchmark_figures_are_png_and_svg_between_square_and_two_to_one():
    """Every committed benchmark figure has both formats and a shape a page shows whole;
    the ones a question asks for are there (memory vs devices, the TSP sweep)."""
    images = DOCS / "benchmarks" / "_images"
    pngs = sorted(images.glob("*.png"))
    assert {"planning.png", "tsp.png", "layout.png", "pipeline.png"} <= {p.name for p in pngs}
    for png in pngs:
        data = png.read_bytes()
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert 1.0 <= width / height <= 2.0, (png.name, width, height)
        assert png.with_suffix(".svg").exists(), png.name
    svg = (images / "planning.svg").read_text()
    assert (
        "against the number of devices" in svg and "fsdp, logits split over the vocabulary" in svg
    )


def test_readme_headline_is_the_generated_one(pages):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- BENCHMARKS:BEGIN -->", 1)[1].split("<!-- BENCHMARKS:END -->")[0]
    assert section.strip() == pages.headline(ROOT / "benchmarks" / "results").strip()
