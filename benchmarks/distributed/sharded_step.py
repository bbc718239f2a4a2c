"""One table over 1, 2 and 4 processes on gloo, sharded
(hostembed.distributed.ShardedEmbedding: each process holds its rows, ids
and rows travel) and shared (SharedEmbedding: one copy in the host's
memory, every process reads it, gradient rows travel to the rows' updater),
against one process with a plain hostembed.Embedding, on the same global
workload: a --rows x --dim table,
--batch Zipf(--alpha) ids a step in all (each of P processes looks up its
1/P of them), SparseAdam or row-wise Adagrad (--optimizer).

Reported per process count: ms/step (median of the timed steps, as rank 0
sees them; every step is collective, so the ranks move together), the bytes
a step sends between processes (ids to their owners, rows back, gradient
rows to the owners; each rank sends each distinct id once, which is the
least any row-sharded lookup sends), and the peak RSS of all the processes
together against one table with its optimizer state. Threads: the machine's CPUs
split between the processes. The figures also go as result rows
(benchmarks/_rows.py's schema; sharded_rows below) to rows.jsonl beside
the JSON.

    python benchmarks/distributed/sharded_step.py [--procs 1,2,4 --rows 2000000 --batch 65536]
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (GIB, run_folder, OtherLoad, _vm_hwm_bytes, add_sharded_workload_args,  # noqa: E402
                     fmt_gib, log, machine_info, make_row, require_hostembed, run_context, sharded_global_batches,
                     summarize_ms, summary_figures, figure_rows, usable_cpus, write_json, write_rows)

hostembed = require_hostembed()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sharded_workload_args(p)
    p.add_argument("--optimizer", choices=("SparseAdam", "RowWiseAdagrad"), default="SparseAdam")
    p.add_argument("--json", default=os.path.join(run_folder(), "sharded_step.json"))
    args = p.parse_args(argv)
    args.procs = [int(x) for x in args.procs.split(",") if x]
    if min(args.procs + [args.rows, args.dim, args.batch, args.batches, args.steps]) < 1 or args.warmup < 0:
        p.error("sizes and counts must be >= 1")
    return args


def bytes_sent(batch, procs, rows, dim, kind):
    """Bytes one step sends between processes, from each rank's distinct ids
    whose rows another rank holds (sharded) or updates (shared): sharded,
    the id out (8 bytes), its row back and its gradient row out; shared,
    only the gradient row and its index."""
    bounds = torch.tensor([rows * r // procs for r in range(procs + 1)])
    per_id = 8 + (2 if kind == "sharded" else 1) * dim * 4
    total = 0
    for rank, part in enumerate(batch.tensor_split(procs)):
        owner = torch.bucketize(torch.unique(part), bounds[1:], right=True)
        total += int((owner != rank).sum()) * per_id
    return total


def pss_bytes():
    """This process's proportional set size: shared pages count 1/N in each
    of the N processes that map them, so the sum over processes counts a
    shared table once."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_main(rank, procs, args, kind, path, out_path):
    threads = max(1, usable_cpus() // procs)
    torch.set_num_threads(threads)
    hostembed.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=procs,
                            timeout=datetime.timedelta(seconds=300))
    import hostembed.distributed as hd

    batches = [b.tensor_split(procs)[rank] for b in sharded_global_batches(args)]
    emb = (hd.SharedEmbedding if kind == "shared" else hd.ShardedEmbedding)(args.rows, args.dim)
    opt = getattr(hostembed, args.optimizer)(emb.parameters(), lr=1e-3)
    grads = [torch.randn(b.numel(), args.dim, generator=torch.Generator().manual_seed(rank)) for b in batches]
    seconds = []
    for i in range(args.warmup + args.steps):
        k = i % len(batches)
        t0 = time.perf_counter()
        emb(batches[k]).backward(grads[k])
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
    memory = torch.tensor([_vm_hwm_bytes() or 0, pss_bytes()], dtype=torch.int64)
    dist.all_reduce(memory, group=dist.group.WORLD)
    if rank == 0:
        torch.save({"seconds": seconds, "rss_bytes": int(memory[0]), "pss_bytes": int(memory[1]),
                    "threads": threads}, out_path)
    dist.barrier()  # every rank's collectives done
    # Out at once, without tearing the group down: on torch 2.13 a gloo
    # group's teardown aborts a process now and then ("terminate called
    # without an active exception"), after its work is done.
    os._exit(0)


def run_procs(procs, args, kind):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        mp.start_processes(rank_main, args=(procs, args, kind, os.path.join(tmp, "rendezvous"), out_path),
                           nprocs=procs, start_method="spawn")
        return torch.load(out_path)


