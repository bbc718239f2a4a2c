"""A click-through-rate model trained with Adam, as most scripts train one:
torch as written against the routes hostembed offers.

The model is FM-shaped like DeepFM: FIELDS categorical fields whose ids
share one [rows, dim] table (the factors) and one [rows, 1] table (the
first-order weights), a pairwise FM term, and a two-layer MLP over the
concatenated factors. The loss is binary cross-entropy; the optimizer is
Adam(lr=1e-3, weight_decay=1e-6) over model.parameters(), one step per batch.

Contenders, timed in alternating rounds on the same batches:
  torch_adam          nn.Embedding (sparse=False) + torch.optim.Adam, as written
  torch_adam_fused    the same with torch.optim.Adam(fused=True)
  deepspeed_adam      the same with DeepSpeedCPUAdam (where deepspeed imports)
  swap_adam           torch.nn.Embedding swapped for hostembed.Embedding,
                      torch.optim.Adam unchanged (the table's step by the core,
                      no dense gradient)
  swap_adam_fused     the swap, with Adam(fused=True) for the dense layers
  sparse_adam         hostembed.SparseAdam(model.parameters()): lazy Adam on
                      the tables (rows a batch does not touch do not move),
                      torch's Adam on the rest; its weight decay is off (lazy
                      decay is its own algorithm)

Every contender but sparse_adam must give torch_adam's numbers: checked
after the warm-up steps against torch_adam's weights (within torch's own
float32 error of a float64 run, see tests/test_torch_optimizers.py).
Then each trains one epoch of a synthetic data set with a learnable signal
and reports the held-out AUC. The JSON (--json) holds the figures; they
also go as result rows (result_rows) to rows.jsonl beside it, which
docs/results.md's table is rendered from.

    python benchmarks/clients/ctr_adam.py                     # 2.7M rows, batch 2048
    python benchmarks/clients/ctr_adam.py --batch 256
    python benchmarks/clients/ctr_adam.py --rows 20000 --epoch-batches 5 --rounds 2   # a quick look
"""
import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (OtherLoad, PeakRss, run_folder, _vm_hwm_bytes, copy_bandwidth, fmt_ms, log,  # noqa: E402
                     machine_info, make_row, require_hostembed, run_context, summarize_ms, summary_figures, usable_cpus,
                     write_json, write_rows)

hostembed = require_hostembed()

CONTENDERS = ("torch_adam", "torch_adam_fused", "deepspeed_adam", "swap_adam", "swap_adam_fused", "sparse_adam")
LR, WEIGHT_DECAY = 1e-3, 1e-6
TEST_SAMPLES = 50_000


