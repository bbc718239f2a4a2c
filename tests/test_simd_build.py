"""The build the tests run is the one they mean to test: every SIMD level
with a choice at load time (csrc/simd.h), unless HOSTEMBED_SIMD names the
one level it was built for (.ci/simd_matrix.sh sets it for both the build
and its tests, so a pass that ran another build fails here)."""
import os

from hostembed._core import _C


def test_the_extension_holds_the_simd_levels_asked_for():
    assert _C.SIMD_LEVEL == (os.environ.get("HOSTEMBED_SIMD") or "all")