def plain_baseline(args):
    """One process, a plain hostembed.Embedding, every id of the step."""
    emb = hostembed.Embedding(args.rows, args.dim)
    opt = getattr(hostembed, args.optimizer)(emb.parameters(), lr=1e-3)
    batches = sharded_global_batches(args)
    grad = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
    seconds = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        emb(batches[i % len(batches)]).backward(grad)
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
    return summarize_ms(seconds)


# The contenders, as the rows name them: the report's keys -> names.
CONTENDERS = {"plain": "plain hostembed.Embedding", "sharded": "hostembed.distributed.ShardedEmbedding",
              "shared": "hostembed.distributed.SharedEmbedding"}
WORKLOAD = ("rows", "dim", "batch", "alpha", "batches", "warmup", "steps", "optimizer")


def _spread(ctx, workload, contender, summary):
    return figure_rows(ctx, workload, contender, summary_figures("step_time", summary))


def sharded_rows(ctx, report):
    """The run's figures as result rows: per contender and process count
    (workload "procs", "threads" a process) the step time (spread), and for
    the sharded and shared tables the bytes sent a step, the peak RSS and
    the PSS of all processes together; the table's size with its state, and
    the other processes' share of the CPUs."""
    base = {k: report["args"][k] for k in WORKLOAD}
    plain = dict(base, procs=1, threads=report["machine"]["usable_cpus"])
    rows = _spread(ctx, plain, CONTENDERS["plain"], report["plain"])
    rows.append(make_row(ctx, plain, CONTENDERS["plain"], "table_and_state_size", report["table_and_state_bytes"],
                         "bytes"))
    for kind in ("sharded", "shared"):
        for procs, r in report[kind].items():
            workload = dict(base, procs=int(procs), threads=r["threads_per_process"])
            rows += _spread(ctx, workload, CONTENDERS[kind], r)
            rows += [make_row(ctx, workload, CONTENDERS[kind], metric, r[key], unit) for metric, key, unit in (
                ("bytes_sent", "bytes_sent_per_step", "bytes/step"),
                ("peak_rss_all_processes", "rss_bytes_all", "bytes"), ("pss_all_processes", "pss_bytes_all", "bytes"))]
    others = report["other_load"]["cpu_fraction_used_by_others"]
    if others is not None:
        rows.append(make_row(ctx, base, "the whole run", "cpu_used_by_others", others, "fraction"))
    return rows


def main(argv=None):
    args = parse_args(argv)
    other = OtherLoad()
    state = 2 * args.rows * args.dim * 4 if args.optimizer == "SparseAdam" else args.rows * 4
    table_and_state = args.rows * args.dim * 4 + state
    batches = sharded_global_batches(args)
    report = {"args": vars(args), "machine": machine_info(), "table_and_state_bytes": table_and_state,
              "sharded": {}, "shared": {}}
    log("one process, plain hostembed.Embedding")
    report["plain"] = plain_baseline(args)
    for procs in args.procs:
        for kind in ("sharded", "shared"):
            log(f"{procs} process(es), {kind}")
            result = run_procs(procs, args, kind)
            sent = statistics.mean(bytes_sent(b, procs, args.rows, args.dim, kind) for b in batches)
            report[kind][procs] = {**summarize_ms(result["seconds"]), "bytes_sent_per_step": sent,
                                   "rss_bytes_all": result["rss_bytes"], "pss_bytes_all": result["pss_bytes"],
                                   "threads_per_process": result["threads"]}
    report["other_load"] = {"cpu_fraction_used_by_others": other.fraction()}
    write_json(args.json, report)
    rows_path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                           sharded_rows(run_context("sharded_step", info=report["machine"]), report))
    print(f"\nOne table, {args.rows:,} x {args.dim} float32 ({fmt_gib(table_and_state)} with its state), "
          f"{args.batch:,} Zipf({args.alpha}) ids a step in all, {args.optimizer}, gloo, {usable_cpus()} CPUs; "
          f"other load {report['other_load']['cpu_fraction_used_by_others']:.0%}\n")
    print("| processes | table | threads each | ms/step | MB sent a step | peak RSS, all processes | PSS, all |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    print(f"| 1 | plain hostembed.Embedding | {usable_cpus()} | {report['plain']['median_ms']:.1f} | 0 | | |")
    for procs in args.procs:
        for kind in ("sharded", "shared"):
            r = report[kind][procs]
            print(f"| {procs} | {kind} | {r['threads_per_process']} | {r['median_ms']:.1f} "
                  f"| {r['bytes_sent_per_step'] / 1e6:.1f} | {r['rss_bytes_all'] / GIB:.2f} GiB "
                  f"| {r['pss_bytes_all'] / GIB:.2f} GiB |")
    print(f"\nJSON: {args.json}\nRows: {rows_path}")


if __name__ == "__main__":
    main()
