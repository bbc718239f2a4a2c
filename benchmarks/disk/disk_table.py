"""A table larger than its RAM budget, kept on disk (Embedding(storage=...)),
against the same table in memory: ms a step, hit rate in RAM, bytes read
and written on disk a step against the minimum, peak memory.

The disk runs happen in a memory cgroup (v1: /sys/fs/cgroup/memory/NAME,
memory.limit_in_bytes = --limit; root needed), so neither the process nor
the page cache it fills can hold the files; each run is a child process
moved into the cgroup before it imports anything. The files are made once,
outside the cgroup, then opened by each run. The in-memory runs use the
same shape, stream and steps, without a limit.

A step: a fresh batch of ids (Zipf(--alpha) over a random permutation of the
rows, or uniform), forward, backward of a fixed output gradient, step().
Warm-up steps fill the cache (until it evicts, then 20 more); medians of
the measured steps. Disk bytes are
the process's own storage I/O (/proc/self/io read_bytes, write_bytes; O_DIRECT
included); the minimum is the records moved (fetches and evictions x the
bytes of a row and its state).

    sudo python benchmarks/disk/disk_table.py            # ~10 min, ~9 GiB of files
    python benchmarks/disk/disk_table.py --rows 200000 --limit 256MiB --budget 32MiB --dir /tmp/t  # a quick look
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import run_folder, ZipfIds, log, machine_info, require_hostembed, write_json  # noqa: E402

CGROUP_ROOT = "/sys/fs/cgroup/memory"
OPTIMIZERS = {"sparse_adam": 2, "rowwise_adagrad": 0}  # rows of per-element state a row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=16_384, help="ids a step")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--warmup", type=int, default=600,
                   help="most steps before timing (a disk run stops 20 after its cache is full)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--limit", default="2GiB", help="the cgroup's memory limit for a disk run")
    p.add_argument("--budget", default="1GiB", help="the row cache's RAM (records of a row and its state)")
    p.add_argument("--dir", default="/var/tmp/hostembed_disk_table", help="where the table's files go")
    p.add_argument("--optimizers", default="sparse_adam,rowwise_adagrad")
    p.add_argument("--ids", default="zipf,uniform")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=os.path.join(run_folder(), "disk_table.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _bytes(text):
    from hostembed.nn.host_module import parse_bytes
    return parse_bytes(text, "size")


def _process_io():
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"]), int(fields["syscr"]), int(fields["syscw"])


def _peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def convert_worker(args, spec, hostembed):
    """A checkpoint of the table in memory with SparseAdam's state
    ("save", no limit), then loaded into a new table on disk ("convert",
    in the cgroup): the time and the memory it takes."""
    checkpoint = os.path.join(args.dir + "_checkpoint", "table.pt")
    t = time.perf_counter()
    if spec["where"] == "save":
        os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
        emb = hostembed.Embedding(args.rows, args.dim)
        opt = hostembed.SparseAdam(emb.parameters(), lr=1e-3)
        emb(torch.arange(args.rows)).sum().backward()  # every row's state written
        opt.step()
        hostembed.save(checkpoint, emb, opt)
    else:
        emb = hostembed.Embedding(args.rows, args.dim, storage=args.dir + "_converted", cache_rows=1024)
        opt = hostembed.SparseAdam(emb.parameters(), lr=1e-3)
        hostembed.load(checkpoint, emb, opt)
        emb.flush_cache()
    out = {**spec, "seconds": time.perf_counter() - t, "checkpoint_bytes": os.path.getsize(checkpoint),
           "peak_rss_bytes": _peak_rss()}
    print("RESULT " + json.dumps(out))


def worker(args, spec):
    """One run (a child process): prints its JSON."""
    hostembed = require_hostembed()
    hostembed.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    if spec["where"] in ("save", "convert"):
        return convert_worker(args, spec, hostembed)
    rows, dim, on_disk = args.rows, args.dim, spec["where"] == "disk"
    per_element_state = OPTIMIZERS[spec["optimizer"]]
    record = dim * 4 * (1 + per_element_state) + (4 if per_element_state == 0 else 0)
    opened = time.perf_counter()
    if on_disk:
        emb = hostembed.Embedding(rows, dim, storage=args.dir, cache_rows=max(1, _bytes(args.budget) // record))
    else:
        emb = hostembed.Embedding(rows, dim)
    opened = time.perf_counter() - opened
    if spec["optimizer"] == "sparse_adam":
        opt = hostembed.SparseAdam(emb.parameters(), lr=1e-3)
    else:
        opt = hostembed.RowWiseAdagrad(emb.parameters(), lr=0.01)
    rng = np.random.default_rng(1)
    zipf = ZipfIds(rows, args.alpha, rng) if spec["ids"] == "zipf" else None
    grad = torch.randn(args.batch, dim, generator=torch.Generator().manual_seed(0))

    def step():
        ids = zipf.draw(args.batch) if zipf is not None else torch.from_numpy(rng.integers(0, rows, args.batch))
        opt.zero_grad()
        emb(ids).backward(grad)
        opt.step()

    # Until the cache is full (it evicts), and a few steps more; the
    # in-memory table has nothing to fill.
    warmup = 0
    while warmup < args.warmup:
        step()
        warmup += 1
        if not on_disk and warmup >= 20:
            break
        if on_disk and emb.cache_stats["evictions"] > 0:
            for _ in range(20):
                step()
            warmup += 20
            break
    stats0 = dict(emb.cache_stats or {})
    io0 = _process_io()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    io1 = _process_io()
    stats1 = dict(emb.cache_stats or {})
    # The table's files while the optimizer lives: rows, state, records.
    disk_bytes = sum(os.stat(os.path.join(args.dir, name)).st_blocks * 512 for name in os.listdir(args.dir)) \
        if on_disk else 0
    flush = time.perf_counter()
    emb.flush_cache()
    flush = time.perf_counter() - flush
    out = {**spec, "open_s": opened, "warmup_steps": warmup, "ms_per_step": float(np.median(times)) * 1e3,
           "ms_steps": [t * 1e3 for t in times], "peak_rss_bytes": _peak_rss(), "flush_s": flush,
           "record_bytes": record, "disk_bytes": disk_bytes}
    if on_disk:
        delta = {k: stats1[k] - stats0[k] for k in ("rows", "hits", "fetches", "evictions", "bypassed")}
        out["cache_full"] = delta["evictions"] > 0
        steps = args.steps
        out.update({
            "cache_rows": emb.cache_rows, "hit_rate": delta["hits"] / max(delta["rows"], 1),
            "unique_rows_per_step": delta["rows"] / steps,
            "misses_per_step": (delta["fetches"] + delta["bypassed"]) / steps,
            "evicted_per_step": (delta["evictions"] + delta["bypassed"]) / steps,
            "disk_read_bytes_per_step": (io1[0] - io0[0]) / steps,
            "disk_written_bytes_per_step": (io1[1] - io0[1]) / steps,
            "min_read_bytes_per_step": (delta["fetches"] + delta["bypassed"]) * record / steps,
            "min_written_bytes_per_step": (delta["evictions"] + delta["bypassed"]) * record / steps,
            # Read and write requests (the process's system calls: pread,
            # pwrite) a missed and an evicted row.
            "reads_per_miss": (io1[2] - io0[2]) / max(delta["fetches"] + delta["bypassed"], 1),
            "writes_per_eviction": (io1[3] - io0[3]) / max(delta["evictions"] + delta["bypassed"], 1),
        })
    cgroup = os.environ.get("HOSTEMBED_BENCH_CGROUP")
    if cgroup:  # what the cgroup holds at the end: process memory against page cache
        with open(os.path.join(cgroup, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
        out["cgroup_end"] = {k: int(stat[k]) for k in ("rss", "cache", "mapped_file", "dirty", "writeback")}
    if on_disk:
        out["files"] = 1 + len([t for t in state_tensors_of(opt)])
    print("RESULT " + json.dumps(out))


def state_tensors_of(opt):
    """The optimizer's per-row state tensors (each its own file on disk)."""
    return [v for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] > 1]


