#!/usr/bin/env bash
# Everything the GPU path needs checked, on a GPU machine without network,
# the most telling first: build, the row cache on the anchors' protocols
# (float32, then compact state), the cache's tests, the GPU tests, a
# language model's token table in host memory against the model all on the GPU,
# compute-sanitizer (memcheck, racecheck), a profile of the step, the GPU
# benchmarks, the GPU tests again without torch's caching allocator, the
# rest of the test suite. Logs go to OUTDIR; a short table is printed last.
# On an H100 (2026-11-28) the stages up to the profile took 501 s (compact
# state not among them; on its own, with a build and the cache's tests, 146 s).
#
#   benchmarks/gpu_check.sh OUTDIR
#
# Where only a few files come back from the machine, pack OUTDIR after it:
#   BUDGET_S=530 bash benchmarks/gpu_check.sh /tmp/gc; tar czf logs.tgz -C /tmp gc
#
# OUTDIR also gets what a reader needs to repeat the numbers:
#   source.log    the commit, `git status --short`, a hash of the source tree
#   machine.log   GPU (nvidia-smi), CPU model and cores, memory, kernel,
#                 memlock limit, huge pages, compilers, Python, torch
#   commands.log  this script's invocation and every stage's exact command
#                 with the environment it ran in, in order
#   summary.log   each stage's command and the last lines of its log
#   <stage>.log   each stage's whole output
#
# Environment: PYTHON (the interpreter's path, default python3), ROWS
# (training benchmark table rows, default 60000000), BUDGET_S (wall-clock
# budget, default 530: each stage gets at most its own limit and what is
# left of the budget), SANITIZER (compute-sanitizer's path; default: PATH,
# then the toolkit's bin), SKIP (stage names not to run, space-separated:
# a short lease runs the most important ones first), GPU_ARGS (more
# arguments for benchmarks/gpu/gpu.py, e.g. "--skip gather"), CACHE_FRACTION
# (compare.py's GPU row cache, a fraction of each table's rows; default 1).
# Exit status: 0 only when every stage ran and passed.
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PY=${PYTHON:-python3}
ROWS=${ROWS:-60000000}
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-530} ))
STAGES=()
FAILED=0
: > "$OUT/summary.log"

# The variables that change what a stage does, as `env` would take them.
relevant_env() {
    env | grep -E '^(HOSTEMBED_|PYTORCH_|CUDA_|NVIDIA_|OMP_|MKL_|PYTHONPATH=|PYTHON=|ROWS=|BUDGET_S=|SANITIZER=|SKIP=|GPU_ARGS=|CACHE_FRACTION=)' \
        | LC_ALL=C sort
}

# run NAME LIMIT_S CMD...: logs to OUT/NAME.log, records status and time.
run() {
    local name=$1 limit=$2 start rc left
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        STAGES+=("$name|skipped (SKIP)|0")
        echo "# $name: not run (SKIP)" >> "$OUT/commands.log"
        return 0
    fi
    start=$(date +%s)
    left=$(( DEADLINE - start ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then
        STAGES+=("$name|skipped (budget spent)|0")
        FAILED=1
        echo "# $name: not run (budget spent)" >> "$OUT/commands.log"
        return 1
    fi
    {
        echo "# $name (limit ${limit}s, log $name.log), from $REPO, with:"
        relevant_env | sed 's/^/#   /'
        printf '%q ' "$@"
        echo
    } >> "$OUT/commands.log"
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

# What was tested. A copied tree (no .git) says so; the hash over the
# source files then tells two copies apart (and matches between a clone and
# a copy of the same files). Taken before the build, which adds files.
{
    echo "date: $(date -u +%FT%TZ)"
    echo "repository: $REPO"
    if git -C "$REPO" rev-parse --git-dir > /dev/null 2>&1; then
        echo "commit: $(git -C "$REPO" rev-parse HEAD)"
        git -C "$REPO" log -1 --format='         %cd %s' --date=iso
        echo "git status --short (nothing below: a clean checkout):"
        git -C "$REPO" status --short
        files() { git -C "$REPO" ls-files --cached --others --exclude-standard; }
    else
        echo "commit: unknown (not a git checkout: a copy of a working tree)"
        files() {
            find . \( -path ./.git -o -path ./build -o -path ./dist -o -path ./.pytest_cache -o -path ./.hypothesis \
                -o -name __pycache__ -o -name '*.egg-info' \) -prune \
                -o -type f ! -name '*.so' ! -name '*.o' ! -name '*.pyc' -print | sed 's|^\./||'
        }
    fi
    echo "source tree sha256 (sha256sum of the sorted per-file sums of the files listed below):"
    files | LC_ALL=C sort | while IFS= read -r f; do [[ -f $f ]] && sha256sum "$f"; done > "$OUT/source_files.sha256"
    sha256sum < "$OUT/source_files.sha256" | cut -d' ' -f1
    echo "(per-file sums in source_files.sha256)"
} > "$OUT/source.log" 2>&1

# Where it ran.
{
    echo "## kernel and OS"
    uname -a
    grep -E '^PRETTY_NAME=' /etc/os-release 2>/dev/null
    echo "## CPU"
    if command -v lscpu > /dev/null; then
        lscpu | grep -E '^(Model name|Architecture|CPU\(s\)|On-line CPU|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|L3 cache|Hypervisor vendor)'
    else
        grep -m1 'model name' /proc/cpuinfo
    fi
    echo "nproc (CPUs this process may use): $(nproc)"
    echo "## memory"
    grep -E '^(MemTotal|MemAvailable|HugePages_Total|Hugepagesize):' /proc/meminfo
    echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
    echo "ulimit -l (locked memory, KiB): $(ulimit -l)"
    echo "## GPU"
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm \
        --format=csv
    echo "## compilers"
    nvcc --version
    gcc --version | head -n 1
    echo "## Python and torch"
    echo "PYTHON=$PY -> $(command -v "$PY")"
    "$PY" --version
    "$PY" -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(),
      'intra-op threads', torch.get_num_threads())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))
else:
    print('torch sees no GPU')"
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|numpy|pytest|hypothesis|setuptools|safetensors|tqdm) '
    echo "## environment"
    relevant_env
} > "$OUT/machine.log" 2>&1

