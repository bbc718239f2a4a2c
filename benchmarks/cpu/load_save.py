"""Loading and saving a big table: peak RSS and wall time, next to plain file reads and writes.

Loading (one fresh process per case, so each peak RSS is its own; the page
cache warm, then cold where it can be dropped):
  read            the file read into one reused 64 MiB buffer: the ceiling, which
                  unlike any loader needs no fresh memory for the table
  torch.load      torch.load(path) + nn.Embedding.load_state_dict (the naive way)
  torch mmap      torch.load(mmap=True) + meta nn.Embedding + load_state_dict(assign=True)
                  (seeds 003/004): lazy, so a full pass over the rows is timed and measured too
  hostembed .pt / .safetensors / .npy / fp16 .safetensors
                  hostembed.Embedding.from_pretrained(path)
  hostembed.load  a whole checkpoint (weights + both Adam moments) into a live model
Saving (one process holding the table and its Adam state):
  plain write     the same bytes written from memory with os.write, then fsync
  hostembed.save  the checkpoint (no CRC), fsync, rename
  torch.save      the same dict with torch.save's defaults (CRC on), then fsync

Peak RSS is reported above the process's baseline after `import torch,
hostembed` (stated separately), in units of the table's bytes.

Beside its JSON (--out, or --json) the run writes its figures as result
rows (rows.jsonl, benchmarks/_rows.py's schema; result_rows below): each
load case's time (median, min, max over the rounds), the time allocating
the table took in its median round, the plain read of the same file timed
next to it, their ratios, and the peak RSS; each save's time, rate, ratio
to the plain write and extra peak RSS; the baseline RSS and the table's
allocation alone.

Usage (after `pip install .`, or an in-place build with PYTHONPATH=python):
    python benchmarks/cpu/load_save.py [--table-gib 4 --dir /tmp/x]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (GIB, run_folder, PeakRss, log, machine_info, make_row, require_hostembed,  # noqa: E402
                     run_context, spread_rows, write_json, write_rows)

BUFFER = 64 << 20
FORMATS = {"pt": ".pt", "safetensors": ".safetensors", "npy": ".npy", "safetensors16": ".fp16.safetensors"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--table-gib", type=float, default=4.0, help="table size in GiB (float32)")
    p.add_argument("--dim", type=int, default=128, help="embedding dim D")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument("--save-table-gib", type=float, default=2.0,
                   help="table size for the save measurements, which hold 3x it in RAM and write 3x it per save")
    p.add_argument("--no-save", action="store_true", help="skip the save measurements")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of every case (medians reported)")
    p.add_argument("--out", "--json", dest="out", default=os.path.join(run_folder(), "load_save.json"),
                   help="the JSON report; its result rows go to rows.jsonl in its folder")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def trained_table(hostembed, rows, dim):
    """A table with both Adam moments resident, as after training, without
    a full-table batch (its output and gradient would need 2 more tables)."""
    emb = hostembed.Embedding(rows, dim)
    opt = hostembed.SparseAdam(emb.parameters())
    emb(torch.arange(min(rows, 1024))).sum().backward()
    opt.step()
    opt.zero_grad()
    for moment in opt.state[emb.weight].values():
        if isinstance(moment, torch.Tensor) and moment.dim() == 2:
            moment.uniform_(0.0, 1e-3)
    hostembed.empty_cache()
    return emb, opt


# --- one case, in its own process ------------------------------------------------------------

def run_case(case, path, rows, dim):
    hostembed = require_hostembed()
    peak = PeakRss()
    peak.start()
    baseline = peak.window()
    result = {}
    t0 = time.perf_counter()
    if case == "read":
        buf = bytearray(BUFFER)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    elif case == "torch.load":
        emb = torch.nn.Embedding(rows, dim)  # the model exists before its checkpoint is loaded
        t0 = time.perf_counter()
        emb.load_state_dict(torch.load(path, weights_only=True))
    elif case == "torch mmap":
        with torch.device("meta"):
            emb = torch.nn.Embedding(rows, dim)
        emb.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True)
        result["load_s"] = time.perf_counter() - t0
        result["load_peak_bytes"] = peak.window() - baseline
        emb.weight.detach().sum()  # the first pass faults the rows in
    elif case == "allocate":
        from hostembed.nn.host_module import UNINITIALISED
        emb = hostembed.Embedding(rows, dim, _weight=UNINITIALISED)  # what from_pretrained does before reading
    elif case.startswith("hostembed ."):
        result["allocate_seconds"] = 0.0
        allocate = hostembed._core.table.allocate

        def timed_allocate(*a, **kw):
            # Fresh memory for the table costs this VM 0.2 to 3 s per 4 GiB
            # from one run to the next (torch.empty + fill: 2.4 to 4.4 s),
            # a cost the file read into a reused buffer never pays: timed
            # apart so that the load's own work can be told from it.
            start = time.perf_counter()
            table = allocate(*a, **kw)
            result["allocate_seconds"] += time.perf_counter() - start
            return table

        hostembed._core.table.allocate = timed_allocate
        emb = hostembed.Embedding.from_pretrained(path, progress=False)
    elif case == "hostembed.load":
        emb, opt = trained_table(hostembed, rows, dim)
        peak.start()
        baseline = peak.window() - 3 * rows * dim * 4  # the live table and moments are what gets loaded
        result["loaded_bytes"] = 3 * rows * dim * 4
        t0 = time.perf_counter()
        hostembed.load(path, emb, opt)
    else:
        raise SystemExit(f"unknown case {case}")
    seconds = time.perf_counter() - t0
    if case.startswith("hostembed ."):  # the table as loaded: from a float16 file, a float16 table
        result["loaded_bytes"] = emb.weight.numel() * emb.weight.element_size()
    result.setdefault("loaded_bytes", rows * dim * 4)
    result.update(seconds=seconds, peak_bytes=peak.window() - baseline, baseline_bytes=baseline)
    print(json.dumps(result))


def run_save(directory, rows, dim, repeats):
    """Table + Adam state in memory; times a plain write, hostembed.save and torch.save of them."""
    hostembed = require_hostembed()
    emb, opt = trained_table(hostembed, rows, dim)
    state = opt.state[emb.weight]
    tensors = [emb.weight.detach(), state["exp_avg"], state["exp_avg_sq"]]
    nbytes = sum(t.numel() * 4 for t in tensors)
    peak = PeakRss()
    out = {}

    def timed(name, fn, path):
        peak.start()
        before = peak.window()
        t0 = time.perf_counter()
        fn(path)
        seconds = time.perf_counter() - t0
        row = out.setdefault(name, {"seconds": [], "peak_extra_bytes": 0, "file_bytes": os.path.getsize(path)})
        row["seconds"].append(seconds)
        row["peak_extra_bytes"] = max(row["peak_extra_bytes"], peak.window() - before)
        log(f"  {name}: {seconds:.1f} s")

    def plain(path):
        from hostembed.io.stream import _writable_bytes  # the bytes of a tensor, no copy

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors:
                view = _writable_bytes(t)
                for start in range(0, len(view), BUFFER):
                    os.write(fd, view[start:start + BUFFER])
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_default(path):
        torch.save({"model": emb.state_dict(), "optimizer": opt.state_dict()}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    contenders = (("plain write", plain, "plain.bin"),
                  ("hostembed.save", lambda p: hostembed.save(p, emb, opt), "checkpoint.pt"),
                  ("torch.save", torch_default, "torch_default.pt"))
    # The first big write of a process runs several times slower whatever
    # writes it (page cache growing): one untimed write, then rounds in
    # rotation so that drift hits every contender alike.
    plain(os.path.join(directory, "warmup.bin"))
    os.unlink(os.path.join(directory, "warmup.bin"))
    for _ in range(repeats):
        for name, fn, file in contenders:
            timed(name, fn, os.path.join(directory, file))
            if name != "hostembed.save":
                os.unlink(os.path.join(directory, file))  # the checkpoint stays for the load case
    for row in out.values():
        row["median_s"] = statistics.median(row["seconds"])
        row["gb_per_s"] = nbytes / row["median_s"] / 1e9
    print(json.dumps({"bytes": nbytes, **out}))


# --- the driver -------------------------------------------------------------------------------

def child(args, **kw):
    argv = [sys.executable, os.path.abspath(__file__)] + [f"--{k}={v}" for k, v in kw.items()]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    sys.stderr.write(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def evict(path):
    """Drops the file's pages from the page cache (clean pages only: fsync'ed first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_files(directory, rows, dim):
    from safetensors.torch import save_file
    import numpy as np

    log(f"writing a {rows} x {dim} float32 table in every format to {directory} ...")
    table = torch.randn(rows, dim)
    paths = {name: os.path.join(directory, "table" + suffix) for name, suffix in FORMATS.items()}
    torch.save({"weight": table}, paths["pt"])
    np.save(paths["npy"], table.numpy())
    save_file({"weight": table}, paths["safetensors"])
    save_file({"weight": table.half()}, paths["safetensors16"])
    for path in paths.values():
        evict(path)  # written back now, not while a case is timed
    return paths


