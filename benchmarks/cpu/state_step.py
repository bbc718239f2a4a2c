"""What compact optimizer state costs and saves: host bytes a parameter and
the CPU training step, for each form of hostembed.SparseAdam's state.

Forms (table dtype / moments):
  fp32            float32 table, float32 exp_avg and exp_avg_sq (torch's)
  bf16_state      float32 table, bfloat16 moments
  int8            float32 table, 8-bit moments (int8 / uint8 codes and a scale
                  per 256 columns of a row)
  rowwise         float32 table, float32 exp_avg, one exp_avg_sq a row
  int8_rowwise    float32 table, 8-bit exp_avg, one exp_avg_sq a row
  bf16_table      bfloat16 table, float32 moments (the table's own saving)
  bf16_int8       bfloat16 table, 8-bit moments
  bf16_int8_rowwise  bfloat16 table, 8-bit exp_avg, one exp_avg_sq a row

Memory: each form's table is built alone, every row's state written (one
update of all rows), and the growth of the process's resident memory
(RSS) divided by the parameters, next to the bytes its buffers were
allocated with (table + state as hostembed reports them).

Speed: the step of cpu_step.py (Zipf ids, forward, backward of a fixed
output gradient, step(), zero_grad()), unfused, then fused: every form's
table alive at once and timed in interleaved rounds (rotated order),
medians; the bytes of weight and state a step reads and writes per form,
and the host copy bandwidth measured in the same run for scale. The
figures go to --out and, as result rows (result_rows), to rows.jsonl beside
it.

    python benchmarks/cpu/state_step.py
    python benchmarks/cpu/state_step.py --rows 200000 --rounds 3   # a quick look
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (OtherLoad, copy_bandwidth, fmt_ms, log, machine_info, make_row, require_hostembed,  # noqa: E402
                     run_context, run_folder, summarize_ms, summary_figures, usable_cpus, write_json, write_rows,
                     zipf_batches)

hostembed = require_hostembed()

FORMS = {
    "fp32": (torch.float32, {}),
    "bf16_state": (torch.float32, {"state_dtype": torch.bfloat16}),
    "int8": (torch.float32, {"state_dtype": torch.int8}),
    "rowwise": (torch.float32, {"rowwise_exp_avg_sq": True}),
    "int8_rowwise": (torch.float32, {"state_dtype": torch.int8, "rowwise_exp_avg_sq": True}),
    "bf16_table": (torch.bfloat16, {}),
    "bf16_int8": (torch.bfloat16, {"state_dtype": torch.int8}),
    "bf16_int8_rowwise": (torch.bfloat16, {"state_dtype": torch.int8, "rowwise_exp_avg_sq": True}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000, help="table rows N")
    p.add_argument("--dim", type=int, default=128, help="embedding dim D")
    p.add_argument("--batch", type=int, default=65_536, help="ids per batch")
    p.add_argument("--alpha", type=float, default=1.15, help="Zipf exponent of the ids")
    p.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps per contender (at least one pass over the distinct batches)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (one step of each contender a round)")
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated forms")
    p.add_argument("--threads", type=int, default=usable_cpus())
    p.add_argument("--out", default=os.path.join(run_folder(), "state_step.json"))
    return p.parse_args(argv)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def build(args, form, fused=False):
    dtype, options = FORMS[form]
    torch.manual_seed(0)
    emb = hostembed.Embedding(args.rows, args.dim, dtype=dtype)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-3, fused=fused, **options)
    return emb, opt


def step(emb, opt, ids, grad):
    out = emb(ids)
    out.backward(grad)
    opt.step()
    opt.zero_grad()


def memory(args, form):
    """(bytes a parameter by RSS growth, by allocation) of one form with
    every row's state written."""
    gc.collect()
    before = rss_bytes()
    emb, opt = build(args, form)
    # Every row in steps of a few thousand: temporaries of a few MB, which
    # the allocator may keep, not a table's worth.
    chunk = 4096
    grad = torch.full((chunk, args.dim), 1e-3, dtype=emb.weight.dtype)
    for start in range(0, args.rows, chunk):
        ids = torch.arange(start, min(start + chunk, args.rows))
        step(emb, opt, ids, grad[:ids.numel()])
    del grad, ids
    gc.collect()
    grown = rss_bytes() - before
    allocated = emb.weight.numel() * emb.weight.element_size() + opt.state_bytes()[emb.weight]
    params = args.rows * args.dim
    del emb, opt
    gc.collect()
    return grown / params, allocated / params