{
    echo "# The run: benchmarks/gpu_check.sh, $(date -u +%FT%TZ). To repeat it from a checkout of the commit"
    echo "# in source.log:"
    printf 'cd %q && ' "$REPO"
    relevant_env | while IFS= read -r kv; do printf '%q ' "$kv"; done
    printf '%q ' benchmarks/gpu_check.sh "$OUT"
    echo
    echo "# Its stages, in order (each run from $REPO):"
} > "$OUT/commands.log"

# pip first (the way users install). Without network pip cannot fetch the
# setuptools >= 77 that pyproject.toml's license field needs; if the box's
# is older, build the extension alone from a copy of the tree without
# pyproject.toml and run everything from the source tree. The copy takes
# every source file (setup.py compiles csrc/, binding/, cuda/ against
# include/), not a list of directories that goes stale.
export HOSTEMBED_CUDA=1 HOSTEMBED_WERROR=1
# shellcheck disable=SC2016  # expanded by the bash -c below, not here
BUILD_WITHOUT_PYPROJECT='tmp=$(mktemp -d) && mkdir -p "$tmp"/hostembed/_core &&
    tar -cf - --exclude=./.git --exclude=./build --exclude=./dist --exclude=./pyproject.toml --exclude="*.so" \
        --exclude="*.o" --exclude="*.egg-info" . | tar -xf - -C "$tmp" &&
    (cd "$tmp" && "$0" setup.py build_ext --inplace) && cp "$tmp"/hostembed/_core/_C*.so python/hostembed/_core/'
BUILT=1
# A failed attempt that a later one makes good is not a failure of the run.
if run build 240 "$PY" -m pip install --no-build-isolation --no-deps -v .; then
    unset PYTHONPATH