def main():
    args = parse_args()
    if args.case == "save":
        return run_save(args.path, args.rows, args.dim, args.repeats)
    if args.case:
        return run_case(args.case, args.path, args.rows, args.dim)
    rows = int(args.table_gib * GIB) // (args.dim * 4)
    table_bytes = rows * args.dim * 4
    directory = args.dir or tempfile.mkdtemp(prefix="hostembed-load-")
    os.makedirs(directory, exist_ok=True)
    report = {"machine": machine_info(), "rows": rows, "dim": args.dim, "table_bytes": table_bytes, "load": [],
              "save": None, "repeats": args.repeats}
    try:
        paths = write_files(directory, rows, args.dim)
        table_rows = {fmt: rows for fmt in paths}
        if not args.no_save:
            log("saving table + Adam state three ways ...")
            save_rows = int(args.save_table_gib * GIB) // (args.dim * 4)
            report["save"] = child(args, case="save", path=directory, rows=save_rows, dim=args.dim,
                                   repeats=args.repeats)
            report["save"]["rows"] = save_rows
            paths["checkpoint"] = os.path.join(directory, "checkpoint.pt")
            table_rows["checkpoint"] = save_rows
        cases = [("torch.load", "pt"), ("torch mmap", "pt"), ("hostembed .pt", "pt"),
                 ("hostembed .safetensors", "safetensors"), ("hostembed .npy", "npy"),
                 ("hostembed .safetensors fp16", "safetensors16")]
        if "checkpoint" in paths:
            cases.append(("hostembed.load", "checkpoint"))
        runs = {}
        for _ in range(args.repeats):  # rounds over all cases: drift on this shared machine hits all alike
            for cache in ["warm"] + ([] if args.no_cold else ["cold"]):
                for case, fmt in cases:
                    path = paths[fmt]
                    log(f"{cache}: {case} ({os.path.basename(path)})")
                    # Only this case's file may be cached (warm) or none (cold):
                    # every case then finds the same free memory, instead of
                    # paying to reclaim the page cache the earlier files left.
                    for other in paths.values():
                        if other != path or cache == "cold":
                            evict(other)
                    # Reading the same file in the same cache state is this case's ceiling.
                    if cache == "warm":
                        child(args, case="read", path=path, rows=rows, dim=args.dim)  # warms it
                    read = child(args, case="read", path=path, rows=rows, dim=args.dim)
                    if cache == "cold":
                        evict(path)
                    result = child(args, case=case, path=path, rows=table_rows[fmt], dim=args.dim)
                    runs.setdefault((case, fmt, cache), []).append(
                        {"read_seconds": read["seconds"], "read_baseline_bytes": read["baseline_bytes"], **result})
        for (case, fmt, cache), results in runs.items():
            middle = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]  # the median run
            report["load"].append({"case": case, "file": os.path.basename(paths[fmt]), "cache": cache,
                                   "rows": table_rows[fmt],
                                   "file_bytes": os.path.getsize(paths[fmt]), **middle,
                                   "read_seconds": statistics.median(r["read_seconds"] for r in results),
                                   "all_read_seconds": [r["read_seconds"] for r in results],
                                   "all_seconds": [r["seconds"] for r in results],
                                   "peak_bytes": max(r["peak_bytes"] for r in results)})
        for other in paths.values():
            evict(other)
        report["allocate_seconds"] = child(args, case="allocate", path="-", rows=rows, dim=args.dim)["seconds"]
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print_report(report)
    write_json(args.out, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.out)),
                      result_rows(report, run_context("load_save", info=report["machine"])))
    log(f"wrote {args.out} and {path}")


