"""The GPU path: PCIe ceilings, the zero-copy gather, and training steps.

  (a) ceilings: pinned host -> GPU and GPU -> host cudaMemcpy bandwidth
  (b) gather kernel: --gather-rows random unique rows straight from pinned
      host memory, for each D; GB/s and % of the H2D ceiling
  (c) training step, table in host memory: D=128 fp32, --batch lookups
      Zipf(--alpha) over a permutation of --rows rows (default 60M: table +
      Adam state ~92 GB, more than an 80 GB GPU holds), SparseAdam with the
      update on the GPU, on the CPU, and fused into backward (on the GPU); %
      of the PCIe bound of each mode
  (d) side by side on a table that fits the GPU (--fit-rows): hostembed
      (table in host memory) vs torch nn.Embedding(sparse=True) +
      torch.optim.SparseAdam entirely on the GPU, same batches

Every figure is checked first: the gather against the table's rows, and
(d)'s hostembed against torch after a few steps from the same table. The
figures go to --json and, as result rows (result_rows), to rows.jsonl
beside it.

Usage (on a machine with a GPU, after `pip install .` or an in-place build with PYTHONPATH=python):
    python benchmarks/gpu/gpu.py [--rows 60000000 --steps 20 ...]
"""
import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (GIB, ZipfIds, fail, figure_rows, fmt_ms, log, machine_info,  # noqa: E402
                     mem_available_bytes, require_hostembed, run_context, run_folder, summarize_ms,
                     summary_figures, write_json, write_rows)

hostembed = require_hostembed()
from hostembed._core import _C  # noqa: E402  (after the build check above)
from hostembed._core.table import HostTable  # noqa: E402
from hostembed.optim.update_choice import UpdateChooser  # noqa: E402

import numpy as np  # noqa: E402

ADAM_STATE_FACTOR = 3  # weight + exp_avg + exp_avg_sq


def int_list(text):
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pcie-mib", type=int, default=1024, help="(a) bytes per copy")
    p.add_argument("--dims", type=int_list, default=[16, 32, 64, 128, 256, 512], help="(b) embedding dims D")
    p.add_argument("--gather-rows", type=int, default=400_000, help="(b) unique rows per gather")
    p.add_argument("--gather-table-mib", type=int, default=4096, help="(b) host table size")
    p.add_argument("--rows", type=int, default=60_000_000, help="(c) table rows")
    p.add_argument("--dim", type=int, default=128, help="(c), (d) embedding dim D")
    p.add_argument("--batch", type=int, default=1_050_000, help="(c), (d) lookups per step")
    p.add_argument("--alpha", type=float, default=1.05, help="(c), (d) Zipf exponent")
    p.add_argument("--batches", type=int, default=8, help="(c), (d) distinct batches, cycled")
    p.add_argument("--fit-rows", type=int, default=5_000_000, help="(d) table rows (must fit the GPU for torch)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1: state allocation)")
    p.add_argument("--repeats", type=int, default=10, help="(a), (b) timed repeats")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: ceilings,gather,train,fit")
    p.add_argument("--json", default=os.path.join(run_folder("cuda" if torch.cuda.is_available() else "cpu"), "gpu.json"))
    args = p.parse_args(argv)
    if min(args.pcie_mib, args.gather_rows, args.rows, args.dim, args.batch, args.batches, args.fit_rows,
           args.steps, args.warmup, args.repeats) < 1 or not args.dims:
        p.error("sizes, --steps, --warmup and --repeats must be >= 1")
    args.skip = {s for s in args.skip.split(",") if s}
    unknown = args.skip - {"ceilings", "gather", "train", "fit"}
    if unknown:
        p.error(f"--skip: unknown parts {sorted(unknown)}")
    return args


def cuda_seconds(fn, repeats):
    """Seconds of each of `repeats` fn() calls by CUDA events, after one
    untimed call."""
    fn()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def rate(seconds, nbytes):
    median = statistics.median(seconds)
    return {"median_ms": median * 1e3, "bytes": nbytes, "bytes_per_s": nbytes / median,
            "all_ms": [s * 1e3 for s in seconds]}


# --- (a) ------------------------------------------------------------------------------------

def ceilings(args):
    nbytes = args.pcie_mib << 20
    # A benchmark buffer, so torch's pinned allocator is fine here (the
    # table itself is never pinned that way).
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {
        "h2d": rate(cuda_seconds(lambda: gpu.copy_(host, non_blocking=True), args.repeats), nbytes),
        "d2h": rate(cuda_seconds(lambda: host.copy_(gpu, non_blocking=True), args.repeats), nbytes),
    }
    return result


