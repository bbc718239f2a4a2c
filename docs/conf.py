"""Sphinx configuration: guides in Markdown (MyST, as README.md is), the
API reference generated from the package's docstrings (autodoc; the
docstrings use reStructuredText roles, and napoleon reads their Google-style
sections). Builds offline: no intersphinx, no remote assets. CI builds it
with warnings as errors (tests/test_docs.py)."""
import hostembed

project = "hostembed"
author = "the hostembed authors"
copyright = "2026, the hostembed authors"
release = version = hostembed.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
# A module's members are documented where the package exports them.
add_module_names = True

html_theme = "furo"
html_title = f"hostembed {release}"
html_static_path = []
