#!/usr/bin/env bash
# Everything the GPU path needs checked, on a GPU machine without network:
# build, GPU tests, the rest of the test suite, compute-sanitizer, the GPU
# benchmarks. Logs go to OUTDIR; a short table is printed last.
#
#   benchmarks/gpu_check.sh OUTDIR
#
# Environment: PYTHON (default python3), ROWS (training benchmark table
# rows, default 60000000), BUDGET_S (wall-clock budget, default 530: each
# stage gets at most its own limit and what is left of the budget),
# SANITIZER (compute-sanitizer's path; default: PATH, then the toolkit's bin).
# Exit status: 0 only when every stage ran and passed.
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROWS=${ROWS:-60000000}
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-530} ))
STAGES=()
FAILED=0

# run NAME LIMIT_S CMD...: logs to OUT/NAME.log, records status and time.
run() {
    local name=$1 limit=$2 start rc left
    shift 2
    start=$(date +%s)
    left=$(( DEADLINE - start ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then
        STAGES+=("$name|skipped (budget spent)|0")
        FAILED=1
        return 1
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.log"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local status="ok"
    (( rc == 124 || rc == 137 )) && status="TIMEOUT after ${limit}s"
    (( rc != 0 && rc != 124 && rc != 137 )) && status="FAILED (exit $rc)"
    (( rc != 0 )) && FAILED=1
    STAGES+=("$name|$status|$(( $(date +%s) - start ))")
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.log"
    return $rc
}

{ nvidia-smi; nvcc --version; $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } \
    > "$OUT/machine.log" 2>&1

# pip first (the way users install). Without network pip cannot fetch the
# setuptools >= 77 that pyproject.toml's license field needs; if the box's
# is older, build the extension alone from a copy without pyproject.toml and
# run everything from the source tree.
export HOSTEMBED_CUDA=1 HOSTEMBED_WERROR=1
BUILD_WITHOUT_PYPROJECT='tmp=$(mktemp -d) && mkdir "$tmp"/hostembed && cp -r csrc cuda setup.py "$tmp"/ &&
    (cd "$tmp" && "$0" setup.py build_ext --inplace) && cp "$tmp"/hostembed/_C*.so python/hostembed/'
BUILT=1
# A failed attempt that a later one makes good is not a failure of the run.
if run build 240 $PY -m pip install --no-build-isolation --no-deps -v .; then
    unset PYTHONPATH
elif run build_inplace 240 $PY setup.py build_ext --inplace; then
    export PYTHONPATH=python
elif run build_without_pyproject 240 bash -c "$BUILD_WITHOUT_PYPROJECT" "$PY"; then
    export PYTHONPATH=python
elif run build_warnings_allowed 240 env HOSTEMBED_WERROR=0 bash -c "$BUILD_WITHOUT_PYPROJECT" "$PY"; then
    # Only warnings (this box's compilers may warn where CI's do not):
    # test anyway, and fail the run at the end (see build_without_pyproject.log).
    export PYTHONPATH=python
    STAGES+=("warnings|FAILED: the build needs HOSTEMBED_WERROR=0 here|0")
else
    BUILT=0
fi
(( BUILT )) && ! grep -q "^warnings|" <(printf '%s\n' "${STAGES[@]}") && FAILED=0
# Everything below would test some other hostembed (an older install) if
# this tree's build failed.
if (( BUILT )); then
    run import 60 $PY -c "import hostembed as h; print(h.__file__, 'cuda_compiled', h.cuda_compiled(), 'cuda_available', h.cuda_available()); assert h.cuda_available()"
    run gpu_tests 200 $PY -m pytest -q -m gpu -rs -p no:cacheprovider
    run other_tests 150 $PY -m pytest -q -m "not gpu" -rs -p no:cacheprovider
    SANITIZER=${SANITIZER:-$(command -v compute-sanitizer)}
    for dir in "${CUDA_HOME:-/usr/local/cuda}/bin" /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
        [[ -z $SANITIZER && -x $dir/compute-sanitizer ]] && SANITIZER=$dir/compute-sanitizer
    done
    if [[ -n $SANITIZER ]]; then
        run sanitizer 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 1 \
            --leak-check no $PY benchmarks/gpu_sanitize.py
    else
        STAGES+=("sanitizer|NOT RUN: compute-sanitizer not found (set SANITIZER=path)|0")
        FAILED=1
    fi
    run benchmark 330 $PY benchmarks/gpu.py --rows "$ROWS" --json "$OUT/gpu.json"
else
    STAGES+=("everything else|skipped: no build succeeded|0")
    FAILED=1
fi

echo
echo "## gpu_check ($(date -u +%FT%TZ), logs in $OUT)"
echo
echo "| stage | status | seconds |"
echo "|---|---|---:|"
for s in "${STAGES[@]}"; do
    IFS='|' read -r name status secs <<< "$s"
    echo "| $name | $status | $secs |"
done
echo
grep -h -E "passed|failed|error" "$OUT/gpu_tests.log" "$OUT/other_tests.log" 2>/dev/null | tail -n 4
grep -h "ERROR SUMMARY" "$OUT/sanitizer.log" 2>/dev/null
[ -f "$OUT/benchmark.log" ] && sed -n '/^## hostembed GPU path/,$p' "$OUT/benchmark.log"
if (( FAILED )); then
    echo "gpu_check: SOME STAGES FAILED OR DID NOT RUN (see the table above and $OUT/*.log)"
    exit 1
fi
echo "gpu_check: all stages passed"
