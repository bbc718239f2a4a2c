"""The training step through the row cache on the anchors' own protocols:
ms a step with its phases, hit rate, the record bytes the cache moved a
step and the PCIe bytes a step modelled against a modelled minimum, and
the host's waits for the device, without a cache and with caches of
several sizes, for float32 and compact optimizer state.

Protocols (--protocols; the streams and where each was read from are in
benchmarks/cache/_anchor_streams.py):
  dynamicemb  NVIDIA dynamicemb's caching benchmark: 10 tables, 104,857
              PowerLaw(1.05) ids each a step, 100 batches drawn once, an
              untimed pass, then the timed pass over the same 100; Adam;
              the cache a fraction of the rows the 100 batches touch.
              Its published figures (H100, Adam) stand beside ours.
  fbgemm      FBGEMM's TBE cache benchmark: 32 tables of 100K rows, bags of
              20, fresh batches with 10% of positions reused, Zipf(1.15),
              exact row-wise Adagrad; the cache a fraction of all rows
              (its cache_load_factor, 0.2). Run with Adam too (--optimizers).
  fresh       hostembed's reference stream, a new batch every step (60M
              rows, 1,048,570 Zipf(1.05) ids); the cache a fraction of the
              rows the run touches.
  replayed    the same stream, 10 batches cycled.

Before timing each protocol, optimizer and state, a small draw of its
stream checks on the same device that a table with a row cache of each
timed size (the same fractions, of the draw's rows) trains to the uncached
table's bits: from the same random table, every step's output, then the
weight and every optimizer state entry (--no-check skips it); a
difference, or a draw that never finds a cached row again, ends the run
(gpu/_cache_step_check.py).

A step: forward (ids on the device), backward, step(), with the update
fused in backward unless --unfused; with a cache and one row an id, the
next batch is planned (dedup, misses, evictions) during this step
(--no-plan-ahead to turn it off). The timed steps each end in a device
sync; the phases are timed by events between them (no extra sync). The
protocols' own figures are means, ours are printed as median and mean.

JSON (--json; default benchmarks/results/<device>-<date>/cache_protocols.json):
a list of rows {"protocol", "cache" (fraction; 0 for none), "state",
"optimizer", "ms_per_step" (median), "mean_ms", "device", "date", the
phases, hit rate, waits, the record bytes the cache counts it moved
("record_bytes_moved_per_step"), with the records in GPU memory the rows of
the weight and state its fetches read over PCIe, a fetch
("host_reads_per_fetch": a fetched row whose state was never written reads
its weight alone), the cache's records as allocated
("cache_records_allocated_bytes", "cache_bytes_per_row",
"cache_rows_per_gib"), and figures from a formula, named *_modelled: a
record's bytes, the bytes of bypassed rows (every row, without a cache),
the PCIe total and the minimum}. No byte is measured on the bus. The same
figures go beside it as result rows (rows.jsonl, benchmarks/_rows.py's
schema; this run's as one run: gpu/_cache_step_rows.py).

Usage (after `pip install .`; a GPU for the real figures):
    python benchmarks/gpu/cache_step.py [--protocols dynamicemb,fbgemm,fresh,replayed --states float32,int8]
On the CPU (--device cpu, with --scale 0.001 or so) the records are host
memory: a check of the harness, not a figure to compare.
"""
import argparse
import datetime
import gc
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
sys.path.insert(0, os.path.join(sys.path[0], "cache"))  # benchmarks/cache/: _anchor_streams
import _anchor_streams as streams  # noqa: E402
from _cache_step_check import trains_to_uncached_bits
from _cache_step_rows import result_rows
from _common import device_label, log, machine_info, require_hostembed, run_context, run_folder, write_json, write_rows

hostembed = require_hostembed()
from hostembed.nn.host_module import UNINITIALISED  # noqa: E402  (after the build check above)

