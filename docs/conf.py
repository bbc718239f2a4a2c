"""Sphinx configuration: guides in Markdown (MyST, as README.md is), the
API reference generated from the package's docstrings by autodoc (they are
reStructuredText; napoleon reads their Google-style "Args:" / "Returns:"
sections, and those of torch's own docstrings that inherited methods
show). The rendered signatures leave out parameters whose names start with
an underscore (_without_private_parameters). Builds offline: no
intersphinx, no remote assets. The tests build it with warnings as errors
(tests/test_docs.py)."""
import ast

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


def _without_private_parameters(app, what, name, obj, options, signature, return_annotation):
    """autodoc-process-signature: the rendered signature without the
    parameters whose names start with an underscore (Embedding's _weight and
    _freeze, which torch's own constructor takes and from_pretrained passes;
    the distributed tables' _host). The Python signature keeps them."""
    if not signature or "_" not in signature:
        return None
    try:
        args = ast.parse(f"def f{signature}: pass").body[0].args
    except SyntaxError:  # a default autodoc shows as <object at ...>: left as it is
        return None
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    kept = [(a, d) for a, d in zip(positional, defaults) if not a.arg.startswith("_")]
    kwonly = [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if not a.arg.startswith("_")]
    if len(kept) + len(kwonly) == len(positional) + len(args.kwonlyargs):
        return None
    posonly = sum(1 for a, _ in kept if a in args.posonlyargs)
    args.posonlyargs, args.args = [a for a, _ in kept[:posonly]], [a for a, _ in kept[posonly:]]
    first = next((i for i, (_, d) in enumerate(kept) if d is not None), len(kept))
    args.defaults = [d for _, d in kept[first:]]
    args.kwonlyargs, args.kw_defaults = [a for a, _ in kwonly], [d for _, d in kwonly]
    # (a bare * left with no keyword after it is not written by ast.unparse)
    return f"({ast.unparse(args)})", return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _without_private_parameters)
