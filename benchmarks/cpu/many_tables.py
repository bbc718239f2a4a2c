"""Many small lookups a step: the 26 tables of DLRM's Criteo Kaggle
configuration, one module a table, as DLRM's script (EmbeddingBag, bags of
1) and pytorch-fm or DeepCTR (Embedding, one a field) build them; a plain
training step (the lookups, a linear layer on their sum, BCE, the
optimizer) of torch's modules against the same model after
hostembed.replace_embeddings, with torch's optimizer (the plain swap).

Each batch size times both contenders in rounds of --steps steps, the
order alternating; the figure is the median round. Both start from the same
weights and train on the same batches; their first losses are checked equal
before anything is timed. The figures go to --json and, as result rows,
to rows.jsonl beside it.

    python benchmarks/cpu/many_tables.py [--batches 128,2048 --optimizer sgd --modules embedding,bag]
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (run_folder, OtherLoad, fail, log, machine_info, make_row, require_hostembed,  # noqa: E402
                     run_context, spread_rows, usable_cpus, write_json, write_rows)

hostembed = require_hostembed()

CONTENDERS = {"torch": "torch's modules", "hostembed": "hostembed (plain swap)"}  # the JSON's key: the rows' name
CRITEO_KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


class Model(torch.nn.Module):
    def __init__(self, rows, dim, bag):
        super().__init__()
        self.bag = bag
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True) if bag else torch.nn.Embedding(n, dim, sparse=True)
            for n in rows)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x, offsets):
        if self.bag:  # DLRM's call: flat ids and offsets, a bag of one id a sample
            pooled = [t(x[:, i].contiguous(), offsets) for i, t in enumerate(self.tables)]
        else:
            pooled = [t(x[:, i]) for i, t in enumerate(self.tables)]
        return self.out(torch.stack(pooled).sum(0)).squeeze(1)


def optimizer(name, params):
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.01),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=0.01)}[name]()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="128,2048")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--modules", default="embedding,bag", help="embedding: one nn.Embedding a field; bag: one "
                   "nn.EmbeddingBag a table, bags of 1")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad"))
    p.add_argument("--steps", type=int, default=20, help="steps a round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--scale", type=int, default=1, help="divide every table's rows by this (smaller machines)")
    p.add_argument("--threads", type=int, default=usable_cpus())
    p.add_argument("--json", default=os.path.join(run_folder(), "many_tables.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    rows = [max(1, n // args.scale) for n in CRITEO_KAGGLE]
    load = OtherLoad()
    results, out = {}, []
    ctx = run_context("many_tables")
    for kind in args.modules.split(","):
        bag = kind == "bag"
        torch.manual_seed(0)
        ref = Model(rows, args.dim, bag)
        ours = copy.deepcopy(ref)
        hostembed.replace_embeddings(ours)
        models = {"torch": ref, "hostembed": ours}
        opts = {name: optimizer(args.optimizer, m.parameters()) for name, m in models.items()}
        g = torch.Generator().manual_seed(1)
        data = {}
        for batch in (int(b) for b in args.batches.split(",")):
            data[batch] = ([torch.stack([torch.randint(0, n, (batch,), generator=g) for n in rows], 1)
                            for _ in range(args.steps)],
                           [torch.randint(0, 2, (batch,), generator=g).float() for _ in range(args.steps)])
            # Before any step: training moves the two apart by float32 rounding (their sums' orders differ).
            with torch.no_grad():
                if not torch.equal(ref(data[batch][0][0], torch.arange(batch)),
                                   ours(data[batch][0][0], torch.arange(batch))):
                    fail(f"{kind}, batch {batch}: hostembed's outputs differ from torch's")
        for batch, (xs, ys) in data.items():
            offsets = torch.arange(batch)
            times = {name: [] for name in models}
            for r in range(-1, args.rounds):  # round -1: warm-up, not timed
                for name in (models if r % 2 == 0 else list(models)[::-1]):
                    m, opt = models[name], opts[name]
                    t0 = time.perf_counter()
                    for x, y in zip(xs, ys):
                        F.binary_cross_entropy_with_logits(m(x, offsets), y).backward()
                        opt.step()
                        opt.zero_grad()
                    if r >= 0:
                        times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            results[f"{kind} {batch}"] = {name: statistics.median(t) for name, t in times.items()}
            out += result_rows(ctx, args, kind, batch, times)
            log(f"{kind}, batch {batch}: {results[f'{kind} {batch}']}")
        del ref, ours, models, opts
    other = load.fraction()
    print(f"\n26 tables (Criteo Kaggle rows{'' if args.scale == 1 else f' / {args.scale}'}, D={args.dim}), "
          f"torch.optim.{'SGD' if args.optimizer == 'sgd' else 'Adagrad'}, {args.threads} threads, ms/step "
          f"(median of {args.rounds} rounds of {args.steps}); other load {'n/a' if other is None else f'{other:.0%}'}\n")
    print("| modules, batch | torch | hostembed (plain swap) | speed-up |")
    print("|---|---:|---:|---:|")
    for key, r in results.items():
        print(f"| {key} | {r['torch']:.2f} | {r['hostembed']:.2f} | {r['torch'] / r['hostembed']:.2f}x |")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "other_load": other,
                           "ms_per_step": results})
    if other is not None:
        out.append(make_row(ctx, {"optimizer": args.optimizer, "threads": args.threads}, "other processes",
                            "other_load", other, "fraction"))
    path = write_rows(os.path.dirname(os.path.abspath(args.json)), out)
    log(f"wrote {args.json} and {path}")


def result_rows(ctx, args, kind, batch, times):
    """One workload's figures as result rows (benchmarks/_common.py's
    schema): ms/step (median, min and max of the rounds), the swap's speed."""
    workload = {"modules": kind, "batch": batch, "optimizer": args.optimizer, "dim": args.dim,
                "tables": len(CRITEO_KAGGLE), "scale": args.scale, "steps": args.steps, "rounds": args.rounds,
                "threads": args.threads}
    rows = [row for key, name in CONTENDERS.items() for row in spread_rows(ctx, workload, name, "step_time",
                                                                           times[key], "ms")]
    speed = statistics.median(times["torch"]) / statistics.median(times["hostembed"])
    return rows + [make_row(ctx, workload, CONTENDERS["hostembed"], "speed_vs_torch", speed, "x")]


if __name__ == "__main__":
    main()
