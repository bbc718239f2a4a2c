"""The documentation: docs/ builds with Sphinx without a warning, its API
page documents every public name, and every Python example in README.md and
the guides runs as written (each in a fresh namespace, in an empty working
directory). An example whose first line is ``# needs a GPU`` runs where
CUDA can, and is skipped with that reason elsewhere; its CPU twin (the
device "cpu" for "cuda") runs everywhere, so the loop it shows is checked
even where the GPU path cannot be."""
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hostembed
import hostembed.distributed

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
NEEDS_GPU = "# needs a GPU"


def examples():
    found = []
    for page in PAGES:
        # Blocks inside a list item are indented: the fence's indent is the block's.
        fences = re.findall(r"^( *)```python\n(.*?)^\1```", page.read_text(), flags=re.S | re.M)
        for number, (indent, block) in enumerate(fences):
            block = textwrap.dedent(block) if indent else block
            marks = [pytest.mark.gpu] if block.startswith(NEEDS_GPU) else []
            found.append(pytest.param(block, id=f"{page.relative_to(ROOT)}-{number}", marks=marks))
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import sphinx  # noqa: F401  (in the '.[test]' extra: a missing Sphinx fails here, it does not skip)
    out = tmp_path_factory.mktemp("html")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                          str(out)], capture_output=True, text=True, timeout=600)
    return run, out


def test_the_docs_build_without_a_warning(built):
    run, out = built
    assert run.returncode == 0, run.stdout + run.stderr
    assert (out / "index.html").exists()


def test_the_api_page_documents_every_public_name(built):
    run, out = built
    assert run.returncode == 0, run.stdout + run.stderr
    page = (out / "api.html").read_text()
    names = [f"hostembed.{n}" for n in hostembed.__all__]
    names += [f"hostembed.distributed.{n}" for n in hostembed.distributed.__all__]
    missing = [n for n in names if f'id="{n}"' not in page]
    assert not missing, missing


def test_the_first_page_links_the_guides_and_the_api(built):
    run, out = built
    assert run.returncode == 0, run.stdout + run.stderr
    index = (out / "index.html").read_text()
    for target in ("api.html", "guides/training-scripts.html", "guides/gpu.html", "results.html", "design.html"):
        assert f'href="{target}' in index, target


PUBLIC = {f"hostembed.{n}": getattr(hostembed, n) for n in hostembed.__all__}
PUBLIC.update({f"hostembed.distributed.{n}": getattr(hostembed.distributed, n) for n in hostembed.distributed.__all__})
# An entry of a Google-style "Args:" section, as napoleon reads it: indented
# 4 spaces under the header, ``name (type, optional): meaning`` (the
# meaning may start on the next line, indented deeper).
ARGS_ENTRY = re.compile(r"^    (\w+) \((.+?)\):( \S|$)")


def args_entries(doc):
    """The names of the entries of the "Args:" section of a docstring
    (continuation lines are indented deeper; the section ends at the next
    line that is not indented)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in lines:
        return []
    names = []
    for line in lines[lines.index("Args:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        entry = ARGS_ENTRY.match(line)
        if entry:
            names.append(entry.group(1))
    return names


def public_parameters(obj):
    """The parameters a caller names: a class's constructor's (or a
    function's), without self, *args, **kwargs and private ones (_weight)."""
    signature = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    return [p.name for p in signature.parameters.values()
            if p.name != "self" and not p.name.startswith("_")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_parameter_has_an_args_entry(name):
    obj = PUBLIC[name]
    # The class's own docstring (a class without one would show its base's).
    doc = vars(obj).get("__doc__") if isinstance(obj, type) else obj.__doc__
    entries = args_entries(doc)
    missing = [p for p in public_parameters(obj) if p not in entries]
    assert not missing, f"{name}: no Args entry for {missing}"
    assert len(entries) == len(set(entries)), f"{name}: an Args entry twice: {entries}"


MODULES = sorted(name for name, obj in PUBLIC.items() if isinstance(obj, type) and issubclass(obj, torch.nn.Module))


@pytest.mark.parametrize("name", MODULES)
def test_every_public_module_forward_has_its_own_docstring(name):
    forward = PUBLIC[name].forward
    assert forward is not torch.nn.Module.forward, name
    # The function's own __doc__ (not the one inspect.getdoc would inherit
    # from nn.Module or torch's class).
    assert forward.__doc__ and forward.__doc__ != torch.nn.Module.forward.__doc__, f"{name}.forward"
    assert "Args:" in forward.__doc__ and "Returns:" in forward.__doc__, f"{name}.forward"


def test_the_api_page_shows_the_args_and_hides_private_parameters(built):
    run, out = built
    assert run.returncode == 0, run.stdout + run.stderr
    page = (out / "api.html").read_text()
    assert "Should be overridden" not in page  # nn.Module.forward's docstring
    params = [re.search(r'<span class="pre">([^<]*)</span>', p).group(1)
              for p in re.findall(r'<em class="sig-param">(.*?)</em>', page, flags=re.S)]
    assert params and not [p for p in params if p.startswith("_")], sorted(set(params))
    # Each class's rendered parameter list (napoleon's field list, before
    # its first member) names every public parameter.
    for name, obj in PUBLIC.items():
        if not isinstance(obj, type):
            continue
        start = page.index(f'id="{name}"')
        end = page.find('<dt class="sig sig-object py"', start + 1)
        section = page[start:end if end > 0 else len(page)]
        missing = [p for p in public_parameters(obj) if f"<strong>{p}</strong>" not in section]
        assert not missing, f"{name}: not in the rendered parameter list: {missing}"


@pytest.mark.parametrize("block", examples())
def test_every_example_runs(block, tmp_path, monkeypatch):
    if block.startswith(NEEDS_GPU) and not hostembed.cuda_available():
        pytest.skip("the example needs a GPU and CUDA cannot run here")
    monkeypatch.chdir(tmp_path)
    # An example of the plain swap rebinds torch.nn's classes: undone after it.
    monkeypatch.setattr(torch.nn, "Embedding", torch.nn.Embedding)
    monkeypatch.setattr(torch.nn, "EmbeddingBag", torch.nn.EmbeddingBag)
    exec(compile(block, "example", "exec"), {"__name__": "__example__"})


@pytest.mark.parametrize("block", [b for b in examples() if b.values[0].startswith(NEEDS_GPU)])
def test_every_gpu_example_runs_as_its_cpu_twin(block, tmp_path, monkeypatch):
    twin = block.replace('"cuda"', '"cpu"').replace(".is_cuda", ".is_cpu")
    assert twin != block
    monkeypatch.chdir(tmp_path)
    exec(compile(twin, "example (CPU twin)", "exec"), {"__name__": "__example__"})
