"""The training step through the row cache on the anchors' own protocols:
ms a step with its phases, hit rate, bytes over PCIe a step against the
minimum and the host's waits for the device, without a cache and with
caches of several sizes, for float32 and compact optimizer state.

Protocols (--protocols; the streams and where each was read from are in
benchmarks/_anchor_streams.py):
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

Before timing each protocol and state, a small draw of its stream checks
on the same device that a table with a row cache trains to the uncached
table's bits (--no-check skips it); a difference ends the run.

A step: forward (ids on the device), backward, step(), with the update
fused in backward unless --unfused; with a cache and one row an id, the
next batch is planned (dedup, misses, evictions) during this step
(--no-plan-ahead to turn it off). The timed steps each end in a device
sync; the phases are timed by events between them (no extra sync). The
protocols' own figures are means, ours are printed as median and mean.

JSON (--json; default benchmarks/results/<device>-<date>/cache_protocols.json):
a list of rows {"protocol", "cache" (fraction; 0 for none), "state",
"optimizer", "ms_per_step" (median), "mean_ms", "device", "date", the
phases, hit rate, bytes and waits, and the cache's rows per GiB of its
records as allocated}.

Usage (after `pip install .`; a GPU for the real figures):
    python benchmarks/cache_step.py [--protocols dynamicemb,fbgemm,fresh,replayed --states float32,int8]
On the CPU (--device cpu, with --scale 0.001 or so) the records are host
memory: a check of the harness, not a figure to compare.
"""
import argparse
import datetime
import gc
import json
import os
import re
import time

import numpy as np
import torch

import _anchor_streams as streams
from _common import RESULTS_DIR, fail, log, machine_info, require_hostembed, write_json

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


def device_label(device):
    """'h100', 'h200', ... from the GPU's name; 'cpu' for the CPU."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else name.split()[-1]).lower()


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


def check_bits(protocol, optimizer, state, args, device):
    """A fast wrong answer is not a result: on a small draw of the
    protocol's stream, on this device, a table with a row cache of half its
    rows must train to the bits of the same table without one (several
    steps, plan-ahead as timed), before anything is timed."""
    small = argparse.Namespace(**{**vars(args), "scale": min(args.scale, 0.001), "batches": 4, "iters": 2,
                                  "warmup": 2, "steps": 2})
    w = workload(protocol, small, device)
    out_rows = len(w.batches[0]) // w.bag_size if w.bag_size else len(w.batches[0])
    grad_out = torch.randn(out_rows, w.dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    weights = []
    for cache_rows in (None, max(1, w.rows // 2)):
        module, opt = build(w, optimizer, state, args, device)
        module.cache_rows = cache_rows
        run(module, opt, w, grad_out, not args.no_plan_ahead, device)
        weights.append(module.weight.detach().clone())  # reading it writes the cache back
        del module, opt
        gc.collect()
    if not torch.equal(*weights):
        fail(f"{protocol}, {optimizer} {state}: the cached table's weights differ from the uncached table's "
             f"(max |difference| {float((weights[0] - weights[1]).abs().max()):.3g})")
    log(f"{protocol}, {optimizer} {state}: a cache of half the rows trains to the uncached bits (checked)")


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


def measure(w, optimizer, state, args, device, today):
    """Rows of the report for one workload, optimizer and state form."""
    module, opt = build(w, optimizer, state, args, device)
    out_rows = w.bag_size and len(w.batches[0]) // w.bag_size or len(w.batches[0])
    grad_out = torch.randn(out_rows, w.dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    base, first = cache_base(w), first_touches(w)
    weight_bytes = w.dim * 4
    record = weight_bytes + state_bytes(optimizer, state, w.dim)
    unique = w.notes["unique_per_step"]
    fractions = args.fractions or [float(x) for x in FRACTIONS[w.protocol].split(",")]
    rows = []
    for fraction in ([] if args.no_baseline else [0.0]) + fractions:
        module.cache_rows = max(1, int(round(fraction * base))) if fraction else None
        wall, phases, stats, waits = run(module, opt, w, grad_out, not args.no_plan_ahead, device)
        row = {"protocol": w.protocol, "cache": fraction, "state": state, "optimizer": optimizer,
               "ms_per_step": float(np.median(wall)), "mean_ms": float(np.mean(wall)),
               "min_ms": float(np.min(wall)), "max_ms": float(np.max(wall)), "steps": len(wall),
               "device": device_label(device), "date": today, "phases_ms": phases, "table_rows": w.rows,
               "cache_rows": module.cache_rows or 0, "cache_of_rows": base, "unique_per_step": unique,
               "first_touch_per_step": first, "record_bytes": record, "host_waits_per_step": waits,
               "minimum_bytes_per_step": first * record}
        if stats is None:
            # Modelled: the forward reads each unique row's weight, the update
            # reads and writes its record.
            row.update(hit_rate=None, bypassed_per_step=unique, records_on=None, cache_rows_per_gib=None,
                       pcie_bytes_per_step=unique * (weight_bytes + 2 * record))
        else:
            # The records as allocated (weight, state, 8-bit scales): how
            # many rows a GiB of cache holds in this form.
            row["cache_bytes_per_row"] = module._table.cache._record_bytes()
            row["cache_rows_per_gib"] = 2**30 / row["cache_bytes_per_row"]
            moved = stats["fetched_bytes"] + stats["written_back_bytes"]
            row.update(hit_rate=stats["hits"] / max(stats["rows"], 1), bypassed_per_step=stats["bypassed"],
                       records_on=str(module._table.cache.device), record_bytes_moved_per_step=moved,
                       pcie_bytes_per_step=moved + stats["bypassed"] * (weight_bytes + 2 * record), stats=stats)
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
          "| bypassed/step | PCIe MiB/step | minimum MiB/step | host waits/step | cache rows/GiB |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cache = "none" if not r["cache"] else f"{r['cache']:g} ({r['cache_rows']:,})"
        p = r["phases_ms"]
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        waits = "" if r["host_waits_per_step"] is None else f"{r['host_waits_per_step']:.2f}"
        per_gib = "" if r["cache_rows_per_gib"] is None else f"{r['cache_rows_per_gib']:,.0f}"
        # Records in host memory (an optimizer that updates on the CPU moves
        # them there): the bytes are then host copies, not PCIe.
        print(f"| {r['optimizer']}, {r['state']} | {cache} | {r['records_on'] or ''} | {r['ms_per_step']:.2f} | "
              f"{r['mean_ms']:.2f} | "
              f"{p['forward']:.2f} / {p['backward']:.2f} / {p['step']:.2f} | {hit} | {r['bypassed_per_step']:,.0f} | "
              f"{r['pcie_bytes_per_step'] / 2**20:,.1f} | {r['minimum_bytes_per_step'] / 2**20:,.1f} | {waits} "
              f"| {per_gib} |")
    if w.protocol == "dynamicemb":
        for fraction, figures in PUBLISHED.items():
            print(f"\nPublished on this protocol, cache {fraction:g}, H100, Adam (mean ms/step): "
                  + "; ".join(f"{k} {v}" for k, v in figures.items()))


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    today = datetime.date.today().isoformat()
    path = args.json or os.path.join(RESULTS_DIR, f"{device_label(device)}-{today}", "cache_protocols.json")
    rows = []
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
                these += measure(w, optimizer, state, args, device, today)
                write_json(path, rows + these)  # kept as it grows: a run cut short keeps what it measured
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
