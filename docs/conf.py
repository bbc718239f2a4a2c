"""Sphinx configuration: guides in Markdown (MyST, as README.md is), the
API reference generated from the package's docstrings by autodoc (they are
reStructuredText; napoleon reads the Google-style sections of torch's own
docstrings that methods such as EmbeddingBag.forward inherit). Builds offline: no intersphinx,
no remote assets. The tests build it with warnings as errors
(tests/test_docs.py)."""
import hostembed

project = "hostembed"
author = "the hostembed authors"
copyright = "2026, the hostembed authors"
release = version = hostembed.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"

html_theme = "furo"
html_title = f"hostembed {release}"
