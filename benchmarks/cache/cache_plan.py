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

With --protocol (dynamicemb, fbgemm, fresh, replayed; a comma list runs
several) the stream is instead an anchor's (benchmarks/cache/_anchor_streams.py,
at --scale of its rows and ids a step; dynamicemb with --tables tables
folded, one by default), planned in its own order (warm-up batches, then
the timed ones), and the report is the policy's distance from what a cache
of the same size could keep: per cache size, the hit rate over the timed
batches of the CPU planner, of a static cache of the rows the most batches
use (on FBGEMM's stream also of its top ranks by the generator's law), of
Belady's optimum with bypass, and of candidate policies replayed in numpy
("simulated" rows; --candidates picks them by index, "none" skips them),
planned a step ahead (--protect 2, as hostembed's modules plan) unless
--protect 1. benchmarks/cache/_cache_oracles.py defines the oracles and the
simulator; the simulator of the shipped policy makes the planner's
decisions exactly (tests/test_cache_plan_oracles.py). The static cache
holds its rows from the start, so on streams of new rows it can beat
Belady's optimum (which starts empty): it is a bound for a replayed
stream, a yardstick for the others.

Usage (after `pip install .`):
    python benchmarks/cache/cache_plan.py [--rows 60000000 --fractions 1,0.8,0.2,0.05 ...]
    python benchmarks/cache/cache_plan.py --protocol dynamicemb,fbgemm [--scale 0.05 --lookahead]
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import _cache_oracles as oracles  # noqa: E402
from _cache_plan_rows import policy_rows, reference_rows
from _common import (run_folder, ZipfIds, fmt_ms, log, machine_info, require_hostembed, run_context, summarize_ms,
                     write_json, write_rows)

hostembed = require_hostembed()
from hostembed._core import _C  # noqa: E402  (after the build check above)
from hostembed._core.ops.cache_plan import CachePlanner  # noqa: E402

STATE_ROWS = 2  # SparseAdam: exp_avg, exp_avg_sq
# --protocol's cache sizes: the anchors' own (benchmarks/gpu/cache_step.py)
# and the sizes the policy's problem was measured at.
PROTOCOL_FRACTIONS = {"dynamicemb": "0.8,0.5,0.2", "fbgemm": "0.2,0.05", "fresh": "0.8,0.5,0.2,0.05",
                      "replayed": "0.8,0.5,0.2,0.05"}


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
    p.add_argument("--fractions", default="",
                   help="cache sizes, as fractions of the rows the stream touches (default 1,0.8,0.2,0.05; "
                   "with --protocol each protocol's: " + "; ".join(f"{k} {v}" for k, v in PROTOCOL_FRACTIONS.items())
                   + "; FBGEMM's are of all rows, its cache_load_factor)")
    p.add_argument("--lookahead", action="store_true", help="plan each batch a step ahead (protect 2)")
    p.add_argument("--policy", choices=("frequency", "clock"), default="frequency",
                   help="the planner's policy (include/he_cache_policy.h) for the reference stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", default="", help="anchor streams to compare policies on: "
                   "dynamicemb, fbgemm, fresh, replayed (comma list); empty: the reference stream above")
    p.add_argument("--scale", type=float, default=1.0, help="--protocol: rows and ids a step times this")
    p.add_argument("--tables", type=int, default=1, help="--protocol dynamicemb: tables folded")
    p.add_argument("--candidates", default="all", help="--protocol: simulated policies, indices into "
                   "_cache_oracles.CANDIDATES (comma list), 'all' or 'none'")
    p.add_argument("--no-belady", action="store_true", help="--protocol: skip Belady's optimum")
    p.add_argument("--protect", type=int, choices=(1, 2), default=2,
                   help="--protocol: batches whose slots are protected (2: planned a step ahead, as "
                   "hostembed's modules plan; 1: after each step)")
    p.add_argument("--json", default=os.path.join(run_folder(), "cache_plan.json"))
    args = p.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",") if x] or None
    args.protocol = [x for x in args.protocol.split(",") if x]
    if min(args.rows, args.batch, args.dim, args.steps, args.tables) < 1 or min(args.warmup, args.stream) < 0 \
            or not all(0 < f <= 1 for f in args.fractions or [1]) or not args.scale > 0 \
            or not set(args.protocol) <= set(PROTOCOL_FRACTIONS):
        p.error("sizes must be >= 1, fractions in (0, 1], --scale > 0, protocols among "
                + ", ".join(PROTOCOL_FRACTIONS))
    if args.candidates == "all":
        args.candidates = list(range(len(oracles.CANDIDATES)))
    else:
        args.candidates = [int(x) for x in args.candidates.split(",") if x and x != "none"]
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
    planner = CachePlanner(args.rows, capacity, lookahead=args.lookahead, policy=args.policy)
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
    if args.protocol:
        return compare_policies(args)
    args.fractions = args.fractions or [1, 0.8, 0.2, 0.05]
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
    write_rows(os.path.dirname(os.path.abspath(args.json)), reference_rows(report, run_context("cache_plan")))


