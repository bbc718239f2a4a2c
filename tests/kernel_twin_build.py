"""Builds a kernel's host twin: a harness in tests/kernel_twin/ that
compiles the kernel's own source (cuda/*.cuh) with g++ over
device_shim.h, linked with the C core's sources it names. Every float
operation is rounded on its own, as the core's build keeps them and as the
shim's IEEE intrinsics need; nvcc's #pragma unroll means nothing to g++;
CI's HOSTEMBED_WERROR holds the twin to the build's rule. Skips (pytest)
without g++ or the CUDA headers (the harness takes the real
cuda_runtime.h)."""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TWIN = REPO / "tests" / "kernel_twin"
COMMON = ["-O1", "-ffp-contract=off", "-fno-math-errno"]


def cuda_include():
    """The CUDA toolkit's include folder, or None."""
    homes = [os.environ.get(var) for var in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes.append("/usr/local/cuda")
    for home in filter(None, homes):
        if os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    return None


def compile_command(cmd, cwd):
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))}\n{res.stdout}{res.stderr}"


def build_twin(out, harness, core_sources=()):
    """tests/kernel_twin/<harness>.cpp built in `out` with csrc/<name>.c for
    each of core_sources (a file a call: after "-x c", g++ still compiles a
    second .c as C++); the executable's path."""
    cxx = shlex.split(os.environ.get("CXX", "")) or ([shutil.which("g++")] if shutil.which("g++") else None)
    if not cxx:
        pytest.skip("no g++ (nor $CXX) to compile the kernel's host twin")
    include = cuda_include()
    if include is None:
        pytest.skip("no CUDA headers (include/cuda_runtime.h under $CUDA_HOME, $CUDA_PATH, nvcc's toolkit or "
                    "/usr/local/cuda) for the kernel's host twin")
    for source in core_sources:
        compile_command([*cxx, "-x", "c", "-std=c11", *COMMON, f"-I{REPO / 'include'}", f"-I{REPO / 'csrc'}", "-c",
                         REPO / "csrc" / f"{source}.c", "-o", f"{source}.o"], out)
    warnings = ["-Wall", "-Wextra", "-Wno-unknown-pragmas"]
    if os.environ.get("HOSTEMBED_WERROR") == "1":
        warnings.append("-Werror")
    exe = Path(out) / harness
    compile_command([*cxx, "-std=c++20", *COMMON, "-pthread", *warnings, f"-I{REPO / 'include'}",
                     f"-I{REPO / 'cuda'}", f"-I{include}", TWIN / f"{harness}.cpp",
                     *[f"{source}.o" for source in core_sources], "-o", exe, "-lm"], out)
    return exe
