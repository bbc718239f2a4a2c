"""`import hostembed` on a torch older than its floor raises an ImportError
naming both versions (pip leaves an older torch installed; without the check
the import failed deep inside with an AttributeError). Each case imports
hostembed in a subprocess that finds a stub torch, holding nothing but
__version__, before the real one."""
import os
import subprocess
import sys

import pytest

import hostembed

FLOOR = hostembed._TORCH_FLOOR
FLOOR_TEXT = ".".join(map(str, FLOOR))
# The minor release before the floor.
OLDER = f"{FLOOR[0]}.{FLOOR[1] - 1}" if FLOOR[1] else f"{FLOOR[0] - 1}.99"


def import_with_torch_version(tmp_path, version):
    """stderr of `import hostembed` in a fresh interpreter whose torch is a
    stub with this __version__ (None: no __version__ at all)."""
    stub = tmp_path / "torch"
    stub.mkdir()
    (stub / "__init__.py").write_text("" if version is None else f"__version__ = {version!r}\n")
    # The stub first, then wherever this hostembed comes from (an editable
    # install's source folder or site-packages: the stub still wins there).
    package_root = os.path.dirname(os.path.dirname(hostembed.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), package_root]))
    done = subprocess.run([sys.executable, "-c", "import hostembed"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0, "the stub torch cannot run hostembed; the import must fail somewhere"
    return done.stderr


@pytest.mark.parametrize("version", [f"{OLDER}.1", f"{OLDER}.0+cu121", f"{OLDER}.0a0+git5e1c6f2", "1.13.1"])
def test_an_older_torch_is_refused_naming_both_versions(tmp_path, version):
    stderr = import_with_torch_version(tmp_path, version)
    assert f"ImportError: hostembed needs torch >= {FLOOR_TEXT} (found {version})" in stderr, stderr


def test_a_torch_without_a_version_is_refused(tmp_path):
    stderr = import_with_torch_version(tmp_path, None)
    assert f"ImportError: hostembed needs torch >= {FLOOR_TEXT} (found unknown)" in stderr, stderr


@pytest.mark.parametrize("version", [f"{FLOOR_TEXT}.0", f"{FLOOR_TEXT}.0a0+git5e1c6f2", f"{FLOOR[0]}.{FLOOR[1] + 10}.0",
                                     f"{FLOOR[0] + 1}.0.0+cpu"])
def test_the_floor_and_newer_pass_the_check(tmp_path, version):
    # Numerically compared (2.10 is newer than 2.4), pre-releases of the
    # floor included. The stub then fails later, on something it lacks.
    stderr = import_with_torch_version(tmp_path, version)
    assert "hostembed needs torch" not in stderr, stderr


def test_this_torch_passes_the_check():
    import torch

    assert hostembed.__version__
    assert tuple(int(part) for part in torch.__version__.split(".")[:2]) >= FLOOR
