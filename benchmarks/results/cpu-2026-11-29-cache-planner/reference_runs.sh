#!/bin/bash
# The reference stream (60M rows, 1,050,000 Zipf(1.05) lookups a step), each
# policy, replayed (10 batches cycled) and fresh (a new batch every step),
# planned a step ahead; the policies alternate within each stream. Writes
# into OUTDIR (the runs kept beside this script were made by it, into this
# folder, when cache_plan.py was benchmarks/cache_plan.py).
#
#   bash benchmarks/results/cpu-2026-11-29-cache-planner/reference_runs.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: reference_runs.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.."
for stream in 10 0; do
  for policy in frequency clock; do
    name=reference_${policy}_stream${stream}
    python benchmarks/cache/cache_plan.py --lookahead --stream $stream --policy $policy --json "$OUT/$name.json" \
      > "$OUT/$name.log" 2> "$OUT/$name.stderr.log"
  done
done
