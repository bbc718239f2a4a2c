"""Where a host table pays in a language model: the training step and the
memory of a small decoder-only model whose token table is torch's
nn.Embedding or hostembed's (the plain swap), tied to the output projection
(GPT-2, Gemma) or not (Llama), for vocabularies of 50,257 and 256,000 rows.

The model: token table [V, H] -> two torch TransformerEncoderLayers (causal
mask, H wide, 4H MLP) -> output projection [H, V] (the token table's weight
when tied), cross-entropy on the next token; torch.optim.AdamW on every
parameter (the script's optimizer kept, as after a plain swap); --tokens
ids a step. Contenders alternate in rounds, medians. Reported per model: ms
a step and the ratio to torch's in the same run, and the bytes the token
table holds after a step: its weight, its gradient (dense, or the
row-sparse rows and ids) and AdamW's state for it, counted from the
tensors.

What it shows on a CPU: untied, torch's table gets a dense [V, H] gradient
and AdamW's dense step every step; hostembed's gets a row-sparse one and the
core's dense Adam pass, no gradient buffer. Tied, the output projection's
gradient is dense anyway, so both run dense AdamW. On a GPU the question is
memory: the table, its gradient and AdamW's two moments (16 bytes a
parameter) leave GPU memory with a host table.

Usage: python benchmarks/lm_step.py [--vocabs 50257,256000 --hidden 256 --tokens 2048]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

from _common import RESULTS_DIR, log, machine_info, require_hostembed, write_json

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
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
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
    p.add_argument("--json", default=os.path.join(RESULTS_DIR, "lm_step.json"))
    args = p.parse_args(argv)
    args.vocabs = [int(v) for v in args.vocabs.split(",") if v]
    return args


def build(vocab, hidden, tied, host, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(vocab, hidden, tied, hostembed.Embedding if host else nn.Embedding)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches(vocab, tokens, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (max(1, tokens // 128), 128), generator=g) for _ in range(count)]


def step(model, opt, ids):
    opt.zero_grad()
    loss = model(ids)
    loss.backward()
    opt.step()
    return loss.item()


def table_bytes(model, opt):
    """Bytes of the token table's weight, gradient and optimizer state."""
    p = model.tokens.weight
    grad = p.grad
    if grad is None:
        grad_bytes = 0
    elif grad.is_sparse:
        grad_bytes = grad._values().nbytes + grad._indices().nbytes
    else:
        grad_bytes = grad.nbytes
    state = sum(t.nbytes for t in opt.state[p].values() if isinstance(t, torch.Tensor))
    return {"weight": p.nbytes, "grad": grad_bytes, "state": state}


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for vocab in args.vocabs:
        for tied in (True, False):
            contenders = {name: build(vocab, args.hidden, tied, name == "hostembed") for name in ("torch", "hostembed")}
            data = batches(vocab, args.tokens, args.warmup + args.rounds)
            losses = {}
            for name, (model, opt) in contenders.items():
                losses[name] = [step(model, opt, b) for b in data[:args.warmup]]
            if abs(losses["torch"][-1] - losses["hostembed"][-1]) > 1e-4 * abs(losses["torch"][-1]):
                sys.exit(f"CORRECTNESS CHECK FAILED: vocab {vocab}, tied {tied}: losses {losses}")
            seconds = {name: [] for name in contenders}
            for r, ids in enumerate(data[args.warmup:]):
                order = list(contenders) if r % 2 else list(contenders)[::-1]
                for name in order:
                    model, opt = contenders[name]
                    t0 = time.perf_counter()
                    step(model, opt, ids)
                    seconds[name].append(time.perf_counter() - t0)
            held = {name: table_bytes(model, opt) for name, (model, opt) in contenders.items()}
            del contenders
            ms = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
            row = {"vocab": vocab, "hidden": args.hidden, "tied": tied, "tokens": args.tokens,
                   "ms_per_step": ms, "hostembed_speed_vs_torch": ms["torch"] / ms["hostembed"],
                   "table_bytes": held}
            rows.append(row)
            log(f"vocab {vocab:,}, {'tied' if tied else 'untied'}: torch {ms['torch']:.1f} ms, hostembed "
                f"{ms['hostembed']:.1f} ms")
    print(f"\n## A small language model's training step (2 layers, H={args.hidden}, {args.tokens:,} tokens a step, "
          "torch.optim.AdamW kept), torch's nn.Embedding against the plain swap\n")
    print("| vocabulary | tie | torch ms/step | hostembed ms/step | speed vs torch | table + grad + state, torch "
          "| hostembed |")
    print("|---:|---|---:|---:|---:|---|---|")

    def held(b):
        return f"{b['weight'] / 2**20:,.0f} + {b['grad'] / 2**20:,.1f} + {b['state'] / 2**20:,.0f} MiB"

    for r in rows:
        print(f"| {r['vocab']:,} | {'tied' if r['tied'] else 'untied'} | {r['ms_per_step']['torch']:.1f} | "
              f"{r['ms_per_step']['hostembed']:.1f} | {r['hostembed_speed_vs_torch']:.2f}x | "
              f"{held(r['table_bytes']['torch'])} | {held(r['table_bytes']['hostembed'])} |")
    write_json(args.json, {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "json"},
                           "rows": rows})
    return rows


if __name__ == "__main__":
    main()
