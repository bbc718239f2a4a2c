"""One embedding training step on the CPU: hostembed against torch, on the same ids.

Contenders (torch's built one at a time and freed before the next; the
three hostembed ones built together and timed in interleaved rounds, each
round in a rotated order, so that their ratios do not depend on when the
shared machine was busy):
  * hostembed.Embedding + hostembed.SparseAdam
  * the same with SparseAdam(fused=True): the update runs in backward, from
    the output gradient, with no weight.grad (step() only ends the step)
  * fused, and the next batch's rows prefetched (Embedding.prefetch) right
    after each forward, so its gather overlaps this step's backward
  * torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam
  * torch.nn.Embedding (dense) + torch.optim.Adam (few steps: it updates the
    whole table every step), the same with Adam(fused=True), torch's
    fastest dense Adam, and with DeepSpeedCPUAdam where deepspeed imports
  * hostembed.Embedding + torch.optim.Adam: the plain swap, whose table
    step the core does over every row without a dense gradient (the same
    results as torch's dense Adam: checked before timing)

A step is forward(ids) -> out.backward(fixed gradient) -> optimizer.step()
-> optimizer.zero_grad(): no loss computation, so nearly all the time is the
embedding's. Before any hostembed step is timed, hostembed is checked against
torch SparseAdam: the same initial table and the same first batches must give
the same weights.

Usage (after `pip install .`, or an in-place build with PYTHONPATH=python):
    python benchmarks/cpu/cpu_step.py [--rows 2000000 --dim 128 ...]
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (DENSE_ADAM_WARMUP, GIB, RESULTS_DIR, OtherLoad, PeakRss, copy_bandwidth, fail,  # noqa: E402
                     fmt_ms, log, machine_info, progress, require_hostembed, summarize_ms, usable_cpus, write_json,
                     zipf_batches)

hostembed = require_hostembed()

CHECK_STEPS = 3    # batches both SparseAdams run before their weights are compared
PHASES = ("forward", "backward", "step", "zero_grad")
HOSTEMBED = "hostembed.Embedding + hostembed.SparseAdam"
HOSTEMBED_FUSED = "hostembed.Embedding + hostembed.SparseAdam(fused=True)"
HOSTEMBED_PREFETCH = "hostembed.Embedding + hostembed.SparseAdam(fused=True) + prefetch"
HOSTEMBEDS = (HOSTEMBED, HOSTEMBED_FUSED, HOSTEMBED_PREFETCH)
TORCH_SPARSE = "torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam"
TORCH_ADAM = "torch.nn.Embedding + torch.optim.Adam"
TORCH_ADAM_FUSED = "torch.nn.Embedding + torch.optim.Adam(fused=True)"
DEEPSPEED_ADAM = "torch.nn.Embedding + DeepSpeedCPUAdam"
SWAP_ADAM = "hostembed.Embedding + torch.optim.Adam (plain swap)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000, help="table rows N")
    p.add_argument("--dim", type=int, default=128, help="embedding dim D")
    p.add_argument("--batch", type=int, default=65_536, help="ids per batch B")
    p.add_argument("--alpha", type=float, default=1.15, help="Zipf exponent of the ids")
    p.add_argument("--steps", type=int, default=20, help="timed steps (sparse contenders)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before the timed ones (>= 1: the first allocates the optimizer state)")
    p.add_argument("--adam-steps", type=int, default=3, help="timed steps of dense Adam; 0 skips it")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the copy bandwidth ceiling")
    p.add_argument("--copy-repeats", type=int, default=5)
    p.add_argument("--skip-torch-sparse", action="store_true",
                   help="do not time torch SparseAdam (it still runs the correctness check)")
    p.add_argument("--json", default=os.path.join(RESULTS_DIR, "cpu_step.json"))
    args = p.parse_args(argv)
    if min(args.rows, args.dim, args.batch, args.steps, args.warmup, args.threads) < 1:
        p.error("--rows, --dim, --batch, --steps, --warmup and --threads must be >= 1")
    if args.adam_steps < 0:
        p.error("--adam-steps must be >= 0")
    return args


# --- contenders -----------------------------------------------------------------

def make_hostembed(args):
    emb = hostembed.Embedding(args.rows, args.dim)
    return emb, hostembed.SparseAdam(emb.parameters(), lr=args.lr)


def make_hostembed_fused(args):
    emb = hostembed.Embedding(args.rows, args.dim)
    return emb, hostembed.SparseAdam(emb.parameters(), lr=args.lr, fused=True)


def make_hostembed_prefetch(args):
    emb, opt = make_hostembed_fused(args)
    emb.prefetch_next = True  # read by train_step
    return emb, opt


def make_torch_sparse(args):
    emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
    return emb, torch.optim.SparseAdam(emb.parameters(), lr=args.lr)


def make_torch_adam(args):
    emb = torch.nn.Embedding(args.rows, args.dim)
    return emb, torch.optim.Adam(emb.parameters(), lr=args.lr)


def make_torch_adam_fused(args):
    emb = torch.nn.Embedding(args.rows, args.dim)
    return emb, torch.optim.Adam(emb.parameters(), lr=args.lr, fused=True)


def deepspeed_cpu_adam():
    """DeepSpeedCPUAdam, or None where deepspeed does not import or its op
    does not build."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam
    except Exception:
        return None


