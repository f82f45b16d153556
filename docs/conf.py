"""Sphinx configuration of sharded's documentation site (``make docs``).

Sphinx rather than MkDocs: torch's and Lightning's sites, the ones sharded's users know, are
Sphinx; autodoc renders signatures with their types from the code itself and napoleon reads the
Google-style ``Args:`` sections the docstrings use; sphinx-argparse renders the
``python -m sharded.plan`` reference from its argparse parser; MyST lets the guides stay Markdown,
readable on GitHub and movable from the README unchanged. Warnings are errors (``-W``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sharded  # noqa: E402

project = "sharded"
author = "the sharded authors"
copyright = "2026, the sharded authors"
release = version = sharded.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"sharded {release}"
html_static_path: list[str] = []

# signatures read `Iterable[Tensor]`, not `~typing.Iterable[~torch.Tensor]`
python_use_unqualified_type_names = True
autodoc_typehints_format = "short"
