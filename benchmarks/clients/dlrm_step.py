"""The embedding part of a DLRM-style step: four EmbeddingBag tables (2M,
1M, 500K and 100K rows x 64, sum mode), bags of 4 ids, with the optimizers
such models use (SGD, Adagrad, row-wise Adagrad), torch against hostembed,
on uniform and on Zipf ids, at several batch sizes.

One step: the tables' forward, backward of a fixed output gradient,
optimizer.step(), zero_grad(). A round times a few steps back to back, as
training runs them (4,096 / bags of them, at least one, each on a batch
of its own: 32 at 128 bags), so that a small step is not timed cold right
after another contender's. Contenders, built from the same weights and
timed in alternating rounds:
  torch         nn.EmbeddingBag(sparse=True) modules + torch.optim.<opt>
                (torch has no row-wise Adagrad: its Adagrad stands in)
  swap          hostembed.EmbeddingBag modules + torch.optim.<opt> (the
                plain swap; not run for RowWiseAdagrad)
  hostembed     hostembed.EmbeddingBag modules, one call each, +
                hostembed.<opt>
  collection    hostembed.EmbeddingBagCollection (one call for the four
                tables) + hostembed.<opt>
  fused         the collection + hostembed.<opt>(fused=True)
Before timing, every contender's weights after the warm-up steps are
checked against torch's (within 1e-4 of the table's largest weight: float
rounding of the sums of a hot row's thousands of gradient rows, which
torch adds in another order), and for row-wise Adagrad against the
hostembed contender's.

The JSON (--json) holds the medians and every round's time; the figures
also go as result rows (result_rows) to rows.jsonl beside it, which
docs/results.md's table is rendered from.

    python benchmarks/clients/dlrm_step.py
    python benchmarks/clients/dlrm_step.py --bags 128,2048 --optimizers SGD --ids uniform
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import run_folder, OtherLoad, fail, log, machine_info, make_row, require_hostembed  # noqa: E402
from _common import run_context, spread_rows, usable_cpus, write_json, write_rows  # noqa: E402

hostembed = require_hostembed()

ROWS = (2_000_000, 1_000_000, 500_000, 100_000)
DIM, BAG = 64, 4
LR = {"SGD": 0.1, "Adagrad": 0.01, "RowWiseAdagrad": 0.01}
KINDS = ("torch", "swap", "hostembed", "collection", "fused")
# Each contender's name in the result rows (the table's headers).
NAMES = {"torch": "torch", "swap": "swap (torch's optimizer)", "hostembed": "hostembed, 4 calls",
         "collection": "collection", "fused": "collection fused"}
STEPS_PER_ROUND_BAGS = 4096  # a round: this many bags a table, in steps


def build(kind, opt_name, initial):
    torch.manual_seed(0)
    cls = torch.nn.EmbeddingBag if kind == "torch" else hostembed.EmbeddingBag
    tables = [cls.from_pretrained(w, freeze=False, mode="sum", sparse=True) for w in initial]
    params = [t.weight for t in tables]
    if kind in ("torch", "swap"):
        opt = getattr(torch.optim, "Adagrad" if opt_name == "RowWiseAdagrad" else opt_name)(params, lr=LR[opt_name])
    else:
        opt = getattr(hostembed, opt_name)(params, lr=LR[opt_name], fused=kind == "fused")
    if kind in ("collection", "fused"):
        tables = hostembed.EmbeddingBagCollection(tables)
    return tables, opt


def step(tables, opt, ids, grad):
    if isinstance(tables, hostembed.EmbeddingBagCollection):
        outs = tables(ids)
    else:
        outs = [table(x) for table, x in zip(tables, ids)]
    torch.autograd.backward(outs, [grad] * len(outs))
    opt.step()
    opt.zero_grad()


def make_ids(rows, bags, skew, g):
    if skew == "uniform":
        return torch.randint(0, rows, (bags, BAG), generator=g)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.05)
    return torch.multinomial(ranks, bags * BAG, replacement=True, generator=g).view(bags, BAG)


def result_rows(ctx, report):
    """The run's figures as result rows (benchmarks/_rows.py's schema):
    per optimizer, ids and bags, each contender's ms a step (median, min,
    max of the rounds' means); each contender's largest weight difference
    from torch's (or, row-wise Adagrad, hostembed's) after the warm-ups, of
    the table's largest weight, over every workload; the other processes'
    share of the CPUs."""
    args = report["args"]
    base = {"tables": report["table_rows"], "dim": DIM, "bag": BAG, "mode": "sum", "rounds": args["rounds"],
            "warmup": args["warmup"], "threads": args["threads"]}
    out = []
    for r in report["results"]:
        workload = dict(base, optimizer=r["optimizer"], lr=LR[r["optimizer"]], ids=r["ids"], bags=r["bags"],
                        steps_per_round=r["steps_per_round"])
        for kind, ms in r["round_ms"].items():
            out += spread_rows(ctx, workload, NAMES[kind], "step_time", ms, "ms")
    checked = dict(base, optimizers=args["optimizers"].split(","), ids=args["ids"].split(","),
                   bags=[int(b) for b in args["bags"].split(",")])
    out += [make_row(ctx, checked, NAMES[kind], "max_weight_difference", diff, "fraction")
            for kind, diff in report["max_abs_diff_vs_torch"].items() if kind in report["checked"]]
    if report["other_load"] is not None:
        out.append(make_row(ctx, checked, "other processes", "cpu_share", report["other_load"], "fraction"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bags", default="128,2048,16384", help="bags per table per step")
    parser.add_argument("--optimizers", default="SGD,Adagrad,RowWiseAdagrad")
    parser.add_argument("--ids", default="uniform,zipf")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=usable_cpus())
    parser.add_argument("--rows-scale", type=float, default=1.0, help="table sizes x this (a quick look: 0.01)")
    parser.add_argument("--json", default=os.path.join(run_folder(), "dlrm_step.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    rows = [max(BAG, int(r * args.rows_scale)) for r in ROWS]
    g = torch.Generator().manual_seed(0)
    initial = [torch.randn(r, DIM, generator=g) for r in rows]
    load = OtherLoad()
    results = []
    max_diff = {k: 0.0 for k in KINDS}
    checked = set()  # the contenders whose weights were compared
    for opt_name in args.optimizers.split(","):
        kinds = tuple(k for k in KINDS if not (k == "swap" and opt_name == "RowWiseAdagrad"))
        built = {k: build(k, opt_name, initial) for k in kinds}
        for skew in args.ids.split(","):
            for bags in (int(b) for b in args.bags.split(",")):
                per_round = max(1, STEPS_PER_ROUND_BAGS // bags)
                batches = [[[make_ids(r, bags, skew, g) for r in rows] for _ in range(per_round)]
                           for _ in range(args.warmup + args.rounds)]
                grad = torch.randn(bags, DIM, generator=g)
                times = {k: [] for k in kinds}
                for i, round_batches in enumerate(batches):
                    order = kinds if i % 2 == 0 else kinds[::-1]
                    for k in order:
                        t0 = time.perf_counter()
                        for ids in round_batches:
                            step(*built[k], ids, grad)
                        if i >= args.warmup:
                            times[k].append((time.perf_counter() - t0) / per_round)
                    if i == args.warmup - 1:
                        # torch adds a hot row's gradient rows to it one by
                        # one, hostembed sums them first: equal to float
                        # rounding of sums of hundreds of rows.
                        same = "hostembed" if opt_name == "RowWiseAdagrad" else "torch"
                        ref = [t.weight.detach() for t in built[same][0]]
                        for k in kinds:
                            if k in ("torch", same):
                                continue
                            diff = max(((a.weight.detach() - b).abs().max() / b.abs().max().clamp(min=1)).item()
                                       for a, b in zip(built[k][0], ref))
                            max_diff[k] = max(max_diff[k], diff)
                            checked.add(k)
                            if not diff <= 1e-4:
                                fail(f"{k} {opt_name} is {diff:.3g} from torch's after the warm-up ({skew}, {bags} "
                                     "bags)")
                row = {"optimizer": opt_name, "ids": skew, "bags": bags, "steps_per_round": per_round,
                       **{k: statistics.median(times[k]) * 1e3 if times.get(k) else None for k in KINDS},
                       "round_ms": {k: [t * 1e3 for t in times[k]] for k in kinds}}
                results.append(row)
                log(f"{opt_name} {skew} {bags}: " + ", ".join(f"{k} {row[k]:.2f} ms" for k in kinds))
        del built
    other = load.fraction()
    print(f"\nEmbedding part of a DLRM-style step, ms (median of {args.rounds} rounds of max(1, "
          f"{STEPS_PER_ROUND_BAGS:,} / bags) steps each): 4 EmbeddingBag tables "
          f"{', '.join(f'{r:,}' for r in rows)} x {DIM}, bags of {BAG}, {args.threads} threads; other load "
          f"{'n/a' if other is None else f'{other:.0%}'}\n")
    print("ms per step, and torch's time over each (x torch); torch's Adagrad stands in for row-wise Adagrad\n")
    print("| optimizer | ids | bags per table | torch | swap (torch's optimizer) | x torch | hostembed, 4 calls | "
          "x torch | collection | x torch | collection fused | x torch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        t = r["torch"]
        cells = []
        for k in KINDS[1:]:
            cells += ["-", "-"] if r.get(k) is None else [f"{r[k]:.2f}", f"{t / r[k]:.2f}"]
        print(f"| {r['optimizer']} | {r['ids']} | {r['bags']:,} | {t:.2f} | " + " | ".join(cells) + " |")
    print("\nlargest weight difference from torch's after the warm-ups (of the table's largest weight): "
          + ", ".join(f"{k} {v:.2g}" for k, v in max_diff.items() if k in checked))
    info = machine_info()
    report = {"args": vars(args), "machine": info, "table_rows": rows, "other_load": other, "results": results,
              "max_abs_diff_vs_torch": max_diff, "checked": sorted(checked)}
    write_json(args.json, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.json)), result_rows(run_context("dlrm_step", info=info),
                                                                               report))
    log(f"wrote {args.json} and {path}")


if __name__ == "__main__":
    main()
