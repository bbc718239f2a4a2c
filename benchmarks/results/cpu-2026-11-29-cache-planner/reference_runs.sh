#!/bin/bash
# The reference stream (60M rows, 1,050,000 Zipf(1.05) lookups a step), each
# policy, replayed (10 batches cycled) and fresh (a new batch every step),
# planned a step ahead; the policies alternate within each stream.
cd "$(dirname "$0")/../../.." || exit 1
D=benchmarks/results/cpu-2026-11-29-cache-planner
for stream in 10 0; do
  for policy in frequency clock; do
    name=reference_${policy}_stream${stream}
    python benchmarks/cache_plan.py --lookahead --stream $stream --policy $policy --json $D/$name.json > $D/$name.log 2> $D/$name.stderr.log
  done
done
