"""The fixed cost of one lookup call: hostembed's Embedding and EmbeddingBag
against torch's on a table too big to cache, for batches from 512 ids up:
forward and backward (of a fixed output gradient, weight.grad dropped
after), and forward alone under no_grad. hostembed's Embedding picks its
path by the call's size (torch's op on the table's weight up to
TORCH_OP_MAX_IDS ids, the core above); "core path" forces the core at
every size, which shows where the crossover lies.

Each size times every contender in rounds, the order alternating, after a
warm-up; the figure is the median of all rounds. Outputs are checked equal
to torch's first (the same table). A second table times a whole training
step of the Embeddings (forward, backward, the optimizer's step: torch's
SparseAdam for torch's module, hostembed's for hostembed's, both paths),
which is where the crossover between the paths is decided: torch's
backward leaves a row a position for the optimizer to sum, the core's
sums them in backward. The figures go to --json and, as result rows, to
rows.jsonl beside it.

    python benchmarks/cpu/per_call.py                       # 2M x 64, 512 .. 1M ids
    python benchmarks/cpu/per_call.py --sizes 512,8192 --rounds 50
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (run_folder, OtherLoad, fail, log, machine_info, make_row, require_hostembed,  # noqa: E402
                     run_context, spread_rows, usable_cpus, write_json, write_rows)

hostembed = require_hostembed()
from hostembed._core.ops import cpu as cpu_ops  # noqa: E402  (after the build check above)


def contenders(rows, dim):
    torch.manual_seed(0)
    # sparse=True: a dense gradient of the whole table a call would time the table's size, not the call.
    ref = torch.nn.Embedding(rows, dim, sparse=True)
    ours = hostembed.Embedding.from_pretrained(ref.weight.detach(), freeze=False)
    ref_bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
    ref_bag.weight.data.copy_(ref.weight.detach())
    ours_bag = hostembed.EmbeddingBag.from_pretrained(ref.weight.detach(), freeze=False, mode="sum")
    # Bags of 4 ids: a 2-D input [n / 4, 4].
    core = hostembed.Embedding.from_pretrained(ref.weight.detach(), freeze=False)
    return {"torch Embedding": (ref, False), "hostembed Embedding": (ours, False),
            "hostembed Embedding, core path": (core, False),
            "torch EmbeddingBag (bags of 4)": (ref_bag, True), "hostembed EmbeddingBag (bags of 4)": (ours_bag, True)}


class _CorePath:
    """Every lookup inside through the core, whatever its size."""

    def __enter__(self):
        self.limit, cpu_ops.TORCH_OP_MAX_IDS = cpu_ops.TORCH_OP_MAX_IDS, -1

    def __exit__(self, *exc):
        cpu_ops.TORCH_OP_MAX_IDS = self.limit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--sizes", default="512,8192,65536,1048576")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=usable_cpus())
    parser.add_argument("--json", default=os.path.join(run_folder(), "per_call.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    models = contenders(args.rows, args.dim)
    load = OtherLoad()
    results, steps, samples = {}, {}, {}
    g = torch.Generator().manual_seed(1)
    batches = {size: torch.randint(0, args.rows, (size // 4, 4), generator=g)
               for size in (int(s) for s in args.sizes.split(","))}
    # Checked before any timing: the training steps timed below move each
    # contender's rows its own way.
    for size, ids in batches.items():
        flat = ids.reshape(-1)
        for name in ("hostembed Embedding", "hostembed Embedding, core path"):
            with _CorePath() if "core path" in name else nullcontext():
                same = torch.equal(models[name][0](flat), models["torch Embedding"][0](flat))
            if not same:
                fail(f"{name}'s outputs differ from torch's at {size} ids")
        if not torch.equal(models["hostembed EmbeddingBag (bags of 4)"][0](ids),
                           models["torch EmbeddingBag (bags of 4)"][0](ids)):
            fail(f"hostembed's EmbeddingBag outputs differ from torch's at {size} ids")
    for size, ids in batches.items():
        flat = ids.reshape(-1)
        reps = max(1, min(200, 2_000_000 // size))
        grad_out = {bag: torch.randn(*(ids.shape[:1] if bag else flat.shape), args.dim, generator=g)
                    for bag in (False, True)}
        times = {(name, grad): [] for name in models for grad in (True, False)}

        def call(module, x, bag, grad):
            if not grad:
                module(x)
                return
            module(x).backward(grad_out[bag])
            module.weight.grad = None

        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for name in order:
                module, bag = models[name]
                x = ids if bag else flat
                for grad in (True, False):
                    with torch.set_grad_enabled(grad), (_CorePath() if "core path" in name else nullcontext()):
                        call(module, x, bag, grad)  # warm
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            call(module, x, bag, grad)
                        times[(name, grad)].append((time.perf_counter() - t0) / reps)
        results[size] = {f"{name} | {'grad' if grad else 'no_grad'}": statistics.median(s) * 1e6
                         for (name, grad), s in times.items()}
        log(f"{size} ids done")
        step_times = _step_times(models, flat, grad_out[False], args.rounds, reps)
        steps[size] = {name: statistics.median(t) * 1e6 for name, t in step_times.items()}
        samples[size] = (reps, times, step_times)
    other = load.fraction()
    sizes = list(results)
    print(f"\nOne call, median us, table [{args.rows:,}, {args.dim}], {args.threads} threads "
          f"(forward + backward / forward under no_grad); other load {'n/a' if other is None else f'{other:.0%}'}\n")
    print("| ids per call | " + " | ".join(models) + " |")
    print("|---:|" + "---:|" * len(models))
    for size in sizes:
        cells = [f"{results[size][f'{n} | grad']:,.0f} / {results[size][f'{n} | no_grad']:,.0f}" for n in models]
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    print("\nOne training step of the Embedding (forward, backward, SparseAdam's step), median us\n")
    print("| ids per call | " + " | ".join(STEP_CONTENDERS) + " |")
    print("|---:|" + "---:|" * len(STEP_CONTENDERS))
    for size in sizes:
        print(f"| {size:,} | " + " | ".join(f"{steps[size][n]:,.0f}" for n in STEP_CONTENDERS) + " |")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "other_load": other,
                           "median_us": {str(k): v for k, v in results.items()},
                           "step_median_us": {str(k): v for k, v in steps.items()}})
    path = write_rows(os.path.dirname(os.path.abspath(args.json)), result_rows(args, other, samples))
    log(f"wrote {args.json} and {path}")


def result_rows(args, other, samples):
    """The run's figures as result rows (benchmarks/_rows.py's schema): a
    call's and a training step's µs, median, min and max over the rounds."""
    ctx = run_context("per_call")
    base = {"rows": args.rows, "dim": args.dim, "rounds": args.rounds, "threads": args.threads}
    rows = [] if other is None else [make_row(ctx, base, "other processes", "other_load", other, "fraction")]
    for size, (reps, times, step_times) in samples.items():
        workload = dict(base, ids=size, calls_a_round=reps)
        for (name, grad), seconds in times.items():
            metric = "forward_backward_time" if grad else "forward_no_grad_time"
            rows += spread_rows(ctx, workload, name, metric, [t * 1e6 for t in seconds], "us")
        for name, seconds in step_times.items():
            rows += spread_rows(ctx, workload, name, "step_time", [t * 1e6 for t in seconds], "us")
    return rows


STEP_CONTENDERS = ("torch Embedding", "hostembed Embedding", "hostembed Embedding, core path")


def _step_times(models, ids, grad_out, rounds, reps):
    """Seconds of forward + backward + SparseAdam's step, per Embedding
    contender, a round each (each its own optimizer), rounds alternating."""
    opts = {name: (torch.optim.SparseAdam if name.startswith("torch") else hostembed.SparseAdam)(
        models[name][0].parameters(), lr=1e-4) for name in STEP_CONTENDERS}
    times = {name: [] for name in STEP_CONTENDERS}
    for name in STEP_CONTENDERS:  # the optimizer's state made (and its memory touched) before any timing
        models[name][0](ids).backward(grad_out)
        opts[name].step()
        opts[name].zero_grad()
    for r in range(rounds):
        for name in (STEP_CONTENDERS if r % 2 == 0 else STEP_CONTENDERS[::-1]):
            module, opt = models[name][0], opts[name]
            with _CorePath() if "core path" in name else nullcontext():
                t0 = time.perf_counter()
                for _ in range(reps):
                    module(ids).backward(grad_out)
                    opt.step()
                    opt.zero_grad()
                times[name].append((time.perf_counter() - t0) / reps)
    return times


if __name__ == "__main__":
    main()