PROTOCOLS = ("dynamicemb", "fbgemm", "fresh", "replayed")
# Published for dynamicemb's protocol (recsys-examples, benchmark_results.json,
# H100 80GB HBM3, Adam, the caching suite): mean ms of forward + backward.
PUBLISHED = {
    1.0: {"NVIDIA dynamicemb": 12.284, "TorchRec/FBGEMM TBE (Adam state in host memory)": 14.370},
    0.8: {"NVIDIA dynamicemb": 24.333, "TorchRec/FBGEMM TBE (Adam state in host memory)": 15.001},
}
FRACTIONS = {"dynamicemb": "1,0.8", "fbgemm": "0.2,1", "fresh": "1,0.8,0.2,0.05", "replayed": "1,0.8,0.2,0.05"}
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def state_bytes(optimizer, state, dim):
    """Bytes of optimizer state a row (8-bit moments keep a float32 scale a row)."""
    if optimizer == "rowwise_adagrad":
        return 4
    return {"float32": 8 * dim, "bfloat16": 4 * dim, "int8": 2 * dim + 8}[state]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--protocols", default=",".join(PROTOCOLS))
    p.add_argument("--states", default="float32", help="Adam's state: float32, bfloat16, int8 (comma-separated)")
    p.add_argument("--optimizers", default="", help="override each protocol's optimizer: adam, rowwise_adagrad "
                   "(comma-separated; default: the protocol's own)")
    p.add_argument("--fractions", default="", help="cache sizes for every protocol (default: each protocol's, "
                   + "; ".join(f"{k} {v}" for k, v in FRACTIONS.items()) + ")")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without a cache")
    p.add_argument("--scale", type=float, default=1.0, help="rows and ids a step times this (for checks)")
    p.add_argument("--batches", type=int, default=100, help="dynamicemb: batches drawn (each pass)")
    p.add_argument("--iters", type=int, default=100, help="fbgemm: timed batches (as many warm-up)")
    p.add_argument("--warmup", type=int, default=10, help="fresh/replayed: warm-up steps")
    p.add_argument("--steps", type=int, default=20, help="fresh/replayed: timed steps")
    p.add_argument("--unfused", action="store_true", help="backward, then step() (default: fused)")
    p.add_argument("--no-plan-ahead", action="store_true", help="do not plan the next batch during a step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--append", action="store_true", help="add to the rows --json holds already")
    p.add_argument("--no-check", action="store_true", help="skip the check that a cached table trains to the "
                   "uncached bits")
    args = p.parse_args(argv)
    args.protocols = [x for x in args.protocols.split(",") if x]
    args.states = [x for x in args.states.split(",") if x]
    args.optimizers = [x for x in args.optimizers.split(",") if x]
    if not args.protocols or set(args.protocols) - set(PROTOCOLS):
        p.error(f"--protocols: some of {', '.join(PROTOCOLS)}")
    if not args.states or set(args.states) - set(STATE_DTYPES):
        p.error(f"--states: some of {', '.join(STATE_DTYPES)}")
    if set(args.optimizers) - {"adam", "rowwise_adagrad"}:
        p.error("--optimizers: adam, rowwise_adagrad")
    try:
        args.fractions = [float(x) for x in args.fractions.split(",") if x] or None
    except ValueError:
        p.error(f"--fractions: numbers in (0, 1], got {args.fractions!r}")
    if args.fractions and not all(0 < f <= 1 for f in args.fractions):
        p.error("--fractions: numbers in (0, 1]")
    if min(args.batches, args.iters, args.steps) < 1 or args.warmup < 0 or not args.scale > 0:
        p.error("--batches, --iters, --steps must be >= 1, --warmup >= 0, --scale > 0")
    return args


def workload(protocol, args, device):
    if protocol == "dynamicemb":
        return streams.dynamicemb(args.scale, args.batches, seed=args.seed, device=device)
    if protocol == "fbgemm":
        return streams.fbgemm(args.scale, args.iters, seed=args.seed, device=device)
    return streams.reference(protocol, args.scale, args.warmup, args.steps, seed=args.seed, device=device)


def cache_base(w):
    """The rows a cache fraction is of: those the run touches; for
    FBGEMM's protocol, every row (its cache_load_factor)."""
    if w.protocol == "fbgemm":
        return w.rows
    seen = torch.zeros(w.rows, dtype=torch.bool, device=w.batches[0].device)
    for i in set(w.warmup) | set(w.timed) | {w.after}:
        seen[w.batches[i]] = True
    return int(seen.sum())


