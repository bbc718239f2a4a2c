"""TorchRec's row-wise-sharded embedding on the CPU with gloo: a
benchmark-only peer to benchmarks/distributed/sharded_step.py (TorchRec is not a
dependency of hostembed; this script is the only place it is used).

The same global workload as sharded_step.py: one --rows x --dim float32
table, --batch Zipf(--alpha) ids a step in all (the same draws, cycled over
--batches), each of P processes looking up its 1/P of them. Here the table is
a TorchRec EmbeddingBagCollection (one table, one feature, pooling SUM, every
id its own bag of 1 in a KeyedJaggedTensor) sharded ROW_WISE by
DistributedModelParallel over a gloo group, FUSED compute kernel (FBGEMM's
CPU table-batched embedding) with its fused row-wise Adagrad (lr 1e-3), which
updates the rows inside backward. A step: forward of the rank's KJT, backward
of a fixed random gradient of the pooled rows (as sharded_step.py's). Timed on rank 0 with
time.perf_counter (every step is collective), median of --steps after
--warmup; peak RSS (VmHWM) summed over the processes; the machine's CPUs split
between the processes.

TorchRec on the CPU needs two overrides, both made here: its sharders offer
ROW_WISE only for CUDA (BaseEmbeddingSharder.sharding_types), so the sharder
below adds it back for "cpu"; and the plan is constrained to ROW_WISE and
FUSED. On the CPU, FUSED supports EXACT_SGD, EXACT_ADAGRAD and
EXACT_ROWWISE_ADAGRAD only (no Adam), so compare with
`sharded_step.py --optimizer RowWiseAdagrad`.

Before timing, a 1,000 x 8 table on 2 processes takes one step and every
rank checks its shard against row-wise Adagrad computed by hand: the rows the
step looked up moved as expected, and no other row moved (--skip-check skips).

Run with (measured 2026-11-26 on a 2-vCPU VM): Python 3.11.7, torch
2.13.0+cpu, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0, tensordict 0.15.3,
torchmetrics 1.0.3, pyre-extensions 0.0.32, iopath 0.1.10. Install recipe (a
virtualenv of its own that reuses the system torch and fbgemm-gpu-cpu):

    python3 -m venv --system-site-packages /tmp/trvenv
    /tmp/trvenv/bin/pip install --no-deps torchrec==1.8.0   # its metadata asks for the CUDA fbgemm-gpu
    /tmp/trvenv/bin/pip install tensordict torchmetrics==1.0.3 pyre-extensions iopath
    /tmp/trvenv/bin/python -c "import torch, torchrec, fbgemm_gpu; print(torch.__version__, torchrec.__version__)"

(the second install pulls no torch: check with --dry-run), then

    /tmp/trvenv/bin/python benchmarks/distributed/torchrec_sharded_step.py [--procs 1,2,4 --rows 2000000 --batch 65536]

The figures also go as result rows (benchmarks/_rows.py's schema;
torchrec_rows below) to rows.jsonl beside the JSON, with the workload fields
of sharded_step.py's rows (optimizer "RowWiseAdagrad"), so that one table
shows both.
"""
import argparse
import datetime
import importlib.metadata
import logging
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (GIB, run_folder, OtherLoad, _cpu_model, _git_commit, _vm_hwm_bytes,  # noqa: E402
                     add_sharded_workload_args, fmt_gib, gpu_info, log, machine_info, make_row, run_context,
                     sharded_global_batches, summarize_ms, summary_figures, figure_rows, usable_cpus, write_json,
                     write_rows, zipf_batches)

LR = 1e-3
EPS = 1e-8  # FBGEMM's default for row-wise Adagrad


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sharded_workload_args(p)
    p.add_argument("--skip-check", action="store_true", help="skip the one-step check on a tiny table")
    p.add_argument("--json", default=os.path.join(run_folder(), "torchrec_sharded_step.json"))
    args = p.parse_args(argv)
    args.procs = [int(x) for x in args.procs.split(",") if x]
    if min(args.procs + [args.rows, args.dim, args.batch, args.batches, args.steps]) < 1 or args.warmup < 0:
        p.error("sizes and counts must be >= 1")
    if any(args.batch % procs for procs in args.procs):
        p.error("--batch must divide by every process count (TorchRec's row-wise reduce-scatter wants "
                "the same batch on every rank)")
    return args


