#!/usr/bin/env bash
# The tests as another CPU would run them, on this one: hostembed built for
# one SIMD level at a time (HOSTEMBED_SIMD, csrc/simd.h: the code a CPU
# with only that level runs), and torch's own kernels at a lower level
# (ATEN_CPU_CAPABILITY). A bit-for-bit test that passes here only through
# the level this CPU picks would fail on another machine's CI.
#
# Not part of .ci/run (each pass takes the main suite's time again); run it
# after a change to the C core's loops or to tests that pin bits:
#   .ci/simd_matrix.sh [pytest args...]     (default: the whole suite)
# With HOSTEMBED_NO_SKIPS=1, as in .ci/run, a skip not marked gpu fails a pass.
# Exit status: the number of passes that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/hostembed-simd.XXXXXX")
trap 'rm -rf "$work"' EXIT
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests)

build() {  # $1: a HOSTEMBED_SIMD level; the working tree (untracked files too) copied, built in place
    mkdir -p "$work/$1"
    git ls-files -z --cached --others --exclude-standard | tar -C "$root" --null --ignore-failed-read -T - -cf - \
        | tar -C "$work/$1" -xf -
    # With the CUDA kernels where nvcc is, as CI builds: without them the
    # tests of the CUDA build (registration without a driver) skip.
    (cd "$work/$1" && HOSTEMBED_SIMD=$1 HOSTEMBED_WERROR=1 \
        "$python" setup.py -q build_ext --inplace >build.log 2>&1) || { cat "$work/$1/build.log"; return 1; }
}

failed=0
pass() {  # $1: label, $2: tree, then environment assignments
    local label=$1 tree=$2
    shift 2
    echo "== $label"
    # A compile cache of its own: inductor's does not tell kernels built for
    # one ATEN_CPU_CAPABILITY from another's, and one built for another
    # level gave wrong losses and heap corruption when loaded (seen here).
    mkdir -p "$work/inductor-$label"
    (cd "$tree" && env "$@" TORCHINDUCTOR_CACHE_DIR="$work/inductor-$label" PYTHONPATH="$tree/python" \
        "$python" -m pytest -q -p no:cacheprovider -rf "${args[@]}" 2>&1 | grep -E "^FAILED|^ERROR|passed|failed") \
        || failed=$((failed + 1))
}

# The instructions each level's build may use (x86-64-v4 and -v3, csrc/simd.h).
declare -A needs=([avx512]="avx512f avx512bw avx512dq avx512vl avx512cd avx2 fma bmi2" [avx2]="avx2 fma bmi2 f16c"
                  [default]="")
for level in avx512 avx2 default; do
    missing=$(for flag in ${needs[$level]}; do grep -qw "$flag" /proc/cpuinfo || echo "$flag"; done)
    if [ -n "$missing" ]; then
        echo "== hostembed $level: not run, this CPU lacks" $missing
        continue
    fi
    build "$level" || { failed=$((failed + 1)); continue; }
    pass "hostembed-$level" "$work/$level" HOSTEMBED_SIMD="$level"  # tests/test_simd_build.py checks the build
done
for capability in avx2 default; do
    [ -d "$work/default" ] || break
    pass "hostembed-default-torch-$capability" "$work/default" HOSTEMBED_SIMD=default ATEN_CPU_CAPABILITY=$capability
done
echo "simd_matrix: $failed pass(es) failed"
exit "$failed"