def make_deepspeed_adam(args):
    emb = torch.nn.Embedding(args.rows, args.dim)
    return emb, deepspeed_cpu_adam()(emb.parameters(), lr=args.lr, adamw_mode=False)


def make_swap_adam(args):
    emb = hostembed.Embedding(args.rows, args.dim)
    return emb, torch.optim.Adam(emb.parameters(), lr=args.lr)


# --- running a contender ---------------------------------------------------------

def build(make, args):
    # The same seed before every constructor: nn.Embedding and hostembed
    # draw their tables identically, so every contender starts from the same weights.
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    emb, opt = make(args)
    return emb, opt, time.perf_counter() - t0


def train_step(emb, opt, ids, grad_out, next_ids=None):
    """One step; returns the seconds of each phase (PHASES order). An
    embedding marked prefetch_next prefetches next_ids after its forward
    (counted in forward), and its prefetch is finished within the step
    (counted in zero_grad): in rounds, it must not overlap another
    contender's step."""
    t0 = time.perf_counter()
    out = emb(ids)
    if next_ids is not None and getattr(emb, "prefetch_next", False):
        emb.prefetch(next_ids)
    t1 = time.perf_counter()
    out.backward(grad_out)
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    opt.zero_grad()
    pending = getattr(getattr(emb, "_table", None), "prefetch", None)
    if pending is not None:
        pending._thread.join()
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def warm_up(emb, opt, batches, grad_out, desc):
    """Untimed steps; returns the first one's seconds (it allocates the optimizer state)."""
    first = None
    for i, ids in enumerate(progress(batches, desc)):
        seconds = sum(train_step(emb, opt, ids, grad_out, batches[i + 1] if i + 1 < len(batches) else None))
        first = seconds if first is None else first
    return first


def timed_steps(emb, opt, batches, grad_out, desc, peak):
    return timed_rounds({desc: (emb, opt)}, batches, grad_out, desc, peak)[desc]


def timed_rounds(contenders, batches, grad_out, desc, peak):
    """Every contender ({name: (emb, opt)}) steps on each batch in turn, the
    order rotated each round. The peak RSS window covers them all."""
    peak.start()
    names = list(contenders)
    per_phase = {n: {name: [] for name in PHASES} for n in names}
    totals = {n: [] for n in names}
    for i, ids in enumerate(progress(batches, desc)):
        next_ids = batches[i + 1] if i + 1 < len(batches) else None
        for n in names[i % len(names):] + names[:i % len(names)]:
            phases = train_step(*contenders[n], ids, grad_out, next_ids)
            for name, seconds in zip(PHASES, phases):
                per_phase[n][name].append(seconds)
            totals[n].append(sum(phases))
    window = peak.window()
    results = {}
    for n in names:
        result = summarize_ms(totals[n])
        result["steps_per_s"] = 1e3 / result["median_ms"]
        result["phases_median_ms"] = {name: summarize_ms(s)["median_ms"] for name, s in per_phase[n].items()}
        result["step_ms"] = [s * 1e3 for s in totals[n]]
        result["peak_rss_bytes_timed"] = window
        results[n] = result
    return results