def first_touches(w):
    """Rows a timed step is the first step to touch, per timed step."""
    seen = torch.zeros(w.rows, dtype=torch.bool, device=w.batches[0].device)
    for i in w.warmup:
        seen[w.batches[i]] = True
    first = 0
    for i in w.timed:
        rows = torch.unique(w.batches[i])
        first += int((~seen[rows]).sum())
        seen[rows] = True
    return first / len(w.timed)


def build(w, optimizer, state, args, device):
    if w.bag_size:
        module = hostembed.EmbeddingBag(w.rows, w.dim, mode="sum", device=device, _weight=UNINITIALISED)
    else:
        module = hostembed.Embedding(w.rows, w.dim, device=device, _weight=UNINITIALISED)
    fused = not args.unfused
    if optimizer == "adam":
        opt = hostembed.SparseAdam(module.parameters(), lr=w.lr, fused=fused, state_dtype=STATE_DTYPES[state])
    else:
        opt = hostembed.RowWiseAdagrad(module.parameters(), lr=w.lr, eps=1e-8, fused=fused)
    return module, opt


# The check's draw: small enough to run in seconds before each protocol,
# long enough that hot rows come back to a cache over several steps (the
# timed passes' own reuse), and that small caches evict.
CHECK_DRAW = {"scale": 0.001, "batches": 6, "iters": 4, "warmup": 4, "steps": 6}


def fractions_of(protocol, args):
    """The cache sizes timed for a protocol, as fractions of cache_base."""
    return args.fractions or [float(x) for x in FRACTIONS[protocol].split(",")]


def cache_rows_for(fraction, base):
    return max(1, int(round(fraction * base)))


def check_bits(protocol, optimizer, state, args, device):
    """The check before timing (_cache_step_check.py) on a small draw of
    the protocol's stream, on this device, at each timed cache size (the
    same fractions, of this draw's rows). Returns the cache's counts a size."""
    small = argparse.Namespace(**{**vars(args), **CHECK_DRAW, "scale": min(args.scale, CHECK_DRAW["scale"])})
    w = workload(protocol, small, device)
    base = cache_base(w)
    sizes = [(fraction, cache_rows_for(fraction, base)) for fraction in fractions_of(protocol, args)]
    return trains_to_uncached_bits(w, lambda: build(w, optimizer, state, args, device), sizes, base,
                                   f"{protocol}, {optimizer} {state}", args.seed, not args.no_plan_ahead, device)