# --- (b) ------------------------------------------------------------------------------------

def gather_curve(args, h2d_bps):
    floats = (args.gather_table_mib << 20) // 4
    device = torch.device("cuda", torch.cuda.current_device())
    host = HostTable(1, floats, first_touch=True)
    table = host.tensor[0]
    base = host.device_address(table, device)  # pins and maps it
    if base is None:
        fail("the gather table could not be registered with CUDA (see the warning above)")
    # Distinct values (in chunks: one float64 arange of the whole table
    # would need twice its size), so a wrong row cannot pass the check.
    chunk = 1 << 25
    for start in range(0, floats, chunk):
        end = min(start + chunk, floats)
        table[start:end] = torch.arange(start, end, dtype=torch.float64).remainder_(16_777_213).float()
    stream = torch.cuda.current_stream(device)
    points = []
    for dim in args.dims:
        rows = floats // dim
        if rows < args.gather_rows:
            fail(f"--gather-table-mib too small: {rows:,} rows of D={dim} < --gather-rows {args.gather_rows:,}")
        view = table[: rows * dim].view(rows, dim)
        ids = torch.randperm(rows)[: args.gather_rows].to(device)
        out = torch.empty(args.gather_rows, dim, device=device)

        def gather():
            _C.cuda_gather(table=host.buffer, num_rows=rows, dim=dim, rows=ids.data_ptr(), count=ids.numel(), out=out.data_ptr(),
                           device=device.index, stream=stream.cuda_stream)

        gather()
        torch.cuda.synchronize()
        if not torch.equal(out.cpu(), view[ids.cpu()]):
            fail(f"gather kernel returned wrong rows for D={dim}")
        nbytes = args.gather_rows * dim * 4
        point = {"dim": dim, "rows": args.gather_rows, **rate(cuda_seconds(gather, args.repeats), nbytes)}
        point["of_h2d"] = point["bytes_per_s"] / h2d_bps if h2d_bps else None
        points.append(point)
        log(f"gather D={dim}: {point['bytes_per_s'] / 1e9:.1f} GB/s")
    del table
    return points


# --- (c), (d) -------------------------------------------------------------------------------

def make_batches(rows, args, device):
    ids = ZipfIds(rows, args.alpha, np.random.default_rng(args.seed))
    batches = [ids.draw(args.batch).to(device) for _ in range(args.batches)]
    del ids
    gen = torch.Generator(device=device).manual_seed(args.seed)
    grad_out = torch.randn(args.batch, args.dim, generator=gen, device=device)
    unique = [int(torch.unique(b).numel()) for b in batches]
    return batches, grad_out, unique


def step(emb, opt, ids, grad_out):
    emb(ids).backward(grad_out)
    opt.step()
    opt.zero_grad()


def phased_step(emb, opt, ids, grad_out):
    """One step with a device sync after each phase: seconds of forward,
    backward (the update too, fused), step()."""
    sync = torch.cuda.synchronize
    t0 = time.perf_counter()
    out = emb(ids)
    sync()
    t1 = time.perf_counter()
    out.backward(grad_out)
    sync()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    sync()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def time_steps(emb, opt, batches, grad_out, args, desc, warmup=None):
    """Medians of whole steps (no sync inside), then of each phase over as
    many steps again (a sync after each phase)."""
    warmup = args.warmup if warmup is None else warmup
    for i in range(warmup):
        step(emb, opt, batches[i % len(batches)], grad_out)
    torch.cuda.synchronize()
    if isinstance(emb, hostembed.Embedding) and (emb._last_lookup_path != "gpu" or not emb.weight.is_pinned()):
        fail(f"{desc}: the lookups took the {emb._last_lookup_path} path on a table pinned: "
             f"{emb.weight.is_pinned()}, not the GPU kernels on a pinned table (see any warning above)")
    seconds = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(emb, opt, batches[(warmup + i) % len(batches)], grad_out)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    r = summarize_ms(seconds)
    phases = [phased_step(emb, opt, batches[(warmup + args.steps + i) % len(batches)], grad_out)
              for i in range(args.steps)]
    for k, name in enumerate(("forward", "backward", "step")):
        r[f"{name}_ms"] = statistics.median(p[k] for p in phases) * 1e3
    log(f"{desc}: {fmt_ms(r['median_ms'])} ms/step (forward {r['forward_ms']:.2f}, backward "
        f"{r['backward_ms']:.2f}, step {r['step_ms']:.2f})")
    return r


