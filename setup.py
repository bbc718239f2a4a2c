"""Build of hostembed's C core.

The build needs setuptools and a C compiler only; it never imports torch, so
one build serves every torch >= 2.1 and `pip install .` works with build
isolation. Set HOSTEMBED_WERROR=1 to turn warnings into errors (CI does).
"""
import glob
import os

from setuptools import Extension, setup

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
]
if os.environ.get("HOSTEMBED_WERROR") == "1":
    CFLAGS.append("-Werror")

core = Extension(
    "hostembed._C",
    sources=sorted(glob.glob("csrc/*.c")),
    include_dirs=["csrc"],
    extra_compile_args=CFLAGS,
    extra_link_args=["-pthread"],
    libraries=["m"],
)

setup(ext_modules=[core])
