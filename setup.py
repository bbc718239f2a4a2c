"""Build of hostembed's C core, and of its CUDA kernels where nvcc is found.

The build needs setuptools and a C compiler only; it never imports torch, so
one build serves every torch >= 2.6 and `pip install .` works with build
isolation. Set HOSTEMBED_WERROR=1 to turn warnings into errors (CI does).

SIMD: the row loops are built for AVX-512, AVX2 and baseline x86-64, one
chosen at load time (csrc/simd.h). HOSTEMBED_SIMD=avx512|avx2|default
builds that level alone, for testing each level's bits on one machine
(.ci/simd_matrix.sh); such a build refuses to import on a CPU without the
level's instructions and names itself in hostembed._core._C.SIMD_LEVEL.

OpenMP: where the compiler has it (-fopenmp), the core's loops run on
OpenMP's threads, at run time torch's own (libgomp is linked by name and
torch loads it first); HOSTEMBED_OPENMP=0 builds the core's own pool.

CUDA (cuda/*.cu, the GPU path): HOSTEMBED_CUDA=1 requires it (the build fails
if nvcc is missing), =0 skips it, unset builds it when nvcc is found (on
PATH, or under $CUDA_HOME / $CUDA_PATH). The CUDA runtime is linked
statically, so the extension needs only a driver, never a libcudart of the
version torch happens to ship; kernels run in the same primary context as
torch's, on the streams torch hands over.

Exports: the extension exports PyInit__C and nothing else. Whatever else it
exports (a static libstdc++'s __cxa_* and GNU_UNIQUE symbols, cudart_static's,
CUB's) is bound by torch's libraries loaded after it: `import hostembed;
import torch` segfaulted that way on an H100 box. Three layers, so that no
compiler or toolkit default brings it back: -fvisibility=hidden for the C and
CUDA objects, a linker version script exporting PyInit__C only (EXPORTS_MAP),
and --exclude-libs,ALL for the symbols of static archives.
tests/test_exports.py checks the built extension.
"""
import glob
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WERROR = os.environ.get("HOSTEMBED_WERROR") == "1"

CFLAGS = [
    "-std=c11",
    "-O3",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    "-pthread",
    # torch does each SparseAdam operation separately; fusing them into FMAs
    # would change the last bit, so keep every product rounded on its own.
    "-ffp-contract=off",
    # lets sqrtf vectorise; it only drops errno on sqrt of a negative, which
    # never happens here (v >= 0) and nothing reads.
    "-fno-math-errno",
    # Export nothing by default; PyMODINIT_FUNC marks PyInit__C visible.
    "-fvisibility=hidden",
]
if WERROR:
    CFLAGS.append("-Werror")

# sm_80 (A100) and sm_90 (H100/H200) machine code, plus compute_90 PTX that
# the driver compiles for newer GPUs.
NVCC_ARCH = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-Xcompiler", "-fPIC",
    "-Xcompiler", "-fvisibility=hidden",
    "-Xcompiler", "-Wall,-Wextra,-Wno-missing-field-initializers",
    # The kernels round every operation explicitly (__fadd_rn and friends);
    # this keeps any other float expression unfused too.
    "-fmad=false",
    # The kernels see the core only through include/ (never csrc/).
    "-Iinclude",
    "-Icuda",
    *NVCC_ARCH,
]
if WERROR:
    NVCC_FLAGS += ["-Werror", "all-warnings", "-Xcompiler", "-Werror"]

# The linker version script (see "Exports" above); written into the build
# temp dir, and rewritten only when its text changes, which relinks.
EXPORTS_MAP = "{ global: PyInit__C; local: *; };\n"
ELF = sys.platform.startswith("linux")


def _write_exports_map(build_temp):
    os.makedirs(build_temp, exist_ok=True)
    path = os.path.join(build_temp, "exports.map")
    try:
        with open(path) as f:
            if f.read() == EXPORTS_MAP:
                return path
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(EXPORTS_MAP)
    return path


def _cuda_mode():
    value = os.environ.get("HOSTEMBED_CUDA", "")
    if value not in ("", "0", "1"):
        sys.exit(f"HOSTEMBED_CUDA must be 0 (skip the CUDA kernels), 1 (require them) or unset (auto), got {value!r}")
    return value