def result_rows(report, context):
    """The run's figures as result rows (benchmarks/_rows.py's schema).
    A load case is a contender (its name as printed) with its file and
    cache state in the workload; the plain read of the same file, in the
    same cache state, is its "file_read_time"; a ratio uses the case's
    median round and the reads' median, as print_report does."""
    dim = report["dim"]
    base = {"dim": dim, "repeats": report["repeats"]}
    out = []
    if "allocate_seconds" in report:
        out.append(make_row(context, {**base, "rows": report["rows"], "table_bytes": report["table_bytes"]},
                            "allocating the table alone (no file)", "allocate_time", report["allocate_seconds"], "s"))
    if report["load"]:
        out.append(make_row(context, base, "import torch, hostembed", "baseline_rss",
                            min(r["read_baseline_bytes"] for r in report["load"]), "bytes"))
    for r in report["load"]:
        workload = {**base, "rows": r["rows"], "table_bytes": r["rows"] * dim * 4, "file": r["file"],
                    "file_bytes": r["file_bytes"], "cache": r["cache"]}
        out += spread_rows(context, workload, r["case"], "load_time", r["all_seconds"], "s")
        out += spread_rows(context, workload, r["case"], "file_read_time", r["all_read_seconds"], "s")
        alloc = r.get("allocate_seconds")
        figures = [("allocate_time", alloc, "s"), ("time_vs_read", r["seconds"] / r["read_seconds"], "x"),
                   ("time_vs_read_without_allocation",
                    None if alloc is None else (r["seconds"] - alloc) / r["read_seconds"], "x"),
                   ("peak_rss_added", r["peak_bytes"], "bytes"), ("loaded_bytes", r["loaded_bytes"], "bytes"),
                   ("peak_rss_of_loaded", r["peak_bytes"] / r["loaded_bytes"], "x"),
                   ("lazy_load_time", r.get("load_s"), "s"),  # torch mmap: before the first pass
                   ("lazy_load_peak_rss_added", r.get("load_peak_bytes"), "bytes")]
        out += [make_row(context, workload, r["case"], metric, value, unit) for metric, value, unit in figures
                if value is not None]
    save = report["save"]
    if save:
        workload = {**base, "rows": save["rows"], "table_bytes": save["rows"] * dim * 4,
                    "state": "SparseAdam (exp_avg, exp_avg_sq)", "bytes": save["bytes"]}
        plain = save["plain write"]["median_s"]
        for name in ("plain write", "hostembed.save", "torch.save"):
            s = save[name]
            out += spread_rows(context, workload, name, "save_time", s["seconds"], "s")
            out += [make_row(context, workload, name, metric, value, unit) for metric, value, unit in (
                ("save_rate", s["gb_per_s"], "GB/s"), ("time_vs_plain_write", s["median_s"] / plain, "x"),
                ("peak_rss_added", s["peak_extra_bytes"], "bytes"), ("file_size", s["file_bytes"], "bytes"))]
    return out