def pcie_bound_ms(mode, unique_mean, dim, ceil):
    """The step's PCIe transfers at the measured ceilings, directions in
    parallel (full duplex): the gather reads u rows, backward copies u grad
    rows back; the GPU update reads and writes w, m, v (3 rows each way).
    Fused, the gradient stays on the GPU: no grad rows back."""
    row = unique_mean * dim * 4
    h2d, d2h = {"cpu": (row, row), "gpu": (4 * row, 4 * row), "fused": (4 * row, 3 * row)}[mode]
    return max(h2d / ceil["h2d"]["bytes_per_s"], d2h / ceil["d2h"]["bytes_per_s"]) * 1e3


class _UninitialisedEmbedding(hostembed.Embedding):
    """Keeps the zeros of a fresh table: the values do not change the timing,
    and torch's normal_ fills 7.7G values at ~130M/s on one thread."""

    def reset_parameters(self):
        pass


def host_table(rows, args, initialise=True):
    cls = hostembed.Embedding if initialise else _UninitialisedEmbedding
    # Pinned (registered with CUDA) at its first GPU lookup: time_steps
    # checks that the lookups took the kernels.
    return cls(rows, args.dim, device="cuda")


def train_large(args, ceil):
    need = ADAM_STATE_FACTOR * args.rows * args.dim * 4
    avail = mem_available_bytes()
    if avail is not None and need > 0.9 * avail:
        fail(f"--rows {args.rows:,}: table + Adam state need {need / GIB:.1f} GiB, the host has "
             f"{avail / GIB:.1f} GiB available; pass a smaller --rows")
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    emb = host_table(args.rows, args, initialise=False)
    setup_s = time.perf_counter() - t0
    batches, grad_out, unique = make_batches(args.rows, args, device)
    opt = hostembed.SparseAdam(emb.parameters(), lr=args.lr, update="gpu")
    result = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "alpha": args.alpha,
              "table_and_state_bytes": need, "table_setup_s": setup_s,
              "unique_mean": statistics.mean(unique), "unique": unique, "modes": {}}
    for mode in ("gpu", "cpu", "auto", "fused"):
        # One set of moments throughout: a second would pin another 2 x table.
        warmup = None
        if mode == "fused":
            fused = hostembed.SparseAdam(emb.parameters(), lr=args.lr, update="gpu", fused=True)
            fused.state = opt.state
            opt = fused
        else:
            opt.update = mode
        if mode == "auto":
            emb._table.update_chooser = None  # times both afresh
            chooser = UpdateChooser
            warmup = max(args.warmup, 2 * (chooser.WARMUP + chooser.TRIALS) + 1)
        r = time_steps(emb, opt, batches, grad_out, args, f"train {args.rows:,} rows, update={mode}", warmup)
        expected = {"fused": "gpu", "auto": None}.get(mode, mode)
        if mode == "auto":
            chooser = emb._table.update_chooser
            if chooser is None or not chooser.settled:
                fail(f"update=auto had not settled after {warmup} steps")
            r["auto_choice"] = expected = chooser.choice
            r["auto_trial_ms"] = {m: [x * 1e3 for x in s] for m, s in chooser.seconds.items()}
        if opt._last_update != expected:
            fail(f"update={mode} ran its step on the {opt._last_update}")
        if mode == "fused" and emb.weight.grad is not None:
            fail("SparseAdam(fused=True) left a weight.grad: the update did not run in backward")
        bound = pcie_bound_ms(r.get("auto_choice", mode), result["unique_mean"], args.dim, ceil) if ceil else None
        r["pcie_bound_ms"] = bound
        r["of_pcie_bound"] = bound / r["median_ms"] if bound else None
        result["modes"][mode] = r
    del emb, opt, batches
    gc.collect()
    return result