# --- correctness -------------------------------------------------------------------

def check_same_start(weight, reference):
    if not torch.equal(weight.detach(), reference):
        fail("hostembed.Embedding and torch.nn.Embedding built after the same torch.manual_seed "
             "have different initial tables, so the comparison below would mean nothing")


def check_same_weights(weight, reference, block_rows=1 << 16):
    # Block by block: assert_close on a whole table would make several
    # table-sized temporaries and double the peak memory of the run.
    weight = weight.detach()
    max_abs_diff, bitwise_equal = 0.0, True
    for start in range(0, weight.shape[0], block_rows):
        got, want = weight[start:start + block_rows], reference[start:start + block_rows]
        try:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            fail(f"after the same {CHECK_STEPS} batches from the same table, hostembed.SparseAdam's "
                 f"weights differ from torch.optim.SparseAdam's in rows [{start}, {start + len(got)}) "
                 f"(indices below are relative to row {start}):\n{err}")
        if got.numel():
            max_abs_diff = max(max_abs_diff, (got - want).abs_().max().item())
        bitwise_equal = bitwise_equal and torch.equal(got, want)
    return {"steps": CHECK_STEPS, "rtol": 1e-5, "atol": 1e-6, "passed": True,
            "bitwise_equal": bitwise_equal, "max_abs_diff": max_abs_diff}


# --- the benchmark -------------------------------------------------------------------

def correctness_check(args, batches, grad_out):
    """Fails loudly unless hostembed, from the same table as torch SparseAdam,
    ends the same first batches with the same weights.

    The two run one after the other, torch leaving two snapshots of its
    table (before and after), so the check needs about one contender + 2 tables.
    """
    log(f"correctness check: {CHECK_STEPS} steps of torch SparseAdam, then of hostembed")
    emb, opt, _ = build(make_torch_sparse, args)
    initial = emb.weight.detach().clone()
    warm_up(emb, opt, batches[:CHECK_STEPS], grad_out, "check: torch sparse")
    reference = emb.weight.detach().clone()
    del emb, opt
    gc.collect()

    result = {}
    for name, make in ((HOSTEMBED, make_hostembed), (HOSTEMBED_FUSED, make_hostembed_fused),
                       (HOSTEMBED_PREFETCH, make_hostembed_prefetch)):
        emb, opt, _ = build(make, args)
        check_same_start(emb.weight, initial)
        warm_up(emb, opt, batches[:CHECK_STEPS], grad_out, f"check: {name}")
        result[name] = check_same_weights(emb.weight, reference)
        del emb, opt
        gc.collect()
    for name in (HOSTEMBED_FUSED, HOSTEMBED_PREFETCH):
        if result[name]["bitwise_equal"] != result[HOSTEMBED]["bitwise_equal"] or \
                result[name]["max_abs_diff"] != result[HOSTEMBED]["max_abs_diff"]:
            fail(f"{name} did not reach the same weights as the unfused step")
    if args.adam_steps:
        result[SWAP_ADAM] = check_swap_adam(args, batches, grad_out)
    return result


def check_swap_adam(args, batches, grad_out):
    """The plain swap's Adam against torch's dense Adam from the same table
    over the first batches: within 8 float32 roundings of each weight (or
    1e-4 lr near 0). torch's CPU sqrt is not correctly rounded, the core's
    is, so not always the same bits (tests/test_torch_optimizers.py bounds
    both against a float64 run)."""
    log(f"correctness check: {CHECK_STEPS} steps of torch dense Adam, then of the plain swap")
    results = []
    for make in (make_torch_adam, make_swap_adam):
        emb, opt, _ = build(make, args)
        warm_up(emb, opt, batches[:CHECK_STEPS], grad_out, "check: Adam")
        results.append(emb.weight.detach().clone())
        del emb, opt
        gc.collect()
    reference, weight = results
    eps = torch.finfo(torch.float32).eps
    worst = ((weight - reference).abs() / (8 * eps * reference.abs() + 1e-4 * args.lr)).max().item()
    if worst > 1:
        fail(f"the plain swap's Adam is {worst:.2f}x the allowed distance from torch's dense Adam")
    return {"steps": CHECK_STEPS, "passed": True, "bitwise_equal": torch.equal(weight, reference),
            "worst_fraction_of_bound": worst}