elif run build_inplace 240 "$PY" setup.py build_ext --inplace; then
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
    run import 60 "$PY" -c "import hostembed as h; print(h.__file__, 'cuda_compiled', h.cuda_compiled(), 'cuda_available', h.cuda_available()); assert h.cuda_available()"
    # The most telling stages first: a short lease may end before the rest.
    # The row cache on the anchors' protocols (benchmarks/cache/_anchor_streams.py):
    # dynamicemb's, beside its published figures, then fresh batches, a
    # process each (their tables, 28 and 86 GiB pinned with their state,
    # never at once); the rows go to cache_protocols.json, which later stages
    # add to. -u: a stage cut short by its limit keeps the tables it printed.
    run protocols 180 "$PY" -u benchmarks/gpu/cache_step.py --protocols dynamicemb --json "$OUT/cache_protocols.json"
    run protocols_fresh 150 "$PY" -u benchmarks/gpu/cache_step.py --protocols fresh --append \
        --json "$OUT/cache_protocols.json"
    # Compact state (bfloat16 and 8-bit moments, their records updated in
    # GPU memory), with and without a cache, on the same fresh batches.
    run protocols_compact 150 "$PY" -u benchmarks/gpu/cache_step.py --protocols fresh --fractions 1,0.2 \
        --states bfloat16,int8 --append --json "$OUT/cache_protocols.json"
    # The row cache in GPU memory: its tests, its planner against the CPU's
    # (recorded for CI's replay, tests/fixtures/gpu_cache_plans.pt), FBGEMM's
    # protocol (its row-wise Adagrad and Adam), replayed batches; later the
    # seeds' model with and without a cache (compare).
    run cache_gpu_tests 120 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_cache_gpu.py
    run plan_record 60 "$PY" benchmarks/cache/cache_plan_record.py "$OUT/gpu_cache_plans.pt"
    # FBGEMM's protocol with Adam (records in GPU memory) and its own
    # row-wise Adagrad (which moves them to host memory: the table says so).
    run protocols_fbgemm 150 "$PY" -u benchmarks/gpu/cache_step.py --protocols fbgemm \
        --optimizers adam,rowwise_adagrad --append --json "$OUT/cache_protocols.json"
    run protocols_replayed 120 "$PY" -u benchmarks/gpu/cache_step.py --protocols replayed --append \
        --json "$OUT/cache_protocols.json"
    run gpu_tests 300 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --durations 15
    # A language model's token table in host memory against the model all
    # on the GPU (step time, GPU memory held and peak), torch's AdamW kept
    # and hostembed.SparseAdam for the table, beside torch's SparseAdam.
    run lm_gpu 150 "$PY" -u benchmarks/clients/lm_step.py --device cuda --vocabs 128256,256000 --hidden 1024 \
        --tokens 2048 --rounds 6 --json "$OUT/lm_step.json"
    SANITIZER=${SANITIZER:-$(command -v compute-sanitizer)}
    for dir in "${CUDA_HOME:-/usr/local/cuda}/bin" /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
        [[ -z $SANITIZER && -x $dir/compute-sanitizer ]] && SANITIZER=$dir/compute-sanitizer
    done
    if [[ -n $SANITIZER ]]; then
        run sanitizer 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 1 \
            --leak-check no "$PY" benchmarks/gpu/gpu_sanitize.py
        run racecheck 150 "$SANITIZER" --tool racecheck --error-exitcode 1 "$PY" benchmarks/gpu/gpu_sanitize.py
    else
        STAGES+=("sanitizer|NOT RUN: compute-sanitizer not found (set SANITIZER=path)|0")
        FAILED=1
    fi
    run profile 150 "$PY" benchmarks/gpu/gpu_profile.py --prefetch --setups "fused,cache 1.0,cache 0.2"
    # Where FBGEMM's row-wise Adagrad spends its step with GPU outputs (70.8
    # ms uncached on the H100, 2026-11-28; Adam 9.1): no GPU update, its
    # sums copied to the host.
    run profile_rowwise 90 "$PY" benchmarks/gpu/gpu_profile.py --optimizer rowwise_adagrad \
        --setups "fused,cache 1.0" --steps 2
    run compare 200 "$PY" benchmarks/compare.py --cache-fraction "${CACHE_FRACTION:-1}" --json "$OUT/compare_default.json"
    # shellcheck disable=SC2086  # GPU_ARGS is a list of words
    run benchmark 330 "$PY" benchmarks/gpu/gpu.py --rows "$ROWS" --json "$OUT/gpu.json" ${GPU_ARGS:-}
    # The GPU tests again without torch's caching allocator: every output
    # and workspace is then a fresh cudaMalloc, so a kernel that writes
    # nothing cannot pass on a buffer an earlier lookup left the right rows
    # in. The big-table tests (host-memory bound, ~1 min) are left out:
    # each block of their rows is first read by a lookup of its own, and
    # their update changes what the later lookups expect.
    run gpu_tests_no_caching 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        "$PY" -m pytest -q -m gpu -k "not big_table" -rs -p no:cacheprovider
    run other_tests 150 "$PY" -m pytest -q -m "not gpu" -rs -p no:cacheprovider
else
    STAGES+=("everything else|skipped: no build succeeded|0")
    FAILED=1
fi

echo
echo "## gpu_check ($(date -u +%FT%TZ), logs in $OUT)"
echo
sed -n '1,3p' "$OUT/source.log"
echo
echo "| stage | status | seconds |"
echo "|---|---|---:|"
for s in "${STAGES[@]}"; do
    IFS='|' read -r name status secs <<< "$s"
    echo "| $name | $status | $secs |"
done
echo
for name in cache_gpu_tests gpu_tests gpu_tests_no_caching other_tests; do
    # pytest's last line: "3 failed, 80 passed, 2 skipped, ... in 12.01s"
    [[ -f $OUT/$name.log ]] && echo "$name: $(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s' "$OUT/$name.log" | tail -n 1)"
done
grep -H "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT/sanitizer.log" "$OUT/racecheck.log" 2>/dev/null
[[ -f $OUT/benchmark.log ]] && sed -n '/^## hostembed GPU path/,$p' "$OUT/benchmark.log"
[[ -f $OUT/plan_record.log ]] && cat "$OUT/plan_record.log"
for name in protocols protocols_fresh protocols_compact protocols_fbgemm protocols_replayed; do
    [[ -f $OUT/$name.log ]] && sed -n '/^## /,$p' "$OUT/$name.log" | grep -v '^wrote '
done
[[ -f $OUT/compare.log ]] && grep -E '^\| [0-9]\.' "$OUT/compare.log"
if (( FAILED )); then
    echo "gpu_check: SOME STAGES FAILED OR DID NOT RUN (see the table above and $OUT/*.log)"
    exit 1
fi
echo "gpu_check: all stages passed"