class CTRModel(nn.Module):
    """FM + MLP over FIELDS categorical fields (DeepFM's shape)."""

    def __init__(self, embedding, rows, dim, fields, hidden=400):
        super().__init__()
        self.factors = embedding(rows, dim)
        self.linear = embedding(rows, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.mlp = nn.Sequential(nn.Linear(fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, ids):
        v = self.factors(ids)                                      # [B, F, D]
        first = self.linear(ids).sum((1, 2))                       # [B]
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)      # [B]
        deep = self.mlp(v.flatten(1)).squeeze(1)                   # [B]
        return first + fm + deep + self.bias


def make_data(rows, fields, count, seed, truth):
    """count samples: each field draws Zipf(1.1) ids from its own slice of
    the rows; the label is Bernoulli(sigmoid) of a hidden per-row weight
    summed over the fields (truth), so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    per_field = rows // fields
    ranks = torch.arange(1, per_field + 1, dtype=torch.float64).pow(-1.1)
    draws = torch.multinomial(ranks, count * fields, replacement=True, generator=g).view(count, fields)
    ids = draws + torch.arange(fields) * per_field
    logits = truth[ids].sum(1)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
    return ids, labels


def auc(scores, labels):
    """The area under the ROC curve (ties counted half), by ranks."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # Average the ranks of ties.
    uniq, inverse = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    ranks = (sums / counts)[inverse]
    positive = labels > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def deepspeed_adam():
    """DeepSpeedCPUAdam's class, or None with the reason."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam, None
    except Exception as exc:  # not installed, or its op does not build here
        return None, f"{type(exc).__name__}: {exc}"


def build(name, args, initial):
    """(model, optimizer) of contender `name`, from the same initial state."""
    embedding = hostembed.Embedding if name.startswith("swap") or name == "sparse_adam" else nn.Embedding
    model = CTRModel(embedding, args.rows, args.dim, args.fields)
    model.load_state_dict(initial)
    params = list(model.parameters())
    if name in ("torch_adam", "swap_adam"):
        opt = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    elif name in ("torch_adam_fused", "swap_adam_fused"):
        opt = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    elif name == "deepspeed_adam":
        cls, _ = deepspeed_adam()
        opt = cls(params, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=False)
    else:
        opt = hostembed.SparseAdam(params, lr=LR)
    return model, opt


def step(model, opt, ids, labels):
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
    loss.backward()
    opt.step()
    return loss


def check(models, reference64):
    """Every exact route within twice torch_adam's own error of the float64
    run (the bound tests/test_torch_optimizers.py asserts)."""
    ref = models["torch_adam"].state_dict()
    torch_error = max((ref[k].double() - v).abs().max().item() for k, v in reference64.items())
    out = {"torch_adam_error_vs_float64": torch_error}
    for name, model in models.items():
        if name in ("torch_adam", "sparse_adam"):
            continue
        error = max((model.state_dict()[k].double() - v).abs().max().item() for k, v in reference64.items())
        out[f"{name}_error_vs_float64"] = error
        if not error <= 2 * torch_error + 1e-9:
            sys.exit(f"CORRECTNESS CHECK FAILED: {name} is {error:.3g} from the float64 run, torch_adam "
                     f"{torch_error:.3g}")
    return out


def result_rows(ctx, report):
    """The run's figures as result rows (benchmarks/_rows.py's schema),
    one contender each: ms a step (median, min, max), the peak RSS its
    model, optimizer and warm-up steps added, the held-out AUC after the
    epoch, the largest weight difference from the float64 run after the
    warm-ups (torch_adam's own, and each exact route's); the host copy
    bandwidth; the other processes' share of the CPUs."""
    args = report["args"]
    workload = {"rows": args["rows"], "dim": args["dim"], "fields": args["fields"], "batch": args["batch"],
                "optimizer": "Adam", "lr": LR, "weight_decay": WEIGHT_DECAY, "warmup": args["warmup"],
                "rounds": args["rounds"], "steps_per_round": args["steps_per_round"],
                "epoch_batches": args["epoch_batches"], "test_samples": TEST_SAMPLES, "threads": report["threads"]}
    out = []
    for name, r in report["results"].items():
        figures = summary_figures("step_time", r)
        figures += [("peak_rss_added", r["peak_rss_bytes"], "bytes"), ("auc", r["auc"], "score"),
                    ("error_vs_float64", report["checks"].get(f"{name}_error_vs_float64"), "abs")]
        out += [make_row(ctx, workload, name, metric, value, unit) for metric, value, unit in figures
                if value is not None]
    copy = report["copy_bandwidth"]
    out.append(make_row(ctx, {"threads": copy["threads"], "buffer_bytes": copy["buffer_bytes"]}, "host copy (copy_)",
                        "bandwidth", copy["bytes_per_s"], "bytes/s"))
    if report["other_load"] is not None:
        out.append(make_row(ctx, workload, "other processes", "cpu_share", report["other_load"], "fraction"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_700_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fields", type=int, default=39)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (state allocation), then the check")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of timed steps")
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--epoch-batches", type=int, default=100, help="batches in the AUC epoch (0: no AUC)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    names = [n for n in args.contenders.split(",") if n]
    if "deepspeed_adam" in names and deepspeed_adam()[0] is None:
        log(f"deepspeed_adam skipped: {deepspeed_adam()[1]}")
        names.remove("deepspeed_adam")
    threads = usable_cpus()
    torch.set_num_threads(threads)
    hostembed.set_num_threads(threads)
    bandwidth = copy_bandwidth(256 << 20, 5, threads)
    load = OtherLoad()

    torch.manual_seed(0)
    initial = CTRModel(nn.Embedding, args.rows, args.dim, args.fields).state_dict()
    truth = torch.randn(args.rows, generator=torch.Generator().manual_seed(7)) * 0.5
    steps_total = args.warmup + args.rounds * args.steps_per_round
    train_ids, train_labels = make_data(args.rows, args.fields, args.batch * max(steps_total, args.epoch_batches),
                                        1, truth)
    batches = [(train_ids[i * args.batch:(i + 1) * args.batch], train_labels[i * args.batch:(i + 1) * args.batch])
               for i in range(max(steps_total, args.epoch_batches))]

    # Build and warm up each contender in turn: the memory its model,
    # optimizer state and steps add at their peak.
    peak = PeakRss()
    models, opts, peaks = {}, {}, {}
    for name in names:
        log(f"building {name}")
        peak.start()
        before = _vm_hwm_bytes()
        models[name], opts[name] = build(name, args, initial)
        for ids, labels in batches[:args.warmup]:
            step(models[name], opts[name], ids, labels)
        after = peak.window()
        peaks[name] = None if after is None or before is None else after - before
    # A float64 run of torch's Adam over the warm-up batches: the reference.
    log("float64 reference")
    model64 = CTRModel(nn.Embedding, args.rows, args.dim, args.fields).double()
    model64.load_state_dict({k: v.double() for k, v in initial.items()})
    opt64 = torch.optim.Adam(model64.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for ids, labels in batches[:args.warmup]:
        step(model64, opt64, ids, labels.double())
    checks = check(models, model64.state_dict()) if "torch_adam" in models else {}
    del model64, opt64

    # Timed rounds, contenders alternating.
    times = {name: [] for name in names}
    cursor = args.warmup
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for ids, labels in batches[cursor:cursor + args.steps_per_round]:
                t0 = time.perf_counter()
                step(models[name], opts[name], ids, labels)
                times[name].append(time.perf_counter() - t0)
        cursor += args.steps_per_round
        log(f"round {r + 1}/{args.rounds}")
    other = load.fraction()

    # One epoch each from the initial state, then the held-out AUC.
    aucs = {}
    if args.epoch_batches:
        test_ids, test_labels = make_data(args.rows, args.fields, TEST_SAMPLES, 2, truth)
        for name in names:
            log(f"epoch: {name}")
            del models[name], opts[name]
            model, opt = build(name, args, initial)
            for ids, labels in batches[:args.epoch_batches]:
                step(model, opt, ids, labels)
            with torch.no_grad():
                scores = torch.cat([model(test_ids[i:i + 8192]) for i in range(0, test_ids.numel() // args.fields,
                                                                              8192)])
            aucs[name] = auc(scores.double(), test_labels)
            del model, opt

    results = {name: {**summarize_ms(times[name]), "peak_rss_bytes": peaks[name], "auc": aucs.get(name)}
               for name in names}
    base = results.get("torch_adam", {}).get("median_ms")
    fused = results.get("torch_adam_fused", {}).get("median_ms")
    print(f"\nCTR model, {args.fields} fields, tables [{args.rows:,}, {args.dim}] + [{args.rows:,}, 1], batch "
          f"{args.batch}, Adam(lr={LR}, weight_decay={WEIGHT_DECAY}); {threads} threads; copy bandwidth "
          f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s; other load {other if other is None else f'{other:.0%}'}\n")
    print("| contender | ms/step (median) | x torch Adam | x torch fused Adam | peak RSS added | held-out AUC |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        r = results[name]
        ratio = f"{base / r['median_ms']:.2f}" if base else ""
        ratio_fused = f"{fused / r['median_ms']:.2f}" if fused else ""
        rss = "" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"
        auc_text = "" if r["auc"] is None else f"{r['auc']:.4f}"
        print(f"| {name} | {fmt_ms(r['median_ms'])} | {ratio} | {ratio_fused} | {rss} | {auc_text} |")
    info = machine_info()
    report = {"args": vars(args), "machine": info, "threads": threads, "copy_bandwidth": bandwidth,
              "other_load": other, "checks": checks, "results": results}
    path = args.json or os.path.join(run_folder(), f"ctr_adam_b{args.batch}.json")
    write_json(path, report)
    rows_path = write_rows(os.path.dirname(os.path.abspath(path)), result_rows(run_context("ctr_adam", info=info),
                                                                               report))
    log(f"wrote {path} and {rows_path}")


if __name__ == "__main__":
    main()