def print_report(args, report):
    stream = f"{args.stream} batches cycled" if args.stream else "a new batch every step"
    print(f"\n{args.batch:,} Zipf({args.alpha}) lookups a step over {args.rows:,} rows ({stream}): "
          f"{report['unique_per_step']:,.0f} unique rows a step, {report['touched_rows']:,} touched; "
          f"{args.warmup} batches warm-up, {args.steps} timed; "
          f"{'planned a step ahead' if args.lookahead else 'planned after each step'}, policy {args.policy}; Dedup "
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



def planner_hit_rate(stream, capacity, protect, policy="frequency"):
    """The CPU planner's hit rate over the stream's timed batches."""
    planner = CachePlanner(stream.rows, capacity, lookahead=protect == 2, policy=policy)
    for unique in stream.batches[:stream.warmup]:
        planner.plan(torch.from_numpy(unique))
    start = planner.stats
    for unique in stream.batches[stream.warmup:]:
        planner.plan(torch.from_numpy(unique))
    end = planner.stats
    return (end["hits"] - start["hits"]) / max(1, end["rows"] - start["rows"])


def compare_policies(args):
    protect = args.protect
    context = run_context("cache_plan")
    report = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "protect": protect, "workloads": {}, "rows": []}
    for protocol in args.protocol:
        t0 = time.perf_counter()
        stream = oracles.load(protocol, args.scale, args.seed, args.tables)
        log(f"{protocol}: {len(stream.batches)} batches ({stream.warmup} warm-up), {stream.rows:,} rows, "
            f"cache base {stream.base:,}, {stream.params['unique_per_step']:,.0f} unique rows a timed step "
            f"({time.perf_counter() - t0:.0f} s to draw)")
        report["workloads"][protocol] = stream.params
        fractions = args.fractions or [float(x) for x in PROTOCOL_FRACTIONS[protocol].split(",")]
        policies = [("CPU planner, frequency (default)", "planner", lambda c: planner_hit_rate(stream, c, protect)),
                    ("CPU planner, clock", "planner", lambda c: planner_hit_rate(stream, c, protect, "clock")),
                    ("static top-frequency", "oracle", lambda c: oracles.static_top(stream, c))]
        if protocol == "fbgemm":
            policies.append(("static top ranks", "oracle", lambda c: oracles.static_ranks(stream, c)))
        if not args.no_belady:
            policies.append(("Belady (bypass)", "oracle", lambda c: oracles.belady(stream, c)))
        for i in args.candidates:
            cand = oracles.CANDIDATES[i]
            policies.append((f"[{i}] {cand.name}", "simulated",
                             lambda c, cand=cand: oracles.simulate(stream, c, cand, protect)))
        for fraction in fractions:
            capacity = max(1, int(round(fraction * stream.base)))
            for name, kind, run in policies:
                t0 = time.perf_counter()
                rate = run(capacity)
                seconds = time.perf_counter() - t0
                log(f"  {protocol} {fraction:.0%} ({capacity:,} slots) {name}: {rate:.4f} ({seconds:.1f} s)")
                report["rows"].append({"protocol": protocol, "fraction": fraction, "capacity": capacity,
                                       "policy": name, "kind": kind, "hit_rate": rate, "seconds": seconds,
                                       "protect": protect, "workload": stream.params})
        # After each protocol: a run stopped later keeps the finished ones.
        write_json(args.json, report)
        write_rows(os.path.dirname(os.path.abspath(args.json)), policy_rows(report, context))
        print_comparison(report, protocol)
        del stream


def print_comparison(report, protocol):
    params = report["workloads"][protocol]
    rows = [r for r in report["rows"] if r["protocol"] == protocol]
    fractions = sorted({r["fraction"] for r in rows}, reverse=True)
    print(f"\n{protocol}: {params['timed_batches']} timed batches after {params['warmup_batches']} warm-up, "
          f"{params['rows']:,} rows, {params['unique_per_step']:,.0f} unique rows a timed step, cache sizes "
          f"of {params['cache_base_rows']:,} rows (scale {params['scale']:g}); protect {report['protect']}; "
          f"hit rate = rows already cached / unique rows, over the timed batches\n")
    print("| policy | kind | " + " | ".join(f"{f:.0%}" for f in fractions) + " |")
    print("|---|---|" + "---:|" * len(fractions))
    for name in dict.fromkeys(r["policy"] for r in rows):
        rate = {r["fraction"]: r for r in rows if r["policy"] == name}
        print(f"| {name} | {rate[fractions[0]]['kind']} | "
              + " | ".join(f"{rate[f]['hit_rate']:.4f}" if f in rate else "" for f in fractions) + " |", flush=True)


if __name__ == "__main__":
    main()
