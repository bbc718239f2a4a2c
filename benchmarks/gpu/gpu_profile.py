"""Where a GPU training step's time goes: torch.profiler over a few steps of
the reference stream (D=128, PowerLaw(1.05) lookups, SparseAdam) for each
set-up, printed as the top operators and kernels by self CPU time and by
self CUDA time, with forward / backward / step() marked.

Set-ups, in this order (the fused ones last: once made, the fused
optimizer updates the table in backward): no cache with the update on the
GPU, on the CPU; fused (in backward); the row cache (fused) at 100% and
20% of the touched rows. With --optimizer rowwise_adagrad (which has no
GPU update: its gradients are summed on the GPU and copied to the host,
and a row cache's records move to host memory), the set-ups fused and
cache only.

Usage (on a machine with a GPU):
    python benchmarks/gpu/gpu_profile.py [--rows 20000000 --batch 1048570 --steps 4]
"""
import argparse
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import ZipfIds, log, require_hostembed  # noqa: E402

hostembed = require_hostembed()
from hostembed.nn.host_module import UNINITIALISED  # noqa: E402  (after the build check above)

SETUPS = ("gpu", "cpu", "fused", "cache 1.0", "cache 0.2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--batch", type=int, default=1_048_570)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--stream", type=int, default=6, help="distinct batches, replayed")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="profiled steps per set-up")
    p.add_argument("--top", type=int, default=14, help="rows of each table")
    p.add_argument("--setups", default=None, help=f"default: {','.join(SETUPS)} (rowwise_adagrad: fused and caches)")
    p.add_argument("--prefetch", action="store_true", help="with a cache, plan each batch a step ahead")
    p.add_argument("--optimizer", choices=("sparse_adam", "rowwise_adagrad"), default="sparse_adam")
    args = p.parse_args(argv)
    if args.setups is None:
        args.setups = ",".join(SETUPS if args.optimizer == "sparse_adam" else SETUPS[2:])
    if args.optimizer == "rowwise_adagrad" and {"gpu", "cpu"} & set(args.setups.split(",")):
        p.error("--optimizer rowwise_adagrad: set-ups fused and cache ... only (it has no GPU update to choose)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not hostembed.cuda_available():
        from hostembed._core.cuda import unavailable_reason
        sys.exit(f"benchmarks/gpu/gpu_profile.py: the GPU path cannot run here: {unavailable_reason()}")
    device = torch.device("cuda")
    draw = ZipfIds(args.rows, args.alpha, np.random.default_rng(0))
    batches = [draw.draw(args.batch).to(device) for _ in range(args.stream)]
    touched = int(torch.unique(torch.cat(batches)).numel())
    grad_out = torch.randn(args.batch, args.dim, device=device)
    emb = hostembed.Embedding(args.rows, args.dim, device=device, _weight=UNINITIALISED)
    unfused = hostembed.SparseAdam(emb.parameters(), lr=1e-3) if args.optimizer == "sparse_adam" else None
    fused = None  # made at its first use: from then on it updates the table in backward
    for setup in args.setups.split(","):
        if setup in ("gpu", "cpu"):
            opt = unfused
            opt.update = setup
        else:
            if fused is None and unfused is None:
                fused = hostembed.RowWiseAdagrad(emb.parameters(), lr=1e-3, eps=1e-8, fused=True)
            elif fused is None:
                fused = hostembed.SparseAdam(emb.parameters(), lr=1e-3, update="gpu", fused=True)
                fused.state = unfused.state  # one set of moments: a second would pin another 2 x table
            opt = fused
        emb.cache_rows = max(1, int(float(setup.split()[1]) * touched)) if setup.startswith("cache") else None

        def step(i, marks=False):
            ids = batches[i % len(batches)]
            with record_function("## forward") if marks else nullcontext():
                out = emb(ids)
            with record_function("## backward") if marks else nullcontext():
                out.backward(grad_out)
            if args.prefetch and emb.cache_rows:
                with record_function("## prefetch") if marks else nullcontext():
                    emb.prefetch(batches[(i + 1) % len(batches)])
            with record_function("## step") if marks else nullcontext():
                opt.step()
                opt.zero_grad()

        for i in range(args.warmup):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.warmup, args.warmup + args.steps):
                step(i, marks=True)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        where = getattr(opt, "_last_update", None)
        print(f"\n## {setup} ({args.optimizer}): {args.steps} steps, {args.rows:,} rows, {args.batch:,} lookups"
              + (f", last update on the {where}" if where else "") + "\n")
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(averages.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
        log(f"profiled {setup}")


if __name__ == "__main__":
    main()
