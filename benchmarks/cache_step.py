"""The training step through the row cache on the reference stream: ms per
step, hit rate and bytes moved for caches of several sizes, and without a
cache, next to the published figures for the same stream.

The stream (the field's reference, as in NVIDIA recsys-examples'
dynamicemb benchmark): D=128 float32, --batch lookups a step (10 x 104,857
folded into one table), PowerLaw(--alpha 1.05) over --rows rows (60M),
--stream distinct batches replayed. Each cache size is a fraction of the
rows the stream touches. One SparseAdam step = forward (ids on the
device), backward, step(); fused (the update in backward) unless
--unfused; with --prefetch the next batch is planned while this one's
step is still to come. Timed from the first call to the device sync after
step(), medians over --steps after --warmup steps.

Reported per size: ms/step; hit rate; records moved per step (a record =
a row and its two Adam state rows), against the minimum: the records of
the rows the step is the first of the timed steps to touch; and rows that
bypass the cache (read and updated in host memory). One table (and its
state) is allocated once and the cache rebuilt on it for each size
(Embedding.cache_rows).

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
    p.add_argument("--stream", type=int, default=10, help="distinct batches, replayed")
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
    if min(args.rows, args.batch, args.dim, args.steps, args.stream) < 1 or args.warmup < 0 or \
            not all(0 < f <= 1 for f in args.fractions):
        p.error("sizes must be >= 1 and fractions in (0, 1]")
    return args


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(emb, opt, batches, grad_out, args, device):
    """(ms/step summary, cache stats over the timed steps or None)."""
    order = [batches[i % len(batches)] for i in range(args.warmup + args.steps + 1)]

    def step(i):
        emb(order[i]).backward(grad_out)
        if args.prefetch and (emb.cache_rows or device.type == "cpu"):
            # Planned ahead in the cache; without one, prefetch is for CPU outputs.
            emb.prefetch(order[i + 1])
        opt.step()
        opt.zero_grad()

    for i in range(args.warmup):
        step(i)
    synchronize(device)
    before = emb.cache_stats
    seconds = []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        step(i)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    after = emb.cache_stats
    stats = None if after is None else {k: (after[k] - before[k]) / args.steps for k in after}
    return summarize_ms(seconds), stats


def first_touches(batches, args):
    """Rows the timed steps are the first to touch, per step, and the rows
    the whole stream touches."""
    seen = np.zeros(args.rows, dtype=bool)
    for i in range(args.warmup):
        seen[batches[i % len(batches)].cpu().numpy()] = True
    first = 0
    for i in range(args.warmup, args.warmup + args.steps):
        rows = torch.unique(batches[i % len(batches)].cpu()).numpy()
        first += int((~seen[rows]).sum())
        seen[rows] = True
    for b in batches:
        seen[b.cpu().numpy()] = True
    return first / args.steps, int(seen.sum())


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    log(f"drawing {args.stream} batches of {args.batch:,} Zipf({args.alpha}) ids over {args.rows:,} rows")
    draw = ZipfIds(args.rows, args.alpha, np.random.default_rng(args.seed))
    batches = [draw.draw(args.batch).to(device) for _ in range(args.stream)]
    del draw
    first, touched = first_touches(batches, args)
    unique = float(np.mean([torch.unique(b).numel() for b in batches]))
    grad_out = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    log(f"{touched:,} rows touched, {unique:,.0f} unique a step; table {args.rows * args.dim * 4 / 2**30:.1f} GiB")
    # Zeros: the values do not change the timing, and drawing 60M x 128
    # normals would take longer than the benchmark.
    emb = hostembed.Embedding(args.rows, args.dim, device=device, _weight=UNINITIALISED)
    opt = hostembed.SparseAdam(emb.parameters(), lr=1e-3, fused=not args.unfused)
    record = (1 + STATE_ROWS) * args.dim * 4
    report = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "touched_rows": touched, "unique_per_step": unique, "first_touch_per_step": first,
              "published_ms": PUBLISHED, "sizes": {}}
    if not args.no_baseline:
        ms, _ = run(emb, opt, batches, grad_out, args, device)
        report["no_cache"] = {"step": ms}
        log(f"no cache: {fmt_ms(ms['median_ms'])} ms/step")
    for fraction in args.fractions:
        emb.cache_rows = max(1, int(round(fraction * touched)))
        ms, stats = run(emb, opt, batches, grad_out, args, device)
        moved = stats["fetched_bytes"] + stats["written_back_bytes"]
        report["sizes"][f"{fraction:g}"] = {
            "capacity": emb.cache_rows, "step": ms, "hit_rate": stats["hits"] / stats["rows"],
            "bypassed_per_step": stats["bypassed"], "record_bytes_per_step": moved,
            "minimum_bytes_per_step": first * record, "records_on": str(emb._table.cache.device), **stats}
        log(f"cache {fraction:.0%} ({emb.cache_rows:,} rows): {fmt_ms(ms['median_ms'])} ms/step, "
            f"hits {stats['hits'] / stats['rows']:.1%}")
    emb.cache_rows = None
    print_report(args, report)
    write_json(args.json, report)


def print_report(args, report):
    print(f"\n## row cache, {args.batch:,} PowerLaw({args.alpha}) lookups a step over {args.rows:,} rows, D={args.dim}, "
          f"SparseAdam{' (fused)' if not args.unfused else ''}, {args.device}")
    print(f"{report['touched_rows']:,} rows touched by the {args.stream}-batch stream, "
          f"{report['unique_per_step']:,.0f} unique a step\n")
    print("| cache (of touched rows) | ms/step (median) | hit rate | bypassed rows/step | records moved MiB/step "
          "| minimum MiB/step |")
    print("|---|---:|---:|---:|---:|---:|")
    if "no_cache" in report:
        print(f"| none | {fmt_ms(report['no_cache']['step']['median_ms'])} | | | | |")
    for fraction, r in report["sizes"].items():
        print(f"| {float(fraction):.0%} ({r['capacity']:,} rows) | {fmt_ms(r['step']['median_ms'])} | "
              f"{r['hit_rate']:.1%} | {r['bypassed_per_step']:,.0f} | {r['record_bytes_per_step'] / 2**20:,.1f} | "
              f"{r['minimum_bytes_per_step'] / 2**20:,.1f} |")
    print("\nPublished, same stream, H100, Adam (ms/step):")
    for name, ms in PUBLISHED.items():
        print(f"- {name}: {ms}")


if __name__ == "__main__":
    main()