def _find_nvcc():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_lib_dir(nvcc):
    """Where libcudart_static.a lies: nvcc's own dry run names the toolkit
    root (TOP), which also works when nvcc on PATH is a wrapper script."""
    roots = []
    try:
        dry = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True, timeout=60)
        for line in (dry.stdout + dry.stderr).splitlines():
            if line.startswith("#$ TOP="):
                roots.append(line.split("=", 1)[1].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            path = os.path.join(root, sub)
            if os.path.isfile(os.path.join(path, "libcudart_static.a")):
                return os.path.normpath(path)
    return None


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc (in parallel: CI has two cores and the
    CUB sort dominates) and links the objects into the one extension."""

    def build_extension(self, ext):
        if ELF:
            exports = _write_exports_map(self.build_temp)
            ext.extra_link_args = list(ext.extra_link_args or []) + [
                f"-Wl,--version-script={exports}", "-Wl,--exclude-libs,ALL"]
            ext.depends = list(ext.depends or []) + [exports]
        cuda = getattr(ext, "_hostembed_cuda", None)
        if cuda:
            nvcc, lib_dir = cuda
            os.makedirs(self.build_temp, exist_ok=True)
            sources = sorted(glob.glob("cuda/*.cu"))
            objects = [os.path.join(self.build_temp, os.path.basename(s) + ".o") for s in sources]

            def compile_one(pair):
                src, obj = pair
                cmd = [nvcc, "-c", src, "-o", obj, *NVCC_FLAGS]
                print(" ".join(cmd), flush=True)
                return subprocess.run(cmd, capture_output=True, text=True)

            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                results = list(pool.map(compile_one, zip(sources, objects)))
            failed = False
            for src, res in zip(sources, results):
                if res.stdout or res.stderr:
                    print(res.stdout + res.stderr, file=sys.stderr, flush=True)
                if res.returncode != 0:
                    print(f"nvcc failed on {src} (exit status {res.returncode})", file=sys.stderr)
                    failed = True
            if failed:
                sys.exit("hostembed: the CUDA kernels did not compile (see nvcc's output above); "
                         "set HOSTEMBED_CUDA=0 to build the CPU-only extension")
            ext.extra_objects = list(ext.extra_objects or []) + objects
            ext.library_dirs = list(ext.library_dirs or []) + [lib_dir]
            # setuptools relinks only when a source or a dependency is newer
            # than the built extension: without this, a change to a .cu file
            # alone (the C sources untouched) would be compiled and then left
            # out, leaving the old kernels in the .so (pip's in-tree builds and
            # build_ext --inplace both keep build/ between runs).
            ext.depends = list(ext.depends or []) + objects
        super().build_extension(ext)


def _openmp_works():
    """Whether the C compiler builds and links an OpenMP program."""
    import sysconfig
    import tempfile
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_in_parallel(); }\n")
        try:
            run = subprocess.run([*cc, "-fopenmp", src, "-o", os.path.join(tmp, "omp")], capture_output=True,
                                 timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
        return run.returncode == 0


def _extension():
    mode = _cuda_mode()
    # The core's loops on OpenMP's threads, which are torch's
    # (csrc/thread_pool.c says why); HOSTEMBED_OPENMP=0, or a compiler
    # without OpenMP, keeps the core's own thread pool.
    openmp = []
    if os.environ.get("HOSTEMBED_OPENMP") != "0":
        if _openmp_works():
            openmp = ["-fopenmp"]
        else:
            print("hostembed: the C compiler has no OpenMP; the core uses its own threads", file=sys.stderr)
    define_macros = [("HE_OPENMP", "1")] if openmp else []
    # HOSTEMBED_SIMD=avx512|avx2|default builds that one level of the row
    # loops instead of all three with a runtime choice (csrc/simd.h): for
    # testing each level's bits on one machine, never for a wheel.
    simd = os.environ.get("HOSTEMBED_SIMD", "")
    levels = {"avx512": "4", "avx2": "3", "default": "1"}
    if simd:
        if simd not in levels:
            sys.exit(f"HOSTEMBED_SIMD must be one of {', '.join(levels)} (or unset: every level, chosen at load "
                     f"time), got {simd!r}")
        print(f"hostembed: building the row loops for {simd} only (HOSTEMBED_SIMD)", file=sys.stderr)
        define_macros.append(("HE_SIMD_ONLY", levels[simd]))
    libraries = ["m"]
    cuda = None
    if mode != "0":
        nvcc = _find_nvcc()
        if nvcc is None and mode == "1":
            sys.exit("HOSTEMBED_CUDA=1 but nvcc was found neither on PATH nor under $CUDA_HOME or $CUDA_PATH")
        if nvcc is not None:
            lib_dir = _cuda_lib_dir(nvcc)
            if lib_dir is None:
                msg = f"found {nvcc} but no libcudart_static.a in its toolkit"
                if mode == "1":
                    sys.exit(f"HOSTEMBED_CUDA=1 but {msg}")
                print(f"hostembed: {msg}; building without CUDA", file=sys.stderr)
            else:
                print(f"hostembed: building the CUDA kernels with {nvcc} (runtime from {lib_dir})", file=sys.stderr)
                cuda = (nvcc, lib_dir)
                define_macros.append(("HE_WITH_CUDA", "1"))
                # Static runtime: no libcudart version to match torch's. It
                # needs librt, libdl and pthreads from the system, and the
                # nvcc objects (CUB is C++) need libstdc++, which torch loads
                # anyway.
                libraries = ["cudart_static", "rt", "dl", "pthread", "stdc++", "m"]
        else:
            print("hostembed: nvcc not found; building without CUDA (the GPU path reports this on use)",
                  file=sys.stderr)

    ext = Extension(
        "hostembed._core._C",
        # The C core (csrc/) and the CPython binding (binding/, the only code
        # that includes Python.h).
        sources=sorted(glob.glob("csrc/*.c") + glob.glob("binding/*.c")),
        # Headers too: a change to one rebuilds the extension.
        depends=sorted(glob.glob("include/*.h") + glob.glob("csrc/*.h") + glob.glob("csrc/*.inc") + glob.glob("binding/*.h")
                       + glob.glob("cuda/*.h") + glob.glob("cuda/*.cuh")),
        # One list for every C source: the binding needs all three; csrc/
        # includes only include/ and itself (the sanitizer test compiles it
        # with -Iinclude -Icsrc alone, which keeps it so).
        include_dirs=["include", "csrc", "cuda"],
        define_macros=define_macros,
        extra_compile_args=CFLAGS + openmp,
        extra_link_args=["-pthread"] + openmp,
        libraries=libraries,
    )
    ext._hostembed_cuda = cuda
    return ext


setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