def disk_rates(args, count=20_000, rounds=3):
    """The disk's random row rates through the table's own I/O (the core's
    threads; direct I/O where rows are whole sectors): reads and rewrites of
    `count` random rows of the weight file, medians of `rounds`. A step's
    floor is its row reads and writes at these rates."""
    from hostembed._core.table_files import RowFile
    weight = RowFile(os.path.join(args.dir, "weight.bin"), args.rows, args.dim, torch.float32, create=False)
    direct = weight.direct_fd is not None
    reads, writes = [], []
    gen = torch.Generator().manual_seed(5)
    for _ in range(rounds):
        rows = torch.randperm(args.rows, generator=gen)[:count]
        t = time.perf_counter()
        values = weight.read(rows)
        reads.append(count / (time.perf_counter() - t))
        t = time.perf_counter()
        weight.write(rows, values)
        writes.append(count / (time.perf_counter() - t))
    weight.close()
    return {"read_rows_per_s": float(np.median(reads)), "write_rows_per_s": float(np.median(writes)),
            "row_bytes": args.dim * 4, "direct_io": direct}


def _cgroup(limit):
    path = os.path.join(CGROUP_ROOT, "hostembed_disk_table")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    with open(os.path.join(path, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")
    return path


def _run(args, spec, cgroup):
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)] + sys.argv[1:]
    if cgroup is not None:
        with open(os.path.join(cgroup, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")  # this run's peak, not an earlier one's
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && HOSTEMBED_BENCH_CGROUP={cgroup} exec "$@"',
                   "sh"] + command
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"run {spec} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if cgroup is not None:
        with open(os.path.join(cgroup, "memory.max_usage_in_bytes")) as f:
            result["cgroup_peak_bytes"] = int(f.read())
    return result


def main():
    args = parse_args()
    if args.worker:
        return worker(args, json.loads(args.worker))
    hostembed = require_hostembed()
    limit = _bytes(args.limit)
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    t = time.perf_counter()
    emb = hostembed.Embedding(args.rows, args.dim, storage=args.dir, cache_rows=1)
    emb.flush_cache()
    made = time.perf_counter() - t
    del emb
    files_bytes = args.rows * args.dim * 4
    log(f"table files made in {made:.1f} s ({files_bytes / 2**30:.2f} GiB of rows)")
    rates = disk_rates(args)
    log(f"this disk, rows of {args.dim * 4} B at random: {rates['read_rows_per_s']:,.0f} reads/s, "
        f"{rates['write_rows_per_s']:,.0f} writes/s")
    cgroup = _cgroup(limit)
    results = []
    for optimizer in args.optimizers.split(","):
        for ids in args.ids.split(","):
            for where in ("disk", "memory"):
                spec = {"optimizer": optimizer, "ids": ids, "where": where}
                result = _run(args, spec, cgroup if where == "disk" else None)
                if where == "disk":
                    # Requests counted, not assumed (a row's files, or one
                    # record file): the disk is rate-bound at these sizes.
                    reads = result["misses_per_step"] * result["reads_per_miss"]
                    writes = result["evicted_per_step"] * result["writes_per_eviction"]
                    result["row_reads_per_step"], result["row_writes_per_step"] = reads, writes
                    result["io_floor_ms"] = 1e3 * (reads / rates["read_rows_per_s"]
                                                   + writes / rates["write_rows_per_s"])
                results.append(result)
                log(json.dumps({k: v for k, v in result.items() if k != "ms_steps"}))
    conversion = []
    if "sparse_adam" in args.optimizers.split(","):
        for where in ("save", "convert"):
            spec = {"optimizer": "sparse_adam", "where": where}
            conversion.append(_run(args, spec, cgroup if where == "convert" else None))
            log(json.dumps(conversion[-1]))
        shutil.rmtree(args.dir + "_checkpoint")
        shutil.rmtree(args.dir + "_converted")
    print()
    print(f"## table on disk: [{args.rows:,}, {args.dim}] float32, batches of {args.batch:,} ids, "
          f"cgroup limit {args.limit}, cache budget {args.budget}")
    print()
    print(f"Disk, rows of {rates['row_bytes']} B at random: {rates['read_rows_per_s']:,.0f} reads/s, "
          f"{rates['write_rows_per_s']:,.0f} writes/s. I/O floor: the step's read and write requests (counted: the process's system calls) at those rates.")
    print()
    print("| optimizer | ids | on disk ms | I/O floor ms | in memory ms | ratio | hit rate | misses/step | "
          "reads/miss | writes/evicted | requests/step (r + w) | disk read MiB/step (min) | written MiB/step (min) | peak cgroup / RSS MiB | "
          "on disk GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|")
    mib = 2**20
    for optimizer in args.optimizers.split(","):
        for ids in args.ids.split(","):
            disk = next(r for r in results if r["optimizer"] == optimizer and r["ids"] == ids and r["where"] == "disk")
            memory = next(r for r in results if r["optimizer"] == optimizer and r["ids"] == ids
                          and r["where"] == "memory")
            print(f"| {optimizer} | {ids} | {disk['ms_per_step']:.1f} | {disk['io_floor_ms']:.1f} | "
                  f"{memory['ms_per_step']:.1f} | "
                  f"{disk['ms_per_step'] / memory['ms_per_step']:.1f}x | {disk['hit_rate']:.1%} | "
                  f"{disk['misses_per_step']:,.0f} | "
                  f"{disk['reads_per_miss']:.2f} | {disk['writes_per_eviction']:.2f} | "
                  f"{disk['row_reads_per_step']:,.0f} + {disk['row_writes_per_step']:,.0f} | "
                  f"{disk['disk_read_bytes_per_step'] / mib:.1f} "
                  f"({disk['min_read_bytes_per_step'] / mib:.1f}) | {disk['disk_written_bytes_per_step'] / mib:.1f} "
                  f"({disk['min_written_bytes_per_step'] / mib:.1f}) | {disk['cgroup_peak_bytes'] / mib:.0f} / "
                  f"{disk['peak_rss_bytes'] / mib:.0f} | {disk['disk_bytes'] / 2**30:.1f} |")
    if conversion:
        save, convert = conversion
        print()
        print(f"A checkpoint of the table in memory with SparseAdam's state ({save['checkpoint_bytes'] / 2**30:.2f} "
              f"GiB, hostembed.save: {save['seconds']:.1f} s) loaded into a new table on disk in the cgroup: "
              f"{convert['seconds']:.1f} s, peak cgroup {convert['cgroup_peak_bytes'] / mib:.0f} MiB "
              f"(RSS {convert['peak_rss_bytes'] / mib:.0f} MiB)")
    write_json(args.json, {"machine": machine_info(threads=args.threads), "args": vars(args),
                           "files_made_s": made, "disk": rates, "results": results, "conversion": conversion})
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