def run_contender(name, make, args, warm, timed, grad_out, peak):
    """Builds a contender, warms it up, times it and frees it before the next."""
    log(f"{name}: building, {len(warm)} warm-up steps, {len(timed)} timed steps")
    emb, opt, build_s = build(make, args)
    # Over warm-up and timed steps: CPU accounting ticks at 10 ms, too coarse for the timed steps alone.
    other_load = OtherLoad()
    first_s = warm_up(emb, opt, warm, grad_out, f"{name} warm-up")
    result = timed_steps(emb, opt, timed, grad_out, name, peak)
    result.update(build_s=build_s, first_step_ms=first_s * 1e3,
                  cpu_fraction_used_by_others=other_load.fraction())
    del emb, opt
    gc.collect()
    return result


def run_hostembed_rounds(args, warm, timed, grad_out, peak):
    """The hostembed contenders, built together and timed in rounds."""
    makes = ((HOSTEMBED, make_hostembed), (HOSTEMBED_FUSED, make_hostembed_fused),
             (HOSTEMBED_PREFETCH, make_hostembed_prefetch))
    built, extra = {}, {}
    other_load = OtherLoad()
    for name, make in makes:
        log(f"{name}: building, {len(warm)} warm-up steps")
        emb, opt, build_s = build(make, args)
        first_s = warm_up(emb, opt, warm, grad_out, f"{name} warm-up")
        built[name] = (emb, opt)
        extra[name] = {"build_s": build_s, "first_step_ms": first_s * 1e3}
    log(f"hostembed contenders: {len(timed)} timed rounds")
    results = timed_rounds(built, timed, grad_out, "hostembed rounds", peak)
    others = other_load.fraction()
    for name in results:
        results[name].update(extra[name], cpu_fraction_used_by_others=others, timed_in_rounds=True)
    del built, emb, opt
    gc.collect()
    return results


def run_contenders(args, batches, grad_out, peak):
    # All contenders time the same ids; dense Adam only the first few of them
    # and after one warm-up step, as each of its steps costs seconds.
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    results = run_hostembed_rounds(args, warm, timed[:args.steps], grad_out, peak)
    if args.skip_torch_sparse:
        results[TORCH_SPARSE] = {"skipped": "--skip-torch-sparse"}
    else:
        results[TORCH_SPARSE] = run_contender(TORCH_SPARSE, make_torch_sparse, args, warm, timed[:args.steps],
                                              grad_out, peak)
    for name, make in ((TORCH_ADAM, make_torch_adam), (TORCH_ADAM_FUSED, make_torch_adam_fused),
                       (DEEPSPEED_ADAM, make_deepspeed_adam), (SWAP_ADAM, make_swap_adam)):
        if args.adam_steps == 0:
            results[name] = {"skipped": "--adam-steps 0"}
        elif name == DEEPSPEED_ADAM and deepspeed_cpu_adam() is None:
            results[name] = {"skipped": "deepspeed not installed"}
        else:
            results[name] = run_contender(name, make, args, warm[:DENSE_ADAM_WARMUP], timed[:args.adam_steps],
                                          grad_out, peak)
    return results


def hostembed_bandwidth(args, unique_mean, step_ms, copy_bps):
    # The issue's bound: SparseAdam reads w, m, v, g and writes w, m, v for
    # each of the u x D updated elements (7 x 4 bytes); the gather reads and
    # writes each of the B x D looked-up elements (2 x 4 bytes).
    nbytes = 28 * unique_mean * args.dim + 8 * args.batch * args.dim
    achieved = nbytes / (step_ms / 1e3)
    return {"bytes_per_step": nbytes, "achieved_bytes_per_s": achieved,
            "fraction_of_copy_bandwidth": achieved / copy_bps}