def versions():
    out = {}
    for name in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "tensordict", "torchmetrics", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def build_model(rows, dim, procs):
    """DistributedModelParallel of a one-table EmbeddingBagCollection,
    sharded ROW_WISE over the default group, FUSED row-wise Adagrad."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType

    class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
        """TorchRec offers ROW_WISE for CUDA devices only; its CPU kernels run it."""

        def sharding_types(self, compute_device_type):
            types = super().sharding_types(compute_device_type)
            if ShardingType.ROW_WISE.value not in types:
                types.append(ShardingType.ROW_WISE.value)
            return types

    sharder = CpuRowWiseSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                              "learning_rate": LR, "eps": EPS})
    # Built on "meta": each rank then allocates only its own shard.
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=dim, num_embeddings=rows, feature_names=["f0"],
                                   pooling=PoolingType.SUM)],
        device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=procs, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value],
                                                compute_kernels=[EmbeddingComputeKernel.FUSED.value])})
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(ebc, [sharder], pg)
    model = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                     plan=plan, sharders=[sharder])
    return model, plan


def make_kjt(ids):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids,
                                               lengths=torch.ones(ids.numel(), dtype=torch.int32))


def local_shard(model):
    """(first global row, the rank's rows) of the table's shard: a view of the live weights."""
    (_, weight), = [(k, v) for k, v in model.state_dict().items() if k.endswith("t0.weight")]
    shard, = weight.local_shards()
    return shard.metadata.shard_offsets[0], shard.tensor


def check_one_step(rank, procs):
    """One step on a 1,000 x 8 table: the rank's rows against row-wise
    Adagrad by hand on every rank's ids and gradients. Raises on a mismatch."""
    rows, dim, batch = 1000, 8, 512
    model, _ = build_model(rows, dim, procs)
    ids = zipf_batches(rows, batch, 1.05, 1, seed=1)[0]
    parts = ids.tensor_split(procs)
    grads = [torch.randn(p.numel(), dim, generator=torch.Generator().manual_seed(100 + r)) for r, p in enumerate(parts)]
    start, weight = local_shard(model)
    before = weight.detach().clone()
    model(make_kjt(parts[rank])).values().backward(grads[rank])
    after = weight.detach().clone()

    grad_rows = torch.zeros(rows, dim, dtype=torch.float64)
    grad_rows.index_add_(0, ids, torch.cat(grads).double())
    mine = slice(start, start + before.shape[0])
    g = grad_rows[mine]
    expected = before.double() - LR * g / ((g * g).mean(1, keepdim=True).sqrt() + EPS)
    looked_up = torch.zeros(rows, dtype=torch.bool)
    looked_up[ids] = True
    looked_up = looked_up[mine]
    moved = (after != before).any(1)
    if bool((moved & ~looked_up).any()):
        raise AssertionError(f"rank {rank}: rows not looked up moved: {(moved & ~looked_up).nonzero().flatten()[:10]}")
    if not bool(moved[looked_up].all()):
        raise AssertionError(f"rank {rank}: looked-up rows did not move")
    err = (after.double() - expected).abs().max().item()
    if err > 1e-6:
        raise AssertionError(f"rank {rank}: weights differ from row-wise Adagrad by hand by {err:.3g}")
    return {"rows_in_shard": int(before.shape[0]), "rows_looked_up": int(looked_up.sum()),
            "rows_moved": int(moved.sum()), "max_abs_err": err}


def rank_main(rank, procs, args, path, out_path, check):
    # TorchRec's planner and torch's collectives warn at length about things that do not apply here.
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    threads = max(1, usable_cpus() // procs)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=procs,
                            timeout=datetime.timedelta(seconds=300))
    if check:
        result = check_one_step(rank, procs)
        results = [None] * procs
        dist.all_gather_object(results, result)
        if rank == 0:
            torch.save({"check": results}, out_path)
        dist.barrier()  # as below
        os._exit(0)

    batches = [make_kjt(b.tensor_split(procs)[rank]) for b in sharded_global_batches(args)]
    model, plan = build_model(args.rows, args.dim, procs)
    grads = [torch.randn(b.values().numel(), args.dim, generator=torch.Generator().manual_seed(rank))
             for b in batches]
    seconds = []
    for i in range(args.warmup + args.steps):
        k = i % len(batches)
        t0 = time.perf_counter()
        model(batches[k]).values().backward(grads[k])
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
    rss = torch.tensor([_vm_hwm_bytes() or 0], dtype=torch.int64)
    dist.all_reduce(rss, group=dist.group.WORLD)
    if rank == 0:
        torch.save({"seconds": seconds, "rss_bytes": int(rss), "threads": threads, "plan": str(plan)}, out_path)
    dist.barrier()  # every rank's collectives done
    # Out at once, without tearing the group down: on torch 2.13 a gloo
    # group's teardown aborts a process now and then ("terminate called
    # without an active exception"), after its work is done.
    os._exit(0)


def run_procs(procs, args, check=False):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        mp.start_processes(rank_main, args=(procs, args, os.path.join(tmp, "rendezvous"), out_path, check),
                           nprocs=procs, start_method="spawn")
        return torch.load(out_path)


CONTENDER = "TorchRec EmbeddingBagCollection, ROW_WISE (FBGEMM fused row-wise Adagrad)"
WORKLOAD = ("rows", "dim", "batch", "alpha", "batches", "warmup", "steps")


def run_machine():
    """machine_info(), or what of it this virtualenv can say without hostembed."""
    try:
        return machine_info()
    except ImportError:
        return {"cpu_model": _cpu_model(), "usable_cpus": usable_cpus(), "gpu": gpu_info(),
                "torch": torch.__version__, "git": _git_commit()}


def torchrec_rows(ctx, report):
    """The run's figures as result rows: per process count (workload "procs",
    "threads" a process, and sharded_step.py's fields) the step time
    (spread) and the peak RSS of all processes together; the check's largest
    error against row-wise Adagrad by hand; the other processes' share of
    the CPUs."""
    base = dict({k: report["args"][k] for k in WORKLOAD}, optimizer="RowWiseAdagrad",
                torchrec=report["versions"].get("torchrec"))
    rows = []
    for procs, r in report["procs"].items():
        workload = dict(base, procs=int(procs), threads=r["threads_per_process"])
        rows += figure_rows(ctx, workload, CONTENDER, summary_figures("step_time", r))
        rows.append(make_row(ctx, workload, CONTENDER, "peak_rss_all_processes", r["rss_bytes_all"], "bytes"))
    if report.get("check"):
        check = {"rows": 1000, "dim": 8, "batch": 512, "procs": len(report["check"]), "torchrec": base["torchrec"]}
        rows.append(make_row(ctx, check, CONTENDER, "check_max_abs_error",
                             max(r["max_abs_err"] for r in report["check"]), "weight"))
    others = report["other_load"]["cpu_fraction_used_by_others"]
    if others is not None:
        rows.append(make_row(ctx, base, "the whole run", "cpu_used_by_others", others, "fraction"))
    return rows


def main(argv=None):
    args = parse_args(argv)
    other = OtherLoad()
    table_and_state = args.rows * args.dim * 4 + args.rows * 4  # row-wise Adagrad: one float a row
    report = {"args": vars(args), "versions": versions(), "usable_cpus": usable_cpus(),
              "table_and_state_bytes": table_and_state, "optimizer": "EXACT_ROWWISE_ADAGRAD (fused), lr 1e-3",
              "sharding": "ROW_WISE, FUSED kernel, DistributedModelParallel, gloo", "procs": {}}
    if not args.skip_check:
        log("check: one step of a 1,000 x 8 table on 2 processes against row-wise Adagrad by hand")
        report["check"] = run_procs(2, args, check=True)["check"]
        log(f"check passed: {report['check']}")
    for procs in args.procs:
        log(f"{procs} process(es), TorchRec ROW_WISE")
        result = run_procs(procs, args)
        report["procs"][procs] = {**summarize_ms(result["seconds"]), "rss_bytes_all": result["rss_bytes"],
                                  "threads_per_process": result["threads"]}
        report["plan"] = result["plan"]
    report["other_load"] = {"cpu_fraction_used_by_others": other.fraction(), "loadavg_before": other.loadavg_before}
    report["machine"] = run_machine()
    write_json(args.json, report)
    rows_path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                           torchrec_rows(run_context("torchrec_sharded_step", info=report["machine"]), report))
    v = report["versions"]
    print(f"\nTorchRec {v.get('torchrec')} ROW_WISE (FUSED, row-wise Adagrad), {args.rows:,} x {args.dim} float32 "
          f"({fmt_gib(table_and_state)} with its state), {args.batch:,} Zipf({args.alpha}) ids a step in all, "
          f"bags of 1, gloo, torch {v.get('torch')}, {usable_cpus()} CPUs; "
          f"other load {report['other_load']['cpu_fraction_used_by_others']:.0%}\n")
    print("| processes | threads each | ms/step | peak RSS, all processes |")
    print("|---:|---:|---:|---:|")
    for procs, r in report["procs"].items():
        print(f"| {procs} | {r['threads_per_process']} | {r['median_ms']:.1f} | {r['rss_bytes_all'] / GIB:.2f} GiB |")
    print(f"\nJSON: {args.json}\nRows: {rows_path}")


if __name__ == "__main__":
    main()
