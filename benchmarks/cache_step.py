"""The training step through the row cache on the reference stream: ms per
step with its phases, hit rate, bytes over PCIe and the host's waits for
the device, for caches of several sizes and without a cache, next to the
published figures for the same stream.

The stream (the field's reference, as in NVIDIA recsys-examples'
dynamicemb benchmark): D=128 float32, --batch lookups a step (10 x 104,857
folded into one table), PowerLaw(--alpha 1.05) over --rows rows (60M).
Two kinds of batches (--modes): "replay", --stream distinct batches
replayed (the published figures' set-up), and "fresh", a new batch every
step (training: batches never repeat). Each cache size is a fraction of
the rows the run touches (warm-up and timed steps). One SparseAdam step =
forward (ids on the device), backward, step(); fused (the update in
backward) unless --unfused; with --prefetch the next batch is planned
(on the GPU: deduplicated, planned, its records moved) while this one's
step is still to come. Timed from the first call to the device sync after
step(), medians over --steps after --warmup steps; then --steps more with
a device sync after each phase, for the phases' medians.

Reported per size: ms/step and its phases; hit rate; bytes over PCIe a
step (records moved: a record is a row and its two Adam state rows, in and
back; and the rows that bypass the cache: read for the forward, read and
written by the update), against the minimum: the records of the rows the
step is the first of the timed steps to touch, in and out once; rows that
bypass the cache; the host's waits for the device a step (the cache's
count). One table (and its state) is allocated once and the cache rebuilt
on it for each size (Embedding.cache_rows).

Usage (after `pip install .`; a GPU for the real figures):
    python benchmarks/cache_step.py [--device cuda --rows 60000000 --fractions 1,0.8,0.2,0.05]
On the CPU (--device cpu) the records are host memory: a check of the
harness, not a figure to compare.
"""
import argparse
import os
import time

import numpy as np
import torch

from _common import RESULTS_DIR, ZipfIds, fmt_ms, log, machine_info, require_hostembed, summarize_ms, write_json

hostembed = require_hostembed()
from hostembed.nn.host_module import UNINITIALISED  # noqa: E402  (after the build check above)

# Published, same stream, H100, Adam (recsys-examples dynamicemb
# benchmark_results.json): ms/step.
PUBLISHED = {
    "TorchRec/FBGEMM TBE, weights in host memory (UVM)": 24.05,
    "TorchRec/FBGEMM TBE, HBM cache of every touched row (state in host memory)": 14.37,
    "NVIDIA dynamicemb, HBM cache with state, cfr 1.0": 12.28,
    "dynamicemb, cfr 0.8": 24.33,
    "TorchRec/FBGEMM TBE, cfr 0.8": 15.00,
    "everything in HBM (TBE)": 1.35,
}
STATE_ROWS = 2  # SparseAdam: exp_avg, exp_avg_sq


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=60_000_000, help="table rows")
    p.add_argument("--batch", type=int, default=1_048_570, help="lookups per step")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--stream", type=int, default=10, help="distinct batches, replayed (mode replay)")
    p.add_argument("--modes", default="replay,fresh", help="replay: --stream batches over and over; fresh: a new "
                   "batch every step")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fractions", default="1,0.8,0.2,0.05", help="cache sizes: fractions of the touched rows")
    p.add_argument("--no-baseline", action="store_true", help="skip the uncached run")
    p.add_argument("--unfused", action="store_true", help="backward, then step() (default: fused)")
    p.add_argument("--prefetch", action="store_true", help="plan each batch a step ahead")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(RESULTS_DIR, "cache_step.json"))
    args = p.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - {"replay", "fresh"}:
        p.error("--modes: replay, fresh or both")
    if min(args.rows, args.batch, args.dim, args.steps, args.stream) < 1 or args.warmup < 0 or \
            not all(0 < f <= 1 for f in args.fractions):
        p.error("sizes must be >= 1 and fractions in (0, 1]")
    return args


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(emb, opt, order, grad_out, args, device):
    """(ms/step summary, phases' medians, cache stats a timed step or None,
    the cache's host waits a timed step or None) over the batches in
    `order` (warm-up, timed, phases, and one more for the last prefetch)."""
    prefetch = args.prefetch and (emb.cache_rows or device.type == "cpu")

    def step(i, marks=None):
        out = emb(order[i])
        mark(marks)
        out.backward(grad_out)
        if prefetch:
            # Planned ahead in the cache; without one, prefetch is for CPU outputs.
            emb.prefetch(order[i + 1])
        mark(marks)
        opt.step()
        opt.zero_grad()
        mark(marks)

    def mark(marks):
        if marks is not None:
            synchronize(device)
            marks.append(time.perf_counter())

    if prefetch:
        emb.prefetch(order[0])
    for i in range(args.warmup):
        step(i)
    synchronize(device)
    cache = emb._table.cache
    before, waits = emb.cache_stats, None if cache is None else getattr(cache, "host_waits", None)
    seconds = []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        step(i)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    if waits is not None:
        waits = (cache.host_waits - waits) / args.steps
    after = emb.cache_stats
    stats = None if after is None else {k: (after[k] - before[k]) / args.steps for k in after}
    phases = {"forward": [], "backward": [], "step": []}
    for i in range(args.warmup + args.steps, args.warmup + 2 * args.steps):
        marks = [time.perf_counter()]
        step(i, marks)
        for name, t0, t1 in zip(phases, marks, marks[1:]):
            phases[name].append((t1 - t0) * 1e3)
    return summarize_ms(seconds), {k: float(np.median(v)) for k, v in phases.items()}, stats, waits