def step_bytes(args, form, unique):
    """Bytes of weight and state one step reads and writes for `unique`
    rows (each read once and written once), gradient excluded."""
    dtype, options = FORMS[form]
    d = args.dim
    table = 2 if dtype == torch.bfloat16 else 4
    state_dtype = options.get("state_dtype", torch.float32)
    element = {torch.float32: 4, torch.bfloat16: 2, torch.int8: 1}[state_dtype]
    scales = 4 * ((d + 255) // 256) if state_dtype == torch.int8 else 0
    first = element * d + scales
    second = 4 if options.get("rowwise_exp_avg_sq") else element * d + scales
    return 2 * unique * (table * d + first + second)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    forms = [f for f in args.forms.split(",") if f]
    unknown = set(forms) - set(FORMS)
    if unknown:
        raise SystemExit(f"unknown forms {sorted(unknown)}; choose from {list(FORMS)}")
    load = OtherLoad()
    report = {"machine": machine_info(threads=args.threads), "args": vars(args), "memory": {}, "step": {}}

    log("memory: each form alone, every row's state written")
    for form in forms:
        rss, allocated = memory(args, form)
        report["memory"][form] = {"rss_bytes_per_param": rss, "allocated_bytes_per_param": allocated}
        log(f"  {form:18s} RSS {rss:5.2f} B/param   allocated {allocated:5.2f} B/param")

    batches = zipf_batches(args.rows, args.batch, args.alpha, args.batches, seed=0)
    unique = sum(torch.unique(b).numel() for b in batches) / len(batches)
    # One mode at a time (every form's table alive at once, timed in
    # interleaved rounds): all sixteen together would not fit 24 GB.
    times = {}
    for fused in (False, True):
        contenders = {}
        for form in forms:
            emb, opt = build(args, form, fused)
            gen = torch.Generator().manual_seed(1)
            contenders[(form, fused)] = (emb, opt, torch.randn(args.batch, args.dim, generator=gen).to(emb.weight.dtype))
        # At least one pass over every distinct batch first: a row's state
        # is written (its pages faulted in, 2 MiB zeroed at a time) the
        # first time a batch holds it, which is not the step's cost (runs
        # with 3 warm-up steps of 8 batches timed fp32's unfused step at
        # 13-18 ms against 9 once warm).
        for emb, opt, grad in contenders.values():
            for i in range(max(args.warmup, len(batches))):
                step(emb, opt, batches[i % len(batches)], grad)
        keys = list(contenders)
        for key in keys:
            times[key] = []
        for r in range(args.rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for key in order:
                emb, opt, grad = contenders[key]
                ids = batches[(args.warmup + r) % len(batches)]
                t0 = time.perf_counter()
                step(emb, opt, ids, grad)
                times[key].append(time.perf_counter() - t0)
        del contenders, emb, opt, grad
        gc.collect()
    bandwidth = copy_bandwidth(256 << 20, 5, args.threads)
    report["copy_bandwidth_bytes_per_s"] = bandwidth["bytes_per_s"]
    report["copy_bandwidth_buffer_bytes"] = bandwidth["buffer_bytes"]
    report["unique_rows_per_batch"] = unique
    report["other_load_fraction"] = load.fraction()

    base = {fused: statistics_median(times[("fp32", fused)]) for fused in (False, True)} if "fp32" in forms else None
    log(f"\nstep on {args.rows:,} x {args.dim} rows, {args.batch:,} Zipf({args.alpha}) ids (~{unique:,.0f} unique), "
        f"{args.threads} threads; copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
    log(f"{'form':18s} {'B/param':>8s} {'unfused ms':>11s} {'x fp32':>7s} {'fused ms':>9s} {'x fp32':>7s} "
        f"{'state+rows MB/step':>19s}")
    for form in forms:
        entry = {}
        for fused in (False, True):
            summary = summarize_ms(times[(form, fused)])
            summary["speedup_vs_fp32"] = None if base is None else base[fused] / (summary["median_ms"] / 1e3)
            entry["fused" if fused else "unfused"] = summary
        entry["bytes_per_step"] = step_bytes(args, form, unique)
        report["step"][form] = entry
        u, f = entry["unfused"], entry["fused"]
        log(f"{form:18s} {report['memory'][form]['rss_bytes_per_param']:8.2f} {fmt_ms(u['median_ms']):>11s} "
            f"{_x(u['speedup_vs_fp32']):>7s} {fmt_ms(f['median_ms']):>9s} {_x(f['speedup_vs_fp32']):>7s} "
            f"{entry['bytes_per_step'] / 1e6:19.1f}")
    load_fraction = report["other_load_fraction"]
    log(f"other load: {'unknown' if load_fraction is None else f'{100 * load_fraction:.0f}%'} of the CPUs")
    write_json(args.out, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.out)),
                      result_rows(run_context("state_step", info=report["machine"]), report))
    log(f"wrote {args.out} and {path}")


def result_rows(ctx, report):
    """A run's report (its JSON) as result rows (benchmarks/_rows.py's
    schema): the host copy bandwidth; per form (the contender) its bytes a
    parameter (by RSS growth and as allocated), the weight and state bytes
    a step moves, and unfused and fused (workload "fused") the step time
    (median, min, max) and the speed against fp32's. recover_rows.py
    converts the committed runs' JSON with it too (their buffer size was
    not kept: null)."""
    args = report["args"]
    base = {k: args[k] for k in ("rows", "dim", "batch", "alpha", "batches", "warmup", "rounds", "threads")
            if k in args}

    def rows_of(workload, contender, figures):
        return [make_row(ctx, workload, contender, metric, value, unit)
                for metric, value, unit in figures if value is not None]

    rows = rows_of({"threads": args["threads"], "buffer_bytes": report.get("copy_bandwidth_buffer_bytes")},
                   "host copy (copy_)", [("bandwidth", report["copy_bandwidth_bytes_per_s"], "bytes/s")])
    for form, memory in report["memory"].items():
        rows += rows_of(base, form, [("bytes_per_parameter_rss", memory["rss_bytes_per_param"], "bytes"),
                                     ("bytes_per_parameter_allocated", memory["allocated_bytes_per_param"], "bytes")])
    for form, entry in report["step"].items():
        rows += rows_of(base, form, [("weight_and_state_traffic", entry["bytes_per_step"], "bytes/step")])
        for mode in ("unfused", "fused"):
            summary = entry[mode]
            figures = summary_figures("step_time", summary)
            rows += rows_of(dict(base, fused=mode == "fused"), form,
                            figures + [("speed_vs_fp32", summary["speedup_vs_fp32"], "x")])
    return rows


def statistics_median(seconds):
    return summarize_ms(seconds)["median_ms"] / 1e3


def _x(ratio):
    return "" if ratio is None else f"{ratio:.2f}x"


if __name__ == "__main__":
    main()
