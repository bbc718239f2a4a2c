"""The fixed cost of one lookup call: hostembed's Embedding and EmbeddingBag
against torch's on a table too big to cache, for batches from 512 ids up,
with gradients enabled and under no_grad (forward only).

Each size times every contender in rounds, the order alternating, after a
warm-up; the figure is the median of all rounds. Outputs are checked equal
to torch's first (the same table).

    python benchmarks/per_call.py                       # 2M x 64, 512 .. 1M ids
    python benchmarks/per_call.py --sizes 512,8192 --rounds 50
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS_DIR, OtherLoad, fail, log, machine_info, require_hostembed, usable_cpus, write_json  # noqa: E402

hostembed = require_hostembed()


def contenders(rows, dim):
    torch.manual_seed(0)
    ref = torch.nn.Embedding(rows, dim)
    ours = hostembed.Embedding.from_pretrained(ref.weight.detach(), freeze=False)
    ref_bag = torch.nn.EmbeddingBag(rows, dim, mode="sum")
    ref_bag.weight.data.copy_(ref.weight.detach())
    ours_bag = hostembed.EmbeddingBag.from_pretrained(ref.weight.detach(), freeze=False, mode="sum")
    # Bags of 4 ids: a 2-D input [n / 4, 4].
    return {"torch Embedding": (ref, False), "hostembed Embedding": (ours, False),
            "torch EmbeddingBag (bags of 4)": (ref_bag, True), "hostembed EmbeddingBag (bags of 4)": (ours_bag, True)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--sizes", default="512,8192,65536,1048576")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=usable_cpus())
    parser.add_argument("--json", default=os.path.join(RESULTS_DIR, "per_call.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    models = contenders(args.rows, args.dim)
    load = OtherLoad()
    results = {}
    g = torch.Generator().manual_seed(1)
    for size in (int(s) for s in args.sizes.split(",")):
        ids = torch.randint(0, args.rows, (size // 4, 4), generator=g)
        flat = ids.reshape(-1)
        if not torch.equal(models["hostembed Embedding"][0](flat), models["torch Embedding"][0](flat)) or \
                not torch.equal(models["hostembed EmbeddingBag (bags of 4)"][0](ids),
                                models["torch EmbeddingBag (bags of 4)"][0](ids)):
            fail(f"hostembed's outputs differ from torch's at {size} ids")
        reps = max(1, min(200, 2_000_000 // size))
        times = {(name, grad): [] for name in models for grad in (True, False)}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for name in order:
                module, bag = models[name]
                x = ids if bag else flat
                for grad in (True, False):
                    with torch.set_grad_enabled(grad):
                        module(x)  # warm
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            module(x)
                        times[(name, grad)].append((time.perf_counter() - t0) / reps)
        results[size] = {f"{name} | {'grad' if grad else 'no_grad'}": statistics.median(s) * 1e6
                         for (name, grad), s in times.items()}
        log(f"{size} ids done")
    other = load.fraction()
    sizes = list(results)
    print(f"\nOne forward call, median us, table [{args.rows:,}, {args.dim}], {args.threads} threads "
          f"(grad enabled / no_grad); other load {'n/a' if other is None else f'{other:.0%}'}\n")
    print("| ids per call | " + " | ".join(models) + " |")
    print("|---:|" + "---:|" * len(models))
    for size in sizes:
        cells = [f"{results[size][f'{n} | grad']:,.0f} / {results[size][f'{n} | no_grad']:,.0f}" for n in models]
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "other_load": other,
                           "median_us": {str(k): v for k, v in results.items()}})
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
