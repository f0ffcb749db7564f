"""Sphinx configuration: MyST Markdown and notebooks (myst-nb), the book theme, autodoc.

Build: pip install ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, not an installed copy
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The API pages are generated each build: drop the last build's, so a name no longer
# exported leaves no stale page behind.
shutil.rmtree(ROOT / "docs" / "api" / "_autosummary", ignore_errors=True)

import shardkit  # noqa: E402

project = "shardkit"
author = "the shardkit authors"
copyright = "2026, the shardkit authors"
release = version = shardkit.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# MyST: $...$ and $$...$$ math, amsmath environments, ::: fences, anchors for headings.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# The notebooks are rendered with the outputs stored in docs/tutorials/ (written by
# docs/execute_notebooks.py); building the site executes nothing.
nb_execution_mode = "off"
highlight_language = "none"  # a fence without a language is plain text

# API reference: from the docstrings (Google style), type hints in the descriptions.
autosummary_generate = True
autosummary_imported_members = True
autosummary_ignore_module_all = False  # a module's page lists its __all__, nothing else
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
# A name exported twice (``shardkit.ShardingError`` is ``shardkit.errors.ShardingError``)
# makes an unqualified reference ambiguous; Sphinx links it to the first, which is right.
suppress_warnings = ["ref.python"]  # "Attributes:" as fields, not a second entry beside autodoc's

html_theme = "sphinx_book_theme"
html_title = "shardkit"
html_static_path = ["_static"]
html_css_files = ["shardkit.css"]
templates_path = ["_templates"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
