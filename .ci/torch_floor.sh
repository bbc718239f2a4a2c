#!/usr/bin/env bash
# CI: the core tests on the oldest torch hostembed supports (the floor that
# pyproject.toml, the docs and hostembed/__init__.py state), in a venv of its
# own, so the floor is one CI proves rather than one the docs assume.
#
# PyPI's Linux torch wheels are CUDA builds whose import needs the nvidia-*
# libraries that libtorch links (no GPU needed). torch and those are
# installed with --no-deps from the pinned list below: torch's metadata also
# asks for triton, cusolver and nvrtc, which only GPU work loads (about
# 0.4 GB saved); `pip check` in this venv therefore lists them as missing.
# Downloads (about 2.5 GB) are kept in $HOSTEMBED_FLOOR_CACHE for reruns.
#
# Exit status: non-zero when an install or a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

TORCH=2.6.0
# torch 2.6.0's pins (its METADATA) for the libraries libtorch_cuda and
# libtorch_global_deps link, and what those link in turn (nvjitlink).
NVIDIA=(
    nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-cupti-cu12==12.4.127 nvidia-cudnn-cu12==9.1.0.70
    nvidia-cublas-cu12==12.4.5.8 nvidia-cufft-cu12==11.2.1.3 nvidia-curand-cu12==10.3.5.147
    nvidia-cusparse-cu12==12.3.1.170 nvidia-cusparselt-cu12==0.6.2 nvidia-nccl-cu12==2.21.5
    nvidia-nvtx-cu12==12.4.127 nvidia-nvjitlink-cu12==12.4.127
)
# torch's pure-Python dependencies, hostembed's (tqdm), the tests' (numpy,
# pytest) and the build's (setuptools), all pinned so that a rerun installs
# the same set offline from the cache (checked with CPython 3.11).
PYDEPS=(
    filelock==4.3.1 typing-extensions==4.16.0 sympy==1.13.1 mpmath==1.3.0 networkx==3.6.1 jinja2==3.1.6
    markupsafe==3.0.4 fsspec==2026.9.0 numpy==1.26.4 tqdm==4.70.1 pytest==9.2.0 iniconfig==2.3.1
    packaging==26.4 pluggy==1.7.0 pygments==2.21.0 setuptools==84.2.1
)
# The core: lookups, bags, the optimizers, argument errors, the floor check.
# torch.compile is tested on the main CI's torch only (docs/guides/
# quickstart.md): on torch 2.6 the compiled backward fails.
TESTS=(tests/test_embedding.py tests/test_sparse_adam.py tests/test_optimizers.py tests/test_embedding_bag.py
       tests/test_errors.py tests/test_torch_floor.py)
DESELECT=(-k "not compile and not compiled")

cache=${HOSTEMBED_FLOOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hostembed-torch-floor}
python=${PYTHON:-python3}
# The pins above are wheels for CPython 3.11 and 3.12 (networkx 3.6 needs
# 3.11; numpy 1.26 has no 3.13 wheel): say so rather than fail in pip.
if ! "$python" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 12)))'; then
    echo "torch_floor: the pinned set is for CPython 3.11-3.12, found $("$python" --version 2>&1);" \
         "pin versions for it in $0" >&2
    exit 1
fi
# As .ci/run's main run: warnings are errors, and a test that skips fails.
export HOSTEMBED_WERROR=1 HOSTEMBED_NO_SKIPS=1
work=$(mktemp -d "${TMPDIR:-/tmp}/hostembed-floor.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS
lap=$SECONDS
step() {
    echo "torch_floor: $1 took $((SECONDS - lap)) s"
    lap=$SECONDS
}

mkdir -p "$cache"
# Files already in the cache are not downloaded again.
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$cache" \
    "torch==$TORCH" "${NVIDIA[@]}" "${PYDEPS[@]}"
step "download (cache: $cache)"

"$python" -m venv "$work/venv"  # without --system-site-packages: the floor's torch only
venv_python=$work/venv/bin/python
# --no-index: exactly the pinned files, never a newer torch from an index.
"$venv_python" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --find-links "$cache" \
    "torch==$TORCH" "${NVIDIA[@]}" "${PYDEPS[@]}"
step "torch $TORCH install"

# Built from a copy, so that neither the checkout's build/ nor an in-place
# extension there is touched or picked up; the C core never links torch.
mkdir "$work/src"
tar -C "$root" --exclude=./.git --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude='*.so' \
    --exclude='*.o' --exclude=__pycache__ --exclude=./.pytest_cache --exclude=./.hypothesis -cf - . \
    | tar -C "$work/src" -xf -
HOSTEMBED_CUDA=0 "$venv_python" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
    --no-build-isolation "$work/src"
step "hostembed build"

cd "$work/src"
env -u PYTHONPATH "$venv_python" -c 'import sys, torch, hostembed
print(f"torch_floor: torch {torch.__version__}, hostembed from {hostembed.__file__}")
sys.exit(not hostembed.__file__.startswith(sys.prefix))'
status=0
env -u PYTHONPATH "$venv_python" -m pytest -q -p no:cacheprovider "${DESELECT[@]}" "${TESTS[@]}" || status=$?
step "tests"
echo "torch_floor: torch $TORCH, $((SECONDS - start)) s in all, exit status $status"
exit "$status"