def print_report(report):
    table_bytes = report["table_bytes"]
    print(f"\nTable: {report['rows']:,} x {report['dim']} float32 = {table_bytes / GIB:.2f} GiB; "
          f"{report['machine']['cpu_model']}, {report['machine']['usable_cpus']} CPUs")
    baseline = [r["read_baseline_bytes"] for r in report["load"]]
    if baseline:
        print(f"Baseline RSS after `import torch, hostembed` (not counted below): {min(baseline) / 2**20:.0f} MiB\n")
    print(f"Medians of {len(report['load'][0]['all_seconds'])} runs; peak RSS is the highest.\n")
    print("| load | file | cache | wall s | of which allocating the table | read file s | x read "
          "| x read, allocation excluded | peak RSS / bytes loaded |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in report["load"]:
        extra = ""
        if "load_s" in r:
            extra = f" (load {r['load_s']:.2f} s, peak {r['load_peak_bytes'] / table_bytes:.2f}; + first pass)"
        alloc = r.get("allocate_seconds")
        alloc_cells = f"{alloc:.2f} | " if alloc is not None else " | "
        excluded = f"{(r['seconds'] - alloc) / r['read_seconds']:.2f}" if alloc is not None else ""
        print(f"| {r['case']}{extra} | {r['file']} | {r['cache']} | {r['seconds']:.2f} | {alloc_cells}"
              f"{r['read_seconds']:.2f} | {r['seconds'] / r['read_seconds']:.2f} | {excluded} | "
              f"{r['peak_bytes'] / r['loaded_bytes']:.2f} |")
    if "allocate_seconds" in report:
        print(f"\nAllocating and first-touching the {table_bytes / GIB:.2f} GiB table alone (no file) takes "
              f"{report['allocate_seconds']:.2f} s: part of every hostembed load above, not of the reads.")
    if report["save"]:
        save = report["save"]
        print(f"\nSave of a {save['bytes'] / 3 / GIB:.1f} GiB table + Adam state ({save['bytes'] / GIB:.1f} GiB), "
              f"fsync included, "
              f"median of {len(save['plain write']['seconds'])}:\n")
        print("| save | wall s | GB/s | x plain write | extra peak RSS / table |")
        print("|---|---:|---:|---:|---:|")
        plain = save["plain write"]["median_s"]
        for name in ("plain write", "hostembed.save", "torch.save"):
            s = save[name]
            print(f"| {name} | {s['median_s']:.1f} | {s['gb_per_s']:.2f} | {s['median_s'] / plain:.2f} | "
                  f"{s['peak_extra_bytes'] / (save['bytes'] / 3):.2f} |")


if __name__ == "__main__":
    main()