def speedups(contenders, ours):
    he = contenders[ours]["median_ms"]
    return {name: r["median_ms"] / he for name, r in contenders.items()
            if name not in HOSTEMBEDS and "median_ms" in r}


# --- report ------------------------------------------------------------------------------

def print_report(args, report):
    contenders = report["contenders"]
    ts = contenders[TORCH_SPARSE]
    print(f"## CPU training step: N={args.rows:,} rows, D={args.dim}, batch {args.batch:,} ids "
          f"Zipf({args.alpha}), {report['machine']['threads']} threads\n")
    print("| contender | ms/step median | min | max | steps | steps/s | speedup vs torch SparseAdam "
          "| CPU taken by other processes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in contenders.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | | | | |")
            continue
        vs = f"{ts['median_ms'] / r['median_ms']:.2f}x" if "median_ms" in ts else "n/a"
        others = r["cpu_fraction_used_by_others"]
        print(f"| {name} | {fmt_ms(r['median_ms'])} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['max_ms'])} "
              f"| {r['n']} | {r['steps_per_s']:.2f} | {vs} | {'n/a' if others is None else f'{others:.0%}'} |")

    print("\nPhase medians, ms (first untimed step, which allocates the optimizer state, in the last column):\n")
    print("| contender | forward | backward | optimizer step | zero_grad | first step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in contenders.items():
        if "skipped" not in r:
            ph = r["phases_median_ms"]
            print(f"| {name} | " + " | ".join(fmt_ms(ph[p]) for p in PHASES) + f" | {fmt_ms(r['first_step_ms'])} |")

    print()
    for ours in HOSTEMBEDS:
        for name, ratio in report["speedups"][ours].items():
            print(f"{ours} speedup over {name}: {ratio:.2f}x (ratio of medians)")
    u, cp = report["unique_ids"], report["copy_bandwidth"]
    print(f"unique ids per batch u: mean {u['mean']:,.0f} (min {u['min']:,}, max {u['max']:,}) "
          f"= {u['mean'] / args.batch:.1%} of the batch")
    single = cp.get("single_thread")
    best, before, after = cp["all_threads"], cp["all_threads_before"], cp["all_threads_after"]
    print(f"host copy bandwidth (read + write, {best['buffer_bytes'] / GIB:.2f} GiB dst.copy_(src), median of "
          f"{best['repeats']}): {best['bytes_per_s'] / 1e9:.2f} GB/s with {best['threads']} threads (best of before "
          f"{before['bytes_per_s'] / 1e9:.2f} and after {after['bytes_per_s'] / 1e9:.2f} the contenders)"
          + (f", {single['bytes_per_s'] / 1e9:.2f} GB/s with 1 thread" if single else ""))
    for ours in HOSTEMBEDS:
        bw = report["bandwidth"][ours]
        print(f"{ours}: bytes/step (28*u*D + 8*B*D) {bw['bytes_per_step'] / 1e6:.1f} MB -> "
              f"{bw['achieved_bytes_per_s'] / 1e9:.2f} GB/s achieved = "
              f"{bw['fraction_of_copy_bandwidth']:.1%} of the copy bandwidth")
    for ours in HOSTEMBEDS:
        chk = report["correctness"][ours]
        print(f"correctness: {ours} matches torch SparseAdam after {chk['steps']} steps from the same table "
              f"(max abs diff {chk['max_abs_diff']:.3g}, bitwise equal: {chk['bitwise_equal']})")
    if SWAP_ADAM in report["correctness"]:
        chk = report["correctness"][SWAP_ADAM]
        print(f"correctness: {SWAP_ADAM} within {chk['worst_fraction_of_bound']:.2f} of its bound from torch's "
              f"dense Adam after {chk['steps']} steps (bitwise equal: {chk['bitwise_equal']})")
    if "swap_adam_step" in report:
        bw = report["swap_adam_step"]
        print(f"{SWAP_ADAM}: its optimizer step moves {bw['bytes_per_step'] / 1e6:,.0f} MB (24 bytes a parameter: w, "
              f"m, v read and written) at {bw['achieved_bytes_per_s'] / 1e9:.2f} GB/s = "
              f"{bw['fraction_of_copy_bandwidth']:.1%} of the copy bandwidth")
    rss = report["peak_rss_bytes"]
    rounds = [r for r in contenders.values() if r.get("timed_in_rounds") and r.get("peak_rss_bytes_timed")]
    parts = [f"the {len(rounds)} hostembed contenders together {rounds[0]['peak_rss_bytes_timed'] / GIB:.2f} GiB"
             ] if rounds else []
    parts += [f"{name.split(' + ')[1]} {r['peak_rss_bytes_timed'] / GIB:.2f} GiB" for name, r in contenders.items()
              if r.get("peak_rss_bytes_timed") and not r.get("timed_in_rounds")]
    per = ", ".join(parts)
    print(f"peak RSS: process {rss / GIB:.2f} GiB" + (f"; during timed steps: {per}" if per else ""))
    others = report["other_load"]["cpu_fraction_used_by_others"]
    if others is not None:
        note = " -- timings are noisy, rerun on an idle machine" if others > 0.05 else ""
        print(f"other processes used {others:.0%} of the CPUs during the run{note}")
    print(f"JSON: {args.json}")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    peak = PeakRss()
    other_load = OtherLoad()

    count = max(CHECK_STEPS, args.warmup + max(args.steps, args.adam_steps))
    log(f"generating {count} batches of {args.batch:,} ids")
    batches = zipf_batches(args.rows, args.batch, args.alpha, count, args.seed)
    unique = [int(torch.unique(b).numel()) for b in batches[args.warmup:args.warmup + args.steps]]
    # A fixed output gradient stands in for the rest of the model at no cost.
    grad_out = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(args.seed + 1))

    log("measuring host copy bandwidth")
    copy_bytes = args.copy_mib << 20
    copy = {"all_threads_before": copy_bandwidth(copy_bytes, args.copy_repeats, args.threads)}
    if args.threads > 1:
        copy["single_thread"] = copy_bandwidth(copy_bytes, args.copy_repeats, 1)

    # Checked before anything is timed: a fast wrong answer is not a result.
    check = correctness_check(args, batches, grad_out)
    contenders = run_contenders(args, batches, grad_out, peak)

    # Measured again after the contenders: on a shared machine a single
    # window can be disturbed, and noise only ever lowers a ceiling.
    log("measuring host copy bandwidth again")
    copy["all_threads_after"] = copy_bandwidth(copy_bytes, args.copy_repeats, args.threads)
    copy["all_threads"] = max(copy["all_threads_before"], copy["all_threads_after"], key=lambda c: c["bytes_per_s"])

    unique_stats = {"mean": sum(unique) / len(unique), "min": min(unique), "max": max(unique)}
    report = {
        "machine": machine_info(threads=args.threads, torch_threads=torch.get_num_threads(),
                                hostembed_threads=hostembed.get_num_threads()),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "unique_ids": unique_stats,
        "copy_bandwidth": copy,
        "contenders": contenders,
        "speedups": {ours: speedups(contenders, ours) for ours in HOSTEMBEDS},
        "bandwidth": {ours: hostembed_bandwidth(args, unique_stats["mean"], contenders[ours]["median_ms"],
                                                copy["all_threads"]["bytes_per_s"]) for ours in HOSTEMBEDS},
        "correctness": check,
    }
    swap = contenders.get(SWAP_ADAM, {})
    if "phases_median_ms" in swap:
        nbytes = 24 * args.rows * args.dim
        achieved = nbytes / (swap["phases_median_ms"]["step"] / 1e3)
        report["swap_adam_step"] = {"bytes_per_step": nbytes, "achieved_bytes_per_s": achieved,
                                    "fraction_of_copy_bandwidth": achieved / copy["all_threads"]["bytes_per_s"]}
    peak.window()
    report["peak_rss_bytes"] = peak.overall
    report["other_load"] = {"loadavg_before": other_load.loadavg_before,
                            "cpu_fraction_used_by_others": other_load.fraction()}

    write_json(args.json, report)
    print_report(args, report)


if __name__ == "__main__":
    main()