class Clock:
    """Phase marks: CUDA events on a GPU (no sync inside a step), the host's
    clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def run(module, opt, w, grad_out, plan_ahead, device):
    """One pass of warm-up steps, then the timed steps: per timed step its
    wall ms and its phases' ms; the cache's counts and host waits a step."""
    clock = Clock(device)
    order = w.warmup + w.timed + [w.after]
    inputs = (lambda i: w.batches[i].view(-1, w.bag_size)) if w.bag_size else (lambda i: w.batches[i])
    plan_ahead = plan_ahead and module._table.cache is not None and not w.bag_size

    def step(k):
        marks = [clock.mark()]
        out = module(inputs(order[k]))
        marks.append(clock.mark())
        out.backward(grad_out)
        if plan_ahead:
            module.prefetch(inputs(order[k + 1]))
        marks.append(clock.mark())
        opt.step()
        opt.zero_grad()
        marks.append(clock.mark())
        return marks

    if plan_ahead:
        module.prefetch(inputs(order[0]))
    for k in range(len(w.warmup)):
        step(k)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Read now: an optimizer that updates on the CPU (row-wise Adagrad,
    # compact state) moved the records to host memory at its first step.
    cache = module._table.cache
    # The counts first: reading them waits for the device once, which is
    # not a step's wait.
    before = module.cache_stats
    waits = getattr(cache, "host_waits", None)
    wall, all_marks = [], []
    for k in range(len(w.warmup), len(w.warmup) + len(w.timed)):
        t0 = time.perf_counter()
        all_marks.append(step(k))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall.append((time.perf_counter() - t0) * 1e3)
    phases = {name: float(np.median([clock.ms(m[j], m[j + 1]) for m in all_marks]))
              for j, name in enumerate(("forward", "backward", "step"))}
    if waits is not None:
        waits = (cache.host_waits - waits) / len(w.timed)
    after = module.cache_stats
    stats = None if after is None else {k: (after[k] - before[k]) / len(w.timed) for k in after}
    return wall, phases, stats, waits


def allocated_record_bytes(cache):
    """Bytes of the cache's records as allocated (each storage once: the
    records of a key may be views of a larger allocation), for its
    capacity rows: what the cache holds in memory, not a formula."""
    storages = {}
    for records in cache.cached.values():
        storage = records.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


# Figures computed from a formula rather than counted or timed carry this
# suffix in the JSON and "(modelled)" in the printed table: no PCIe byte is
# measured on the bus here.
MODELLED = "_modelled"


def measure(w, optimizer, state, args, device, today):
    """Rows of the report for one workload, optimizer and state form."""
    module, opt = build(w, optimizer, state, args, device)
    out_rows = w.bag_size and len(w.batches[0]) // w.bag_size or len(w.batches[0])
    grad_out = torch.randn(out_rows, w.dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    base, first = cache_base(w), first_touches(w)
    weight_bytes = w.dim * 4
    record = weight_bytes + state_bytes(optimizer, state, w.dim)
    unique = w.notes["unique_per_step"]
    rows = []
    for fraction in ([] if args.no_baseline else [0.0]) + fractions_of(w.protocol, args):
        module.cache_rows = cache_rows_for(fraction, base) if fraction else None
        wall, phases, stats, waits = run(module, opt, w, grad_out, not args.no_plan_ahead, device)
        row = {"protocol": w.protocol, "cache": fraction, "state": state, "optimizer": optimizer,
               "ms_per_step": float(np.median(wall)), "mean_ms": float(np.mean(wall)),
               "min_ms": float(np.min(wall)), "max_ms": float(np.max(wall)), "steps": len(wall),
               "device": device_label(device), "date": today, "phases_ms": phases, "table_rows": w.rows,
               "cache_rows": module.cache_rows or 0, "cache_of_rows": base, "unique_per_step": unique,
               "first_touch_per_step": first, "host_waits_per_step": waits,
               # A record's bytes by formula (weight, state, 8-bit scales): the
               # no-cache row has no records to measure.
               "record_bytes" + MODELLED: record,
               "minimum_bytes_per_step" + MODELLED: first * record}
        if stats is None:
            # Without a cache every unique row is read in host memory: the
            # forward reads its weight, the update reads and writes its record.
            row.update(hit_rate=None, bypassed_per_step=unique, records_on=None, cache_bytes_per_row=None,
                       cache_rows_per_gib=None, record_bytes_moved_per_step=None)
        else:
            cache = module._table.cache  # read now: an update on the CPU replaced a GPU cache at its first step
            row["cache_records_allocated_bytes"] = allocated_record_bytes(cache)
            row["cache_bytes_per_row"] = row["cache_records_allocated_bytes"] / cache.capacity
            row["cache_rows_per_gib"] = 2**30 / row["cache_bytes_per_row"]
            # Counted by the cache: the records it fetched and wrote back,
            # each at its record's size.
            moved = stats["fetched_bytes"] + stats["written_back_bytes"]
            row.update(hit_rate=stats["hits"] / max(stats["rows"], 1), bypassed_per_step=stats["bypassed"],
                       records_on=str(cache.device), record_bytes_moved_per_step=moved, stats=stats)
            # Counted by the GPU cache's moves: rows of the weight and state
            # read over PCIe a fetched record (its state zeros, unread, where
            # never written).
            if "host_reads" in stats and stats["fetches"]:
                row["host_reads_per_fetch"] = stats["host_reads"] / stats["fetches"]
        row.setdefault("host_reads_per_fetch", None)
        bypass = row["bypassed_per_step"] * (weight_bytes + 2 * record)
        row["bypass_bytes_per_step" + MODELLED] = bypass
        row["pcie_bytes_per_step" + MODELLED] = (row["record_bytes_moved_per_step"] or 0) + bypass
        rows.append(row)
        log(f"{w.protocol}, {optimizer} {state}, cache {fraction:g}: median {row['ms_per_step']:.2f} ms, "
            f"mean {row['mean_ms']:.2f} ms" + ("" if row["hit_rate"] is None else f", hits {row['hit_rate']:.1%}"))
    module.cache_rows = None
    del module, opt
    gc.collect()
    return rows


def print_table(w, rows):
    n = w.notes
    print(f"\n## {w.protocol} protocol, {rows[0]['device']}: {w.rows:,} table rows, "
          f"{n['unique_per_step']:,.0f} unique rows a step, D={w.dim}"
          + (f", sum bags of {w.bag_size}" if w.bag_size else "") + f"; {n}\n")
    print("| optimizer, state | cache (rows) | records in | ms/step median | mean | fwd / bwd / step ms | hit rate "
          "| bypassed/step | records moved MiB/step | bypassed MiB/step (modelled) | PCIe MiB/step (modelled) "
          "| minimum MiB/step (modelled) | host waits/step | cache rows/GiB | rows read/fetch |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for r in rows:
        cache = "none" if not r["cache"] else f"{r['cache']:g} ({r['cache_rows']:,})"
        p = r["phases_ms"]
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        waits = "" if r["host_waits_per_step"] is None else f"{r['host_waits_per_step']:.2f}"
        per_gib = "" if r["cache_rows_per_gib"] is None else f"{r['cache_rows_per_gib']:,.0f}"
        reads = "" if r["host_reads_per_fetch"] is None else f"{r['host_reads_per_fetch']:.2f}"
        moved = "" if r["record_bytes_moved_per_step"] is None else f"{r['record_bytes_moved_per_step'] / mib:,.1f}"
        # Records in host memory (an optimizer that updates on the CPU moves
        # them there): the bytes are then host copies, not PCIe.
        print(f"| {r['optimizer']}, {r['state']} | {cache} | {r['records_on'] or ''} | {r['ms_per_step']:.2f} | "
              f"{r['mean_ms']:.2f} | "
              f"{p['forward']:.2f} / {p['backward']:.2f} / {p['step']:.2f} | {hit} | {r['bypassed_per_step']:,.0f} | "
              f"{moved} | {r['bypass_bytes_per_step' + MODELLED] / mib:,.1f} | "
              f"{r['pcie_bytes_per_step' + MODELLED] / mib:,.1f} | {r['minimum_bytes_per_step' + MODELLED] / mib:,.1f} "
              f"| {waits} | {per_gib} | {reads} |")
    print("\nRecords moved: counted by the cache (records fetched and written back, times a record's size). "
          "(modelled): a formula, not a count: each bypassed row (every row without a cache) has its weight read "
          "for the forward and its record read and written by the update, at a record's size by formula "
          "(record_bytes_modelled in the JSON); the minimum is each step's first touches at that size. Cache "
          "rows/GiB: of the records as allocated.")
    if w.protocol == "dynamicemb":
        for fraction, figures in PUBLISHED.items():
            print(f"\nPublished on this protocol, cache {fraction:g}, H100, Adam (mean ms/step): "
                  + "; ".join(f"{k} {v}" for k, v in figures.items()))


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    today = datetime.date.today().isoformat()
    path = args.json or os.path.join(run_folder(device), "cache_protocols.json")
    rows, mine = [], []  # mine: this run's, written as result rows beside the JSON
    context = run_context("cache_step", device=device)
    if args.append and os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    for protocol in args.protocols:
        t0 = time.perf_counter()
        w = workload(protocol, args, device)
        log(f"{protocol}: {len(w.batches)} batches drawn in {time.perf_counter() - t0:.1f} s; "
            f"{w.rows:,} rows; {w.notes}")
        these = []
        for optimizer in args.optimizers or [w.optimizer]:
            for state in (args.states if optimizer == "adam" else ["float32"]):
                if not args.no_check:
                    check_bits(protocol, optimizer, state, args, device)
                measured = measure(w, optimizer, state, args, device, today)
                these += measured
                mine += measured
                write_json(path, rows + these)  # kept as it grows: a run cut short keeps what it measured
                write_rows(os.path.dirname(path), result_rows(mine, context))
        rows += these
        print_table(w, these)
        del w
        gc.collect()
    write_json(path, rows)
    write_json(os.path.join(os.path.dirname(path), "cache_protocols_machine.json"),
               {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"}})
    log(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