def side_by_side(args):
    device = torch.device("cuda", torch.cuda.current_device())
    batches, grad_out, unique = make_batches(args.fit_rows, args, device)
    torch.manual_seed(args.seed)
    ours = host_table(args.fit_rows, args)
    opt = hostembed.SparseAdam(ours.parameters(), lr=args.lr)
    torch.manual_seed(args.seed)
    ref = torch.nn.Embedding(args.fit_rows, args.dim, sparse=True).to(device)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=args.lr)
    if not torch.equal(ours.weight, ref.weight.detach().cpu()):
        fail("hostembed and torch did not start from the same table")
    check_steps = 2
    for i in range(check_steps):
        step(ours, opt, batches[i], grad_out)
        step(ref, ref_opt, batches[i], grad_out)
    # Same updates up to the order in which duplicate ids' gradients are
    # summed. Adam's first steps move an element by about lr * sign(g), so
    # an element whose gradient is within rounding of zero may move the
    # other way (a few in hundreds of millions): bound the count of those,
    # and every difference by the steps' size.
    diff = (ours.weight.detach() - ref.weight.detach().cpu()).abs()
    max_diff = diff.max().item()
    far = int((diff > 1e-6).sum())
    del diff
    if far > 1e-6 * ours.weight.numel() or max_diff > 2.5 * args.lr * check_steps:
        fail(f"hostembed and torch differ after {check_steps} steps: {far} elements by more than 1e-6, "
             f"max {max_diff:.3g}")
    result = {"rows": args.fit_rows, "dim": args.dim, "batch": args.batch, "unique_mean": statistics.mean(unique),
              "check": {"steps": check_steps, "max_abs_diff": max_diff, "elements_off_by_1e-6": far}}
    result["hostembed"] = time_steps(ours, opt, batches, grad_out, args, "fit: hostembed")
    fused = hostembed.SparseAdam(ours.parameters(), lr=args.lr, update="gpu", fused=True)
    fused.state = opt.state  # the same moments, continuing
    result["hostembed_fused"] = time_steps(ours, fused, batches, grad_out, args, "fit: hostembed fused")
    if ours.weight.grad is not None:
        fail("SparseAdam(fused=True) left a weight.grad: the update did not run in backward")
    del ours, opt, fused
    gc.collect()
    result["torch"] = time_steps(ref, ref_opt, batches, grad_out, args, "fit: torch on the GPU")
    del ref, ref_opt
    torch.cuda.empty_cache()
    return result


# --- report ---------------------------------------------------------------------------------

