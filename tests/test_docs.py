"""The documentation: docs/ builds with Sphinx without a warning, its API
page documents every public name, and every Python example in README.md and
the guides runs as written (each in a fresh namespace, in an empty working
directory). An example whose first line is ``# needs a GPU`` runs where
CUDA can, and is skipped with that reason elsewhere; its CPU twin (the
device "cpu" for "cuda") runs everywhere, so the loop it shows is checked
even where the GPU path cannot be."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
            found.append(pytest.param(block, id=f"{page.relative_to(ROOT)}-{number}"))
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


@pytest.mark.parametrize("block", examples())
def test_every_example_runs(block, tmp_path, monkeypatch):
    if block.startswith(NEEDS_GPU) and not hostembed.cuda_available():
        pytest.skip("the example needs a GPU and CUDA cannot run here")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "example", "exec"), {"__name__": "__example__"})


@pytest.mark.parametrize("block", [b for b in examples() if b.values[0].startswith(NEEDS_GPU)])
def test_every_gpu_example_runs_as_its_cpu_twin(block, tmp_path, monkeypatch):
    twin = block.replace('"cuda"', '"cpu"').replace(".is_cuda", ".is_cpu")
    assert twin != block
    monkeypatch.chdir(tmp_path)
    exec(compile(twin, "example (CPU twin)", "exec"), {"__name__": "__example__"})
