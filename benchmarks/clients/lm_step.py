"""Where a host table pays in a language model: the training step and the
memory of a small decoder-only model whose token table is torch's
nn.Embedding or hostembed's, tied to the output projection (GPT-2, Gemma)
or not (Llama), for vocabularies of 50,257 and 256,000 rows, on the CPU or
with the model on a GPU (--device cuda: hostembed's table stays in host
memory, its rows land on the GPU).

The model: token table [V, H] -> two torch TransformerEncoderLayers (causal
mask, H wide, 4H MLP) -> output projection [H, V] (the token table's weight
when tied), cross-entropy on the next token; --tokens ids a step. The
contenders, each beside its own reference:
  torch             nn.Embedding, torch.optim.AdamW on every parameter
  hostembed         the plain swap: hostembed.Embedding, the same AdamW
                    (every row of the table steps every step, as torch's
                    dense AdamW does, in the core: no dense gradient)
and, untied only (a tied projection's gradient is dense):
  torch_sparse      nn.Embedding(sparse=True) with torch.optim.SparseAdam
                    for the table, AdamW for the rest
  hostembed_sparse  hostembed.Embedding with hostembed.SparseAdam for the
                    table (only the rows a step looks up move), AdamW for
                    the rest
Each pair is checked to train to the same losses before anything is timed.
Contenders alternate in rounds, medians. Reported per model and
contender: ms a step and the ratio to torch's in the same run; with a GPU,
the GPU memory the contender holds after a step and its peak during one
(torch.cuda's allocator counts, each contender built and stepped alone
first); and the bytes the token table holds after a step: its weight, its
gradient (dense, or the row-sparse rows and ids) and its optimizer's state,
counted from the tensors, with where they live. The figures go to --json
and, as result rows (result_rows), to rows.jsonl beside it.

What it shows on a CPU: untied, torch's table gets a dense [V, H] gradient
and AdamW's dense step every step; hostembed's gets a row-sparse one and the
core's dense Adam pass, no gradient buffer. Tied, the output projection's
gradient is dense anyway, so both run dense AdamW. On a GPU: the table, its
gradient and its optimizer's two moments (16 bytes a parameter) leave GPU
memory with a host table; the step then pays for the rows crossing PCIe,
and, with AdamW kept, for a pass over every row of the table in host
memory each step. Tied models run on the CPU only: a tied projection
multiplies by the whole table every step, so on a GPU the table must be
there.

Usage: python benchmarks/clients/lm_step.py [--vocabs 50257,256000 --hidden 256 --tokens 2048 --device cuda]
"""
import argparse
import functools
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (run_folder, log, machine_info, make_row, require_hostembed, run_context,  # noqa: E402
                     write_json, write_rows)

hostembed = require_hostembed()