def print_report(args, report):
    gpu = report["machine"]["gpu"]
    print(f"## hostembed GPU path on {gpu['name'] if gpu else 'no GPU'}\n")
    ceil = report.get("ceilings")
    if ceil:
        print(f"PCIe ceilings (pinned cudaMemcpy, {args.pcie_mib} MiB): H2D {ceil['h2d']['bytes_per_s'] / 1e9:.1f} GB/s, "
              f"D2H {ceil['d2h']['bytes_per_s'] / 1e9:.1f} GB/s\n")
    if report.get("gather"):
        print(f"Gather kernel, {args.gather_rows:,} random unique rows from pinned host memory:\n")
        print("| D | ms | GB/s | % of H2D |")
        print("|---:|---:|---:|---:|")
        for p in report["gather"]:
            share = f"{p['of_h2d']:.0%}" if p["of_h2d"] else "n/a"
            print(f"| {p['dim']} | {p['median_ms']:.2f} | {p['bytes_per_s'] / 1e9:.1f} | {share} |")
        print()
    train = report.get("train")
    if train:
        print(f"Training step, table in host memory: {train['rows']:,} rows x D={train['dim']} "
              f"({train['table_and_state_bytes'] / GIB:.1f} GiB with Adam state), {train['batch']:,} lookups "
              f"Zipf({train['alpha']}), {train['unique_mean']:,.0f} unique rows per step:\n")
        print("| update | ms/step median | min | max | forward | backward | step() | PCIe bound ms | % of bound |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mode, r in train["modes"].items():
            bound = f"{r['pcie_bound_ms']:.2f}" if r["pcie_bound_ms"] else "n/a"
            share = f"{r['of_pcie_bound']:.0%}" if r["of_pcie_bound"] else "n/a"
            name = f"auto (chose {r['auto_choice']})" if "auto_choice" in r else mode
            print(f"| {name} | {fmt_ms(r['median_ms'])} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['max_ms'])} "
                  f"| {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['step_ms']:.2f} | {bound} | {share} |")
        print()
    fit = report.get("fit")
    if fit:
        print(f"Side by side, {fit['rows']:,} rows x D={fit['dim']} (fits the GPU), {fit['batch']:,} lookups, "
              f"{fit['unique_mean']:,.0f} unique rows per step:\n")
        print("| contender | ms/step median | min | max |")
        print("|---|---:|---:|---:|")
        for name, key in (("hostembed (table in host memory)", "hostembed"),
                          ("hostembed, SparseAdam(fused=True)", "hostembed_fused"),
                          ("torch nn.Embedding(sparse=True) + SparseAdam on the GPU", "torch")):
            r = fit[key]
            print(f"| {name} | {fmt_ms(r['median_ms'])} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['max_ms'])} |")
        chk = fit["check"]
        print(f"\ncorrectness: after {chk['steps']} steps from the same table, max |hostembed - torch| = "
              f"{chk['max_abs_diff']:.3g}, {chk['elements_off_by_1e-6']} elements off by more than 1e-6")
    print(f"JSON: {args.json}")


def main(argv=None):
    args = parse_args(argv)
    if not hostembed.cuda_available():
        from hostembed._core.cuda import unavailable_reason
        sys.exit(f"benchmarks/gpu/gpu.py: the GPU path cannot run here: {unavailable_reason()}")
    report = {"machine": machine_info(), "args": {k: (sorted(v) if isinstance(v, set) else v)
                                                   for k, v in vars(args).items()}}
    ceil = None
    if "ceilings" not in args.skip:
        ceil = report["ceilings"] = ceilings(args)
    if "gather" not in args.skip:
        report["gather"] = gather_curve(args, ceil["h2d"]["bytes_per_s"] if ceil else None)
    if "train" not in args.skip:
        report["train"] = train_large(args, ceil)
    if "fit" not in args.skip:
        report["fit"] = side_by_side(args)
    write_json(args.json, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                      result_rows(run_context("gpu", device="cuda", info=report["machine"]), report))
    print_report(args, report)
    log(f"wrote {args.json} and {path}")


# --- result rows ------------------------------------------------------------------------------

TRAIN_CONTENDERS = {"gpu": "hostembed, update on the GPU", "cpu": "hostembed, update on the CPU",
                    "auto": 'hostembed, update="auto"', "fused": "hostembed, fused (GPU update in backward)"}
FIT_CONTENDERS = {"hostembed": "hostembed", "hostembed_fused": "hostembed, fused",
                  "torch": "torch nn.Embedding(sparse=True) on the GPU + SparseAdam"}
GATHER_CONTENDER = "hostembed gather kernel (pinned host memory)"


def result_rows(ctx, report):
    """A run's report (its JSON) as result rows (benchmarks/_rows.py's
    schema), for the parts that ran: (a) each direction's pinned copy
    bandwidth and median time; (b) the gather's bandwidth, time (median,
    min, max) and share of the H2D ceiling, a D each; (c), (d) each
    contender's step time (median, min, max), its phases and, in (c), the
    PCIe bound. recover_rows.py converts the committed runs' JSON with it
    too."""
    def rows_of(workload, contender, figures):
        return figure_rows(ctx, workload, contender, figures)

    args = report["args"]
    rows = []
    for direction, ceiling in report.get("ceilings", {}).items():
        rows += rows_of({"bytes": ceiling["bytes"]}, f"pinned copy {direction.upper()}",
                        [("bandwidth", ceiling["bytes_per_s"], "bytes/s"), ("time_median", ceiling["median_ms"], "ms")])
    for point in report.get("gather") or []:
        workload = {"dim": point["dim"], "gather_rows": point["rows"],
                    "gather_table_mib": args.get("gather_table_mib"), "repeats": args.get("repeats")}
        rows += rows_of(workload, GATHER_CONTENDER, [
            ("bandwidth", point["bytes_per_s"], "bytes/s"), ("time_median", point["median_ms"], "ms"),
            ("time_min", min(point["all_ms"]), "ms"), ("time_max", max(point["all_ms"]), "ms"),
            ("share_of_h2d", point.get("of_h2d"), "fraction")])
    for part, names in (("train", TRAIN_CONTENDERS), ("fit", FIT_CONTENDERS)):
        section = report.get(part)
        if not section:
            continue
        workload = {k: section[k] for k in ("rows", "dim", "batch", "alpha") if k in section}
        workload.update({k: args[k] for k in ("batches", "steps", "warmup", "lr", "seed") if k in args})
        results = section["modes"] if part == "train" else {k: v for k, v in section.items()
                                                            if isinstance(v, dict) and "median_ms" in v}
        for key, result in results.items():
            rows += rows_of(workload, names[key], summary_figures("step_time", result) + [
                ("forward_time", result["forward_ms"], "ms"), ("backward_time", result["backward_ms"], "ms"),
                ("optimizer_step_time", result["step_ms"], "ms"), ("pcie_bound", result.get("pcie_bound_ms"), "ms")])
    return rows


if __name__ == "__main__":
    main()