def first_touches(order, args):
    """Rows the timed steps are the first to touch, per step, and the rows
    the run touches."""
    seen = np.zeros(args.rows, dtype=bool)
    for i in range(args.warmup):
        seen[order[i].cpu().numpy()] = True
    first = 0
    for i in range(args.warmup, args.warmup + args.steps):
        rows = torch.unique(order[i].cpu()).numpy()
        first += int((~seen[rows]).sum())
        seen[rows] = True
    for b in order:
        seen[b.cpu().numpy()] = True
    return first / args.steps, int(seen.sum())


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    draw = ZipfIds(args.rows, args.alpha, np.random.default_rng(args.seed))
    count = args.warmup + 2 * args.steps + 1
    orders = {}
    for mode in args.modes:
        distinct = args.stream if mode == "replay" else count
        log(f"{mode}: drawing {distinct} batches of {args.batch:,} Zipf({args.alpha}) ids over {args.rows:,} rows")
        batches = [draw.draw(args.batch).to(device) for _ in range(distinct)]
        orders[mode] = [batches[i % distinct] for i in range(count)]
    del draw
    grad_out = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    # Zeros: the values do not change the timing, and drawing 60M x 128
    # normals would take longer than the benchmark.
    emb = hostembed.Embedding(args.rows, args.dim, device=device, _weight=UNINITIALISED)
    opt = hostembed.SparseAdam(emb.parameters(), lr=1e-3, fused=not args.unfused)
    record = (1 + STATE_ROWS) * args.dim * 4
    report = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "published_ms": PUBLISHED, "modes": {}}
    for mode, order in orders.items():
        first, touched = first_touches(order, args)
        unique = float(np.mean([torch.unique(b).numel() for b in order[args.warmup:args.warmup + args.steps]]))
        log(f"{mode}: {touched:,} rows touched, {unique:,.0f} unique a step, {first:,.0f} first touched a step; "
            f"table {args.rows * args.dim * 4 / 2**30:.1f} GiB")
        result = report["modes"][mode] = {"touched_rows": touched, "unique_per_step": unique,
                                          "first_touch_per_step": first, "sizes": {}}
        if not args.no_baseline:
            emb.cache_rows = None
            ms, phases, _, _ = run(emb, opt, order, grad_out, args, device)
            result["no_cache"] = {"step": ms, "phases_ms": phases,
                                  "pcie_bytes_per_step": unique * args.dim * 4 * 7}
            log(f"{mode}, no cache: {fmt_ms(ms['median_ms'])} ms/step")
        for fraction in args.fractions:
            emb.cache_rows = max(1, int(round(fraction * touched)))
            ms, phases, stats, waits = run(emb, opt, order, grad_out, args, device)
            moved = stats["fetched_bytes"] + stats["written_back_bytes"]
            # A bypassed row: read for the forward, read and written (w, m, v) by the update.
            bypass_bytes = stats["bypassed"] * args.dim * 4 * 7
            result["sizes"][f"{fraction:g}"] = {
                "capacity": emb.cache_rows, "step": ms, "phases_ms": phases, "hit_rate": stats["hits"] / stats["rows"],
                "bypassed_per_step": stats["bypassed"], "record_bytes_per_step": moved,
                "pcie_bytes_per_step": moved + bypass_bytes, "minimum_bytes_per_step": 2 * first * record,
                "host_waits_per_step": waits, "records_on": str(emb._table.cache.device), **stats}
            log(f"{mode}, cache {fraction:.0%} ({emb.cache_rows:,} rows): {fmt_ms(ms['median_ms'])} ms/step, "
                f"hits {stats['hits'] / stats['rows']:.1%}")
        emb.cache_rows = None
        print_report(args, mode, result)
    print_published()
    write_json(args.json, report)


def print_report(args, mode, r):
    print(f"\n## row cache, {mode} batches: {args.batch:,} PowerLaw({args.alpha}) lookups a step over "
          f"{args.rows:,} rows, D={args.dim}, SparseAdam{' (fused)' if not args.unfused else ''}"
          f"{', planned a step ahead' if args.prefetch else ''}, {args.device}")
    print(f"{r['touched_rows']:,} rows touched, {r['unique_per_step']:,.0f} unique a step, "
          f"{r['first_touch_per_step']:,.0f} first touched a step\n")
    print("| cache (of touched rows) | ms/step (median) | forward / backward / step ms | hit rate | bypassed rows/step "
          "| PCIe MiB/step | minimum MiB/step | host waits/step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")

    def phases(p):
        return " / ".join(f"{p[k]:.2f}" for k in ("forward", "backward", "step"))

    if "no_cache" in r:
        n = r["no_cache"]
        print(f"| none | {fmt_ms(n['step']['median_ms'])} | {phases(n['phases_ms'])} | | "
              f"{r['unique_per_step']:,.0f} | {n['pcie_bytes_per_step'] / 2**20:,.1f} | | |")
    for fraction, s in r["sizes"].items():
        waits = "" if s["host_waits_per_step"] is None else f"{s['host_waits_per_step']:.2f}"
        print(f"| {float(fraction):.0%} ({s['capacity']:,} rows) | {fmt_ms(s['step']['median_ms'])} | "
              f"{phases(s['phases_ms'])} | {s['hit_rate']:.1%} | {s['bypassed_per_step']:,.0f} | "
              f"{s['pcie_bytes_per_step'] / 2**20:,.1f} | {s['minimum_bytes_per_step'] / 2**20:,.1f} | {waits} |")


def print_published():
    print("\nPublished, same stream (replayed), H100, Adam (ms/step):")
    for name, ms in PUBLISHED.items():
        print(f"- {name}: {ms}")


if __name__ == "__main__":
    main()