class TinyLM(nn.Module):
    def __init__(self, vocab, hidden, tied, embedding_cls):
        super().__init__()
        self.tokens = embedding_cls(vocab, hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(hidden, nhead=4, dim_feedforward=4 * hidden,
                                                               dropout=0.0, batch_first=True) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.tokens.weight

    def forward(self, ids):
        x = self.tokens(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(x[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocabs", default="50257,256000")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="ids a step (sequences of 128)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (hostembed's table stays in host memory)")
    p.add_argument("--json", help="the run's JSON; rows beside it (default: the device's run folder)")
    args = p.parse_args(argv)
    args.vocabs = [int(v) for v in args.vocabs.split(",") if v]
    args.device = torch.device(args.device)
    args.json = args.json or os.path.join(run_folder(args.device), "lm_step.json")
    return args


# Contenders that must train to each other's losses: (reference, hostembed).
PAIRS = (("torch", "hostembed"), ("torch_sparse", "hostembed_sparse"))
LR = 1e-3


def contenders_of(tied):
    """A tied projection's gradient is dense: no sparse contenders then."""
    return [name for pair in PAIRS[:1 if tied else 2] for name in pair]


def build(name, vocab, hidden, tied, device, seed=0):
    """The model of contender `name` on `device` and its optimizers."""
    torch.manual_seed(seed)
    table_cls = {"torch": nn.Embedding, "torch_sparse": functools.partial(nn.Embedding, sparse=True)}.get(
        name, hostembed.Embedding)
    model = TinyLM(vocab, hidden, tied, table_cls).to(device)
    if not name.endswith("_sparse"):
        return model, [torch.optim.AdamW(model.parameters(), lr=LR)]
    table = model.tokens.weight
    rest = [p for p in model.parameters() if p is not table]
    sparse_adam = torch.optim.SparseAdam if name == "torch_sparse" else hostembed.SparseAdam
    return model, [sparse_adam([table], lr=LR), torch.optim.AdamW(rest, lr=LR)]


def batches(vocab, tokens, count, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (max(1, tokens // 128), 128), generator=g).to(device) for _ in range(count)]


def step(model, opts, ids):
    for opt in opts:
        opt.zero_grad()
    loss = model(ids)
    loss.backward()
    for opt in opts:
        opt.step()
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return loss.item()


def table_bytes(model, opts):
    """Bytes of the token table's weight, gradient and optimizer state, and
    the device they are on."""
    p = model.tokens.weight
    grad = p.grad
    if grad is None:
        grad_bytes = 0
    elif grad.is_sparse:
        grad_bytes = grad._values().nbytes + grad._indices().nbytes
    else:
        grad_bytes = grad.nbytes
    state = sum(t.nbytes for opt in opts for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor))
    return {"weight": p.nbytes, "grad": grad_bytes, "state": state, "device": str(p.device)}


def build_and_warm(name, vocab, hidden, tied, data, args):
    """Contender `name` built and stepped through the warm-up batches, with
    the GPU memory it holds after a step and its peak (None on a CPU)."""
    cuda = args.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(args.device)
        base = torch.cuda.memory_allocated(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
    model, opts = build(name, vocab, hidden, tied, args.device)
    losses = [step(model, opts, b) for b in data[:args.warmup]]
    gpu = None
    if cuda:
        gpu = {"held": torch.cuda.memory_allocated(args.device) - base,
               "peak": torch.cuda.max_memory_allocated(args.device) - base}
    return model, opts, losses, gpu


def check_pairs(losses, vocab, tied, when):
    """Each pair's losses step by step, within float32 rounding of each
    other (a step's loss reflects every update before it)."""
    for reference, ours in PAIRS:
        if ours not in losses:
            continue
        for a, b in zip(losses[reference], losses[ours]):
            if abs(a - b) > 1e-4 * abs(a):
                sys.exit(f"CORRECTNESS CHECK FAILED ({when}): vocab {vocab}, tied {tied}: {reference} "
                         f"{losses[reference]}, {ours} {losses[ours]}")


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for vocab in args.vocabs:
        for tied in (True, False):
            if tied and args.device.type == "cuda":
                # The tied projection multiplies by the whole table every
                # step: on a GPU it must be there, which a host table is not.
                log(f"vocab {vocab:,}, tied: not run on a GPU (the output projection reads the whole table)")
                continue
            names = contenders_of(tied)
            data = batches(vocab, args.tokens, args.warmup + args.rounds, args.device)
            contenders, losses, gpu = {}, {}, {}
            for name in names:
                model, opts, losses[name], gpu[name] = build_and_warm(name, vocab, args.hidden, tied, data, args)
                contenders[name] = (model, opts)
            check_pairs(losses, vocab, tied, "warm-up")
            seconds = {name: [] for name in contenders}
            for r, ids in enumerate(data[args.warmup:]):
                order = names if r % 2 else names[::-1]
                for name in order:
                    model, opts = contenders[name]
                    t0 = time.perf_counter()
                    losses[name].append(step(model, opts, ids))
                    seconds[name].append(time.perf_counter() - t0)
            # The losses after optimizer steps: the pairs' updates agree.
            check_pairs(losses, vocab, tied, "timed")
            held = {name: table_bytes(model, opts) for name, (model, opts) in contenders.items()}
            del contenders
            ms = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
            row = {"vocab": vocab, "hidden": args.hidden, "tied": tied, "tokens": args.tokens,
                   "device": str(args.device), "ms_per_step": ms,
                   "ms_per_step_min": {k: min(v) * 1e3 for k, v in seconds.items()},
                   "ms_per_step_max": {k: max(v) * 1e3 for k, v in seconds.items()},
                   "speed_vs_torch": {k: ms["torch"] / v for k, v in ms.items()},
                   "hostembed_speed_vs_torch": ms["torch"] / ms["hostembed"],
                   "gpu_bytes": gpu if args.device.type == "cuda" else None, "table_bytes": held}
            rows.append(row)
            log(f"vocab {vocab:,}, {'tied' if tied else 'untied'}: "
                + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    print(f"\n## A small language model's training step ({args.device.type}; 2 layers, H={args.hidden}, "
          f"{args.tokens:,} tokens a step), torch's nn.Embedding against hostembed's\n")
    print("| vocabulary | tie | contender | ms/step | speed vs torch | GPU MiB held after a step / peak "
          "| table weight + grad + state (where) |")
    print("|---:|---|---|---:|---:|---:|---|")

    def mib(n):
        return f"{n / 2**20:,.1f}"

    for r in rows:
        for name, ms in r["ms_per_step"].items():
            b, g = r["table_bytes"][name], (r["gpu_bytes"] or {}).get(name)
            memory = f"{mib(g['held'])} / {mib(g['peak'])}" if g else "-"
            print(f"| {r['vocab']:,} | {'tied' if r['tied'] else 'untied'} | {name} | {ms:.1f} | "
                  f"{r['speed_vs_torch'][name]:.2f}x | {memory} | {mib(b['weight'])} + {mib(b['grad'])} + "
                  f"{mib(b['state'])} MiB ({b['device']}) |")
    report = {"machine": machine_info(), "args": {k: str(v) if k == "device" else v
                                                  for k, v in vars(args).items() if k != "json"}, "rows": rows}
    write_json(args.json, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                      result_rows(run_context("lm_step", device=args.device, info=report["machine"]), report))
    log(f"wrote {args.json} and {path}")
    return rows


CONTENDERS = {"torch": "torch nn.Embedding", "hostembed": "hostembed.Embedding (plain swap)",
              "torch_sparse": "torch nn.Embedding(sparse=True) + SparseAdam",
              "hostembed_sparse": "hostembed.Embedding + hostembed.SparseAdam"}


def result_rows(ctx, report):
    """A run's report (its JSON) as result rows (benchmarks/_rows.py's
    schema), a model (vocab, hidden, tied, tokens, warmup, rounds) and a
    contender each: the step time (median; min and max where the JSON keeps
    them), the token table's weight, gradient and optimizer-state bytes,
    the speed against torch's step (not torch's own), and with a GPU the
    GPU memory held after a step and the peak during one.
    recover_rows.py converts the committed runs' JSON with it too (they
    kept only torch and hostembed, and only hostembed's speed)."""
    rows = []
    for r in report["rows"]:
        workload = {k: r[k] for k in ("vocab", "hidden", "tied", "tokens") if k in r}
        workload.update({k: report["args"][k] for k in ("warmup", "rounds") if k in report["args"]})
        speeds = r.get("speed_vs_torch") or {"hostembed": r["hostembed_speed_vs_torch"]}
        for key, ms in r["ms_per_step"].items():
            sizes, gpu = r["table_bytes"][key], (r.get("gpu_bytes") or {}).get(key) or {}
            figures = [("step_time_median", ms, "ms"), ("step_time_min", r.get("ms_per_step_min", {}).get(key), "ms"),
                       ("step_time_max", r.get("ms_per_step_max", {}).get(key), "ms"),
                       ("table_weight", sizes["weight"], "bytes"), ("table_grad", sizes["grad"], "bytes"),
                       ("table_optimizer_state", sizes["state"], "bytes"),
                       ("speed_vs_torch", None if key == "torch" else speeds.get(key), "x"),
                       ("gpu_memory_held", gpu.get("held"), "bytes"), ("gpu_memory_peak", gpu.get("peak"), "bytes")]
            rows += [make_row(ctx, workload, CONTENDERS[key], metric, value, unit)
                     for metric, value, unit in figures if value is not None]
    return rows


if __name__ == "__main__":
    main()
