"""Micro-benchmarks of hostembed's core, next to the host copy bandwidth measured in the same run.

  (a) gather (forward lookup) bandwidth vs D: B uniform random ids from a
      ~1 GiB table; bytes = B x D x 4 read + the same written
  (b) SparseAdam update rate vs the number of unique rows in the gradient:
      rows/s, and GB/s at 28 bytes per element (read w, m, v, g; write w, m, v)
  (c) on a GPU: host <-> GPU copy bandwidth (cudaMemcpy), pinned and pageable

torch's own gather (F.embedding) and torch.optim.SparseAdam run on the same
data for reference (--no-torch skips them). Every timed call gets fresh
uniform random ids or rows, drawn untimed before it: repeating the same ones
would find them in the cache (65,536 rows of D = 16 are 4 MiB). These are
memory-bound figures, compared with a memory-bound ceiling. The figures go
to micro.json in --out and, as result rows (result_rows), to rows.jsonl
beside it.

Usage (after `pip install .`, or an in-place build with PYTHONPATH=python):
    python benchmarks/cpu/micro.py [--dims 16,32,64 --unique 1000,10000 ...]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (GIB, run_folder, copy_bandwidth, fmt_ms, log, machine_info, make_row, progress,  # noqa: E402
                     require_hostembed, run_context, spread_rows, synchronize, usable_cpus, write_json, write_plots,
                     write_rows)

hostembed = require_hostembed()

ADAM_BYTES_PER_ELEMENT = 28  # read w, m, v, g and write w, m, v: 7 x 4 bytes
MIN_REPEATS = 3              # a median needs a few samples, however slow the call


def int_list(text):
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dims", type=int_list, default=[16, 32, 64, 128, 256, 512], help="gather: embedding dims D")
    p.add_argument("--batch", type=int, default=65_536, help="gather: ids per lookup B")
    p.add_argument("--table-mib", type=int, default=1024,
                   help="gather: table size (rows = this / (4 D)), well beyond the last-level cache")
    p.add_argument("--unique", type=int_list, default=[1_000, 10_000, 100_000, 1_000_000],
                   help="SparseAdam: unique rows in the gradient")
    p.add_argument("--adam-rows", type=int, default=2_000_000, help="SparseAdam: table rows N")
    p.add_argument("--adam-dim", type=int, default=128, help="SparseAdam: embedding dim D")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per point (at most)")
    p.add_argument("--budget-s", type=float, default=2.0,
                   help="stop repeating a point after this many timed seconds (at least 3 calls)")
    p.add_argument("--pcie-mib", type=int, default=256, help="GPU: bytes per host <-> GPU copy")
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the host copy bandwidth ceiling")
    p.add_argument("--copy-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="skip torch's reference figures")
    p.add_argument("--out", default=run_folder(), help="directory for the JSON and the plots")
    args = p.parse_args(argv)
    if not args.dims or not args.unique or min(args.dims + args.unique) < 1:
        p.error("--dims and --unique need positive values")
    if max(args.unique) > args.adam_rows:
        p.error(f"--adam-rows ({args.adam_rows:,}) must be >= the largest --unique ({max(args.unique):,})")
    if min(args.batch, args.table_mib, args.adam_dim, args.repeats, args.threads, args.pcie_mib) < 1:
        p.error("sizes, --repeats and --threads must be >= 1")
    return args


def time_calls(fn, args, device="cpu", prepare=lambda: None):
    """Seconds of repeated fn() calls, after one untimed call (page faults,
    lazily allocated state). prepare() runs untimed before each call. Stops
    at --repeats calls, or earlier once --budget-s is spent, so slow
    reference points stay affordable."""
    def once():
        prepare()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t0

    once()
    seconds = []
    while len(seconds) < args.repeats and (len(seconds) < MIN_REPEATS or sum(seconds) < args.budget_s):
        seconds.append(once())
    return seconds


def rate(seconds, nbytes, items=None):
    median_s = statistics.median(seconds)
    r = {"median_ms": median_s * 1e3, "n": len(seconds), "bytes_per_s": nbytes / median_s,
         "all_ms": [s * 1e3 for s in seconds]}
    if items is not None:
        r["rows_per_s"] = items / median_s
    return r


class FreshDraw:
    """Called untimed before each timed call (time_calls' prepare): draws a
    new value for the call to use, so no call finds its rows in the cache."""

    def __init__(self, draw):
        self.draw, self.value = draw, None

    def __call__(self):
        self.value = self.draw()


# --- (a) gather -------------------------------------------------------------------------

def gather_point(dim, args, gen):
    rows = max(args.batch, (args.table_mib << 20) // (4 * dim))
    emb = hostembed.Embedding(rows, dim)
    weight = emb.weight.detach()  # torch's gather reads the same table memory
    ids = FreshDraw(lambda: torch.randint(rows, (args.batch,), generator=gen))
    nbytes = 2 * args.batch * dim * 4
    point = {"dim": dim, "rows": rows, "bytes": nbytes}
    with torch.no_grad():
        # The output dies at once, so the core reuses its scratch buffer, as in training.
        point["hostembed"] = rate(time_calls(lambda: emb(ids.value), args, prepare=ids), nbytes)
        if not args.no_torch:
            point["torch"] = rate(time_calls(lambda: F.embedding(ids.value, weight), args, prepare=ids), nbytes)
    return point


def gather_rates(args):
    gen = torch.Generator().manual_seed(args.seed)
    return [gather_point(dim, args, gen) for dim in progress(args.dims, "gather: D")]


# --- (b) SparseAdam --------------------------------------------------------------------------

def row_sparse_grad(rows, values, num_rows):
    """A coalesced sparse [num_rows, D] gradient from ascending unique rows."""
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (num_rows, values.shape[1]),
                                   is_coalesced=True, check_invariants=False)


def touch_all_rows(param, optimizer, chunk=1 << 18):
    """One step over every row with a zero gradient (which changes no weight):
    hostembed allocates the moments lazily, and in a long training run their
    pages are all resident; page faults are not what (b) measures."""
    num_rows, dim = param.shape
    for start in range(0, num_rows, chunk):
        rows = torch.arange(start, min(start + chunk, num_rows))
        param.grad = row_sparse_grad(rows, torch.zeros(rows.numel(), dim), num_rows)
        optimizer.step()


def adam_rates_for(param, optimizer, args, gen, desc):
    points = []
    for unique in progress(args.unique, desc):
        values = torch.randn(unique, args.adam_dim, generator=gen)
        # Fresh random rows for every call; the values can stay (a real step's
        # gradient is just written by the backward pass, so cache-hot anyway).
        grad = FreshDraw(lambda: row_sparse_grad(
            torch.randperm(args.adam_rows, generator=gen)[:unique].sort().values, values, args.adam_rows))

        def step():
            param.grad = grad.value
            optimizer.step()
        nbytes = ADAM_BYTES_PER_ELEMENT * unique * args.adam_dim
        points.append(rate(time_calls(step, args, prepare=grad), nbytes, items=unique))
    param.grad = None
    return points


def sparse_adam_rates(args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    emb = hostembed.Embedding(args.adam_rows, args.adam_dim)
    optimizer = hostembed.SparseAdam(emb.parameters())
    touch_all_rows(emb.weight, optimizer)
    result = {"hostembed": adam_rates_for(emb.weight, optimizer, args, gen, "SparseAdam: hostembed")}
    if not args.no_torch:
        # One at a time: each holds a table and two moments (12 bytes/element).
        # torch's moments are dense and zero-filled at its first (untimed) step.
        del emb, optimizer
        param = torch.nn.Parameter(torch.randn(args.adam_rows, args.adam_dim, generator=gen))
        result["torch"] = adam_rates_for(param, torch.optim.SparseAdam([param]), args, gen, "SparseAdam: torch")
    return [dict(unique_rows=u, bytes=ADAM_BYTES_PER_ELEMENT * u * args.adam_dim,
                 **{who: points[k] for who, points in result.items()}) for k, u in enumerate(args.unique)]


# --- (c) host <-> GPU -----------------------------------------------------------------------------

def pcie_rates(args):
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    device = torch.device("cuda")
    nbytes = args.pcie_mib << 20
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(nbytes, dtype=torch.uint8)  # written, so its pages exist before the timing
    on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copies = {
        "h2d_pinned": lambda: on_gpu.copy_(pinned, non_blocking=True),
        "d2h_pinned": lambda: pinned.copy_(on_gpu, non_blocking=True),
        # hostembed's outputs are not pinned (pinning copies, and rounds up to
        # a power of two): this is the path .to(device) takes for them.
        "h2d_pageable": lambda: on_gpu.copy_(pageable),
        "d2h_pageable": lambda: pageable.copy_(on_gpu),
    }
    result = {"bytes": nbytes}
    for name, copy in progress(list(copies.items()), "host <-> GPU"):
        result[name] = rate(time_calls(copy, args, device), nbytes)
    return result


# --- report -----------------------------------------------------------------------------------

def gbps(r):
    return f"{r['bytes_per_s'] / 1e9:.2f}"


def share(r, ceiling):
    return f"{r['bytes_per_s'] / ceiling:.0%}"


def print_report(args, report):
    ceiling = report["copy_bandwidth"]["best_bytes_per_s"]
    cp = report["copy_bandwidth"]
    machine = report["machine"]
    print(f"## hostembed micro-benchmarks: {machine['cpu_model']}, {args.threads} threads\n")
    print(f"Host copy bandwidth (read + write, {cp['before']['buffer_bytes'] / GIB:.2f} GiB dst.copy_(src), "
          f"median of {cp['before']['repeats']}): {ceiling / 1e9:.2f} GB/s, the best of before "
          f"({cp['before']['bytes_per_s'] / 1e9:.2f}) and after ({cp['after']['bytes_per_s'] / 1e9:.2f}) the "
          "benchmarks. '% of copy' below is against it.\n")

    torch_cols = not args.no_torch
    print(f"### (a) Gather (forward lookup): B = {args.batch:,} uniform random ids from a ~{args.table_mib:,} MiB "
          "table; bytes = B x D x 4 read + written\n")
    print("| D | rows | hostembed ms | GB/s | % of copy |" + (" torch F.embedding ms | GB/s | % of copy |" if torch_cols else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if torch_cols else ""))
    for p in report["gather"]:
        h = p["hostembed"]
        line = f"| {p['dim']} | {p['rows']:,} | {fmt_ms(h['median_ms'])} | {gbps(h)} | {share(h, ceiling)} |"
        if torch_cols:
            t = p["torch"]
            line += f" {fmt_ms(t['median_ms'])} | {gbps(t)} | {share(t, ceiling)} |"
        print(line)

    print(f"\n### (b) SparseAdam update: a {args.adam_rows:,} x {args.adam_dim} table, random unique rows; "
          f"bytes = {ADAM_BYTES_PER_ELEMENT} per element\n")
    print("| unique rows | hostembed ms | rows/s | GB/s | % of copy |"
          + (" torch ms | rows/s | GB/s | hostembed speedup |" if torch_cols else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if torch_cols else ""))
    for p in report["sparse_adam"]:
        h = p["hostembed"]
        line = (f"| {p['unique_rows']:,} | {fmt_ms(h['median_ms'])} | {h['rows_per_s'] / 1e6:.2f} M | {gbps(h)} "
                f"| {share(h, ceiling)} |")
        if torch_cols:
            t = p["torch"]
            line += (f" {fmt_ms(t['median_ms'])} | {t['rows_per_s'] / 1e6:.2f} M | {gbps(t)} "
                     f"| {t['median_ms'] / h['median_ms']:.1f}x |")
        print(line)

    print("\n'% of copy' can pass 100%: the ceiling is a copy, one read per write; the update reads 4 streams "
          "for every 3 it writes, and memory serves reads faster than writes.")
    pcie = report["pcie"]
    print(f"\n### (c) Host <-> GPU copies (cudaMemcpy, {args.pcie_mib} MiB, one direction)\n")
    if "skipped" in pcie:
        print(f"skipped: {pcie['skipped']}")
    else:
        print("| copy | ms | GB/s |")
        print("|---|---:|---:|")
        for name in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
            print(f"| {name} | {fmt_ms(pcie[name]['median_ms'])} | {gbps(pcie[name])} |")
    print(f"\nWall time {report['wall_s']:.0f} s. JSON: {report['json']}")
    plots = report["plots"]
    print(f"Plots: {', '.join(plots)}" if isinstance(plots, list) else plots)


def plot_bandwidth(title, xlabel, xs, series, ceiling, log_base):
    """series: {label: [bytes/s per x]}."""
    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, values in series.items():
            ax.plot(xs, [v / 1e9 for v in values], marker="o", label=label)
        ax.axhline(ceiling / 1e9, color="gray", linestyle="--", label="host copy bandwidth (read + write)")
        ax.set_xscale("log", base=log_base)
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        top = max([ceiling] + [v for values in series.values() for v in values]) / 1e9
        ax.set_ylim(0, top * 1.25)  # room for the legend above the ceiling line
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8, ncol=2)
        return fig
    return draw


def plots(args, report):
    ceiling = report["copy_bandwidth"]["best_bytes_per_s"]
    who = ["hostembed"] + ([] if args.no_torch else ["torch"])
    gather = report["gather"]
    adam = report["sparse_adam"]
    return {
        "micro_gather.png": plot_bandwidth(
            f"Gather: {args.batch:,} uniform ids, ~{args.table_mib} MiB table", "embedding dim D",
            [p["dim"] for p in gather], {w: [p[w]["bytes_per_s"] for p in gather] for w in who}, ceiling, 2),
        "micro_sparse_adam.png": plot_bandwidth(
            f"SparseAdam: {args.adam_rows:,} x {args.adam_dim} table, {ADAM_BYTES_PER_ELEMENT} bytes/element",
            "unique rows in the gradient", [p["unique_rows"] for p in adam],
            {w: [p[w]["bytes_per_s"] for p in adam] for w in who}, ceiling, 10),
    }


def main(argv=None):
    wall_t0 = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    copy_bytes = args.copy_mib << 20

    log("measuring host copy bandwidth")
    before = copy_bandwidth(copy_bytes, args.copy_repeats, args.threads)
    log("gather")
    gather = gather_rates(args)
    log("SparseAdam")
    adam = sparse_adam_rates(args)
    log("host <-> GPU copies")
    pcie = pcie_rates(args)
    # Measured again after: on a shared machine one window can be disturbed,
    # and noise only ever lowers a ceiling.
    log("measuring host copy bandwidth again")
    after = copy_bandwidth(copy_bytes, args.copy_repeats, args.threads)

    report = {
        "benchmark": "micro",
        "machine": machine_info(threads=args.threads, torch_threads=torch.get_num_threads(),
                                hostembed_threads=hostembed.get_num_threads()),
        "config": vars(args),
        "copy_bandwidth": {"before": before, "after": after,
                           "best_bytes_per_s": max(before["bytes_per_s"], after["bytes_per_s"])},
        "gather": gather,
        "sparse_adam": adam,
        "pcie": pcie,
    }
    paths, note = write_plots(args.out, plots(args, report))
    report["plots"] = paths or note
    report["json"] = os.path.join(args.out, "micro.json")
    report["wall_s"] = time.perf_counter() - wall_t0
    write_json(report["json"], report)
    path = write_rows(os.path.dirname(os.path.abspath(report["json"])),
                      result_rows(run_context("micro", info=report["machine"]), report))
    print_report(args, report)
    log(f"wrote {path}")


# --- result rows ---------------------------------------------------------------------------------

GATHER_CONTENDERS = {"hostembed": "hostembed.Embedding", "torch": "torch F.embedding"}
ADAM_CONTENDERS = {"hostembed": "hostembed.SparseAdam", "torch": "torch.optim.SparseAdam"}
PCIE_CONTENDERS = {"h2d_pinned": "pinned copy H2D", "d2h_pinned": "pinned copy D2H",
                   "h2d_pageable": "pageable copy H2D", "d2h_pageable": "pageable copy D2H"}
HOST_COPY = "host copy (dst.copy_(src))"


def result_rows(ctx, report):
    """A run's report (its JSON) as result rows (benchmarks/_rows.py's
    schema); every row's workload has the run's threads, seed, repeats and
    budget_s. The host copy bandwidth before and after the benchmarks
    (workload "when"; median, min, max over its copies); (a) a D each
    (workload dim, rows, batch): each contender's gather time (median, min,
    max over the calls), bandwidth (at the median) and its share of the
    best copy bandwidth; (b) a number of unique rows each (workload
    unique_rows, rows, dim): the update's time, bandwidth, rows a second
    and share of the copy bandwidth, and hostembed's speed against torch's;
    (c) with a GPU (device: the GPU's name), each copy's time and bandwidth;
    the run's wall time."""
    config = report["config"]
    base = {k: config[k] for k in ("threads", "seed", "repeats", "budget_s")}
    copy = report["copy_bandwidth"]
    best = copy["best_bytes_per_s"]
    rows = []
    for when in ("before", "after"):
        measured = copy[when]
        rows += spread_rows(ctx, dict(base, when=when, buffer_bytes=measured["buffer_bytes"]), HOST_COPY,
                            "copy_bandwidth", measured["all_bytes_per_s"], "bytes/s")

    def timed(workload, contender, op, r, extra=()):
        """A point's time (spread), bandwidth and share of the copy's, and `extra` figures."""
        figures = [(f"{op}_bandwidth", r["bytes_per_s"], "bytes/s"),
                   ("copy_bandwidth_share", r["bytes_per_s"] / best, "fraction"), *extra]
        return (spread_rows(ctx, workload, contender, f"{op}_time", r["all_ms"], "ms")
                + [make_row(ctx, workload, contender, metric, value, unit) for metric, value, unit in figures])

    for point in report["gather"]:
        workload = dict(base, dim=point["dim"], rows=point["rows"], batch=config["batch"])
        for who, contender in GATHER_CONTENDERS.items():
            if who in point:
                rows += timed(workload, contender, "gather", point[who])
    for point in report["sparse_adam"]:
        workload = dict(base, unique_rows=point["unique_rows"], rows=config["adam_rows"], dim=config["adam_dim"])
        for who, contender in ADAM_CONTENDERS.items():
            if who in point:
                r = point[who]
                extra = [("update_rate", r["rows_per_s"], "rows/s")]
                if who == "hostembed" and "torch" in point:
                    extra.append(("speed_vs_torch", point["torch"]["median_ms"] / r["median_ms"], "x"))
                rows += timed(workload, contender, "update", r, extra)
    pcie = report["pcie"]
    if "skipped" not in pcie:
        gpu_ctx = dict(ctx, device=(report["machine"].get("gpu") or {}).get("name") or "cuda")
        for key, contender in PCIE_CONTENDERS.items():
            r, workload = pcie[key], dict(base, bytes=pcie["bytes"])
            rows += spread_rows(gpu_ctx, workload, contender, "copy_time", r["all_ms"], "ms")
            rows.append(make_row(gpu_ctx, workload, contender, "copy_bandwidth", r["bytes_per_s"], "bytes/s"))
    rows.append(make_row(ctx, base, "the whole run", "wall_time", report["wall_s"], "s"))
    return rows


if __name__ == "__main__":
    main()
