"""The row cache's planner on the reference stream, on the CPU: hit rates,
record moves and the planner's time per step for caches of several sizes.

The stream is gpu.py's training stream: --batch lookups a step, Zipf(--alpha)
over a permutation of --rows rows (defaults: 1,050,000 lookups, 1.05, 60M
rows: about 318K unique rows a step). With --stream N it is N batches
drawn once and cycled (the published cached-embedding benchmarks replay a
fixed stream); with --stream 0 every batch is new, and the stream's long
tail keeps bringing rows never seen. "Rows the stream touches" is the union
of the unique rows of all the batches planned; each cache size is a
fraction of it (--fractions). For each size a fresh planner plans --warmup
batches, then --steps timed ones, on the unique rows the core's Dedup gives
(planned after each step, or a step ahead with --lookahead). Reported over
the timed batches:
  * hit rate: rows already in a slot / unique rows;
  * fetches, evictions, bypassed rows per step (a bypassed row is read and
    updated in host memory, over PCIe, as without a cache); the records
    moved per step (fetches + evictions, record = row + Adam's two state
    rows, D float32 each), next to the records of the rows the step is the
    first of the stream to touch, which a cache that keeps every row must
    fetch once;
  * the planner's time per step (median), and the Dedup's, which a cached
    step needs anyway.
No GPU is used: the planner runs on the host, ahead of the device work.

Usage (after `pip install .`):
    python benchmarks/cache_plan.py [--rows 60000000 --fractions 1,0.8,0.2,0.05 ...]
"""
import argparse
import os
import time

import numpy as np
import torch

from _common import RESULTS_DIR, ZipfIds, fmt_ms, log, machine_info, require_hostembed, summarize_ms, write_json

hostembed = require_hostembed()
from hostembed._core import _C  # noqa: E402  (after the build check above)
from hostembed._core.ops.cache_plan import CachePlanner  # noqa: E402

STATE_ROWS = 2  # SparseAdam: exp_avg, exp_avg_sq


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=60_000_000, help="table rows")
    p.add_argument("--batch", type=int, default=1_050_000, help="lookups per step")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    p.add_argument("--dim", type=int, default=128, help="D, for the record size")
    p.add_argument("--stream", type=int, default=10, help="distinct batches, cycled (0: every batch new)")
    p.add_argument("--warmup", type=int, default=10, help="batches planned before the timed ones")
    p.add_argument("--steps", type=int, default=20, help="timed batches")
    p.add_argument("--fractions", default="1,0.8,0.2,0.05",
                   help="cache sizes, as fractions of the rows the stream touches")
    p.add_argument("--lookahead", action="store_true", help="plan each batch a step ahead (protect 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(RESULTS_DIR, "cache_plan.json"))
    args = p.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    if min(args.rows, args.batch, args.dim, args.steps) < 1 or min(args.warmup, args.stream) < 0 or \
            not args.fractions or not all(0 < f <= 1 for f in args.fractions):
        p.error("sizes must be >= 1 and fractions in (0, 1]")
    return args


def unique_rows(ids, num_rows):
    """The batch's sorted unique rows by the core's Dedup, and its seconds."""
    t0 = time.perf_counter()
    dedup = _C.Dedup(ids=ids.data_ptr(), count=ids.numel(), ids_int64=True, num_rows=num_rows)
    unique = torch.empty(dedup.num_unique, dtype=torch.int64)
    inverse = torch.empty(ids.numel(), dtype=torch.int64)
    dedup.export(unique=unique.data_ptr(), inverse=inverse.data_ptr())
    return unique, time.perf_counter() - t0


def run_size(args, capacity, batches, first_touch):
    planner = CachePlanner(args.rows, capacity, lookahead=args.lookahead)
    for unique in batches[:args.warmup]:
        planner.plan(unique)
    start = planner.stats
    seconds = []
    for unique in batches[args.warmup:]:
        t0 = time.perf_counter()
        planner.plan(unique)
        seconds.append(time.perf_counter() - t0)
    end = planner.stats
    d = {k: end[k] - start[k] for k in end}
    record = (1 + STATE_ROWS) * args.dim * 4
    steps = args.steps
    return {
        "capacity": capacity,
        "hit_rate": d["hits"] / d["rows"],
        "fetches_per_step": d["fetches"] / steps,
        "evictions_per_step": d["evictions"] / steps,
        "bypassed_per_step": d["bypassed"] / steps,
        "record_bytes_per_step": (d["fetches"] + d["evictions"]) * record / steps,
        "minimum_bytes_per_step": first_touch * record / steps,
        "plan": summarize_ms(seconds),
    }


def main(argv=None):
    args = parse_args(argv)
    planned = args.warmup + args.steps
    distinct = args.stream or planned
    log(f"drawing {distinct} batches of {args.batch:,} Zipf({args.alpha}) ids over {args.rows:,} rows")
    draw = ZipfIds(args.rows, args.alpha, np.random.default_rng(args.seed))
    drawn, dedup_seconds = [], []
    for _ in range(distinct):
        unique, s = unique_rows(draw.draw(args.batch), args.rows)
        drawn.append(unique)
        dedup_seconds.append(s)
    del draw
    batches = [drawn[i % distinct] for i in range(planned)]
    seen = np.zeros(args.rows, dtype=bool)
    for unique in batches[:args.warmup]:
        seen[unique.numpy()] = True
    first_touch = 0
    for unique in batches[args.warmup:]:
        rows = unique.numpy()
        first_touch += int((~seen[rows]).sum())
        seen[rows] = True
    touched = int(seen.sum())
    del seen
    report = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "touched_rows": touched, "unique_per_step": float(np.mean([b.numel() for b in batches])),
              "dedup": summarize_ms(dedup_seconds), "sizes": {}}
    for fraction in args.fractions:
        capacity = max(1, int(round(fraction * touched)))
        log(f"cache of {fraction:.0%} of the touched rows: {capacity:,} slots")
        report["sizes"][f"{fraction:g}"] = run_size(args, capacity, batches, first_touch)
    print_report(args, report)
    write_json(args.json, report)


def print_report(args, report):
    stream = f"{args.stream} batches cycled" if args.stream else "a new batch every step"
    print(f"\n{args.batch:,} Zipf({args.alpha}) lookups a step over {args.rows:,} rows ({stream}): "
          f"{report['unique_per_step']:,.0f} unique rows a step, {report['touched_rows']:,} touched; "
          f"{args.warmup} batches warm-up, {args.steps} timed; "
          f"{'planned a step ahead' if args.lookahead else 'planned after each step'}; Dedup "
          f"{fmt_ms(report['dedup']['median_ms'])} ms a step ({torch.get_num_threads()} threads)\n")
    print("| cache (of touched rows) | slots | hit rate | fetches/step | evictions/step | bypassed/step | "
          "records moved/step | first touches/step | plan ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fraction, r in report["sizes"].items():
        print(f"| {float(fraction):.0%} | {r['capacity']:,} | {r['hit_rate']:.1%} | "
              f"{r['fetches_per_step']:,.0f} | "
              f"{r['evictions_per_step']:,.0f} | {r['bypassed_per_step']:,.0f} | "
              f"{r['record_bytes_per_step'] / 2**20:,.0f} MiB | {r['minimum_bytes_per_step'] / 2**20:,.0f} MiB | "
              f"{fmt_ms(r['plan']['median_ms'])} |")


if __name__ == "__main__":
    main()
