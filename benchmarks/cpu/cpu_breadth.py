"""The sparse optimizers and EmbeddingBag on the CPU: hostembed against torch, on the same ids.

Each group is built from one seed, checked (hostembed's weights after the
warm-up steps must match torch's), then timed in interleaved rounds, the
order rotated each round, and freed before the next group:
  * optimizer groups: hostembed.Embedding + hostembed.<Opt> against
    torch.nn.Embedding(sparse=True) + torch.optim.<Opt> (SGD, Adagrad), and
    hostembed.RowWiseAdagrad (torch has none); every group also times
    hostembed.SparseAdam in the same rounds, the yardstick each optimizer
    is held to;
  * the bag group: hostembed.EmbeddingBag against torch.nn.EmbeddingBag
    (sparse=True), both with SparseAdam, on the same ids in bags;
  * every hostembed optimizer also with fused=True (its update in backward);
  * the bfloat16 and float16 groups: hostembed.SparseAdam on a table of
    that dtype (float32 state and arithmetic) against torch's SparseAdam on
    an nn.Embedding of that dtype (state of that dtype), checked against the
    float32 yardstick within the dtype's rounding;
  * where fbgemm-gpu-cpu is installed, FBGEMM's table-batched embedding with
    EXACT_ROWWISE_ADAGRAD (its CPU has no Adam), plain and in bags, against
    hostembed's RowWiseAdagrad, the same formula.
A step is forward -> backward(a fixed gradient, in the output's dtype) -> step()
-> zero_grad().
State bytes are the optimizer state's tensors as allocated; "peak RSS
added" is the process's peak resident memory over building the contender
and its warm-up steps, less what was resident before (host-table state is
backed as rows are first written, so it shows what the warm-up touched).
The host copy
bandwidth is measured in the same run, and each hostembed contender's
traffic (a model: the gather reads and writes each looked-up row, the
update reads and writes each updated row and its state and reads its
gradient) is reported as a fraction of it.

Beside its JSON (--json) the run writes its figures as result rows
(rows.jsonl, benchmarks/_rows.py's schema; result_rows below): each
contender's step time (median, min, max), speed against its group's
reference and against hostembed SparseAdam, share of the copy bandwidth,
modelled traffic, table and state bytes and peak RSS added; each group's
check (the largest difference, and its share of the tolerance) and other
processes' share of the CPUs; the run's copy bandwidth and unique ids.

Usage (after `pip install .`; `pip install fbgemm-gpu-cpu==1.8.0`, which
matches torch 2.13, adds the FBGEMM contenders):
    python benchmarks/cpu/cpu_breadth.py [--rows 1000000 ...]
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (run_folder, OtherLoad, PeakRss, copy_bandwidth, fail, fmt_ms, log, machine_info,  # noqa: E402
                     make_row, require_hostembed, run_context, spread_rows, summarize_ms, usable_cpus, write_json,
                     write_rows, zipf_batches)

hostembed = require_hostembed()

YARDSTICK = "hostembed SparseAdam"
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FBGEMM_ROWWISE = "FBGEMM TBE, EXACT_ROWWISE_ADAGRAD"
FBGEMM_ROWWISE_BAG = "FBGEMM TBE (SUM), EXACT_ROWWISE_ADAGRAD"
# Bytes each updated element moves: weight read + written, gradient read,
# each state element read + written (SGD: none; Adagrad: sum; Adam: m, v;
# row-wise Adagrad: one value a row, left out).
UPDATE_BYTES = {"SGD": 12, "Adagrad": 20, "RowWiseAdagrad": 12, "SparseAdam": 28}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows N")
    p.add_argument("--dim", type=int, default=128, help="embedding dim D")
    p.add_argument("--batch", type=int, default=65_536, help="ids per batch B")
    p.add_argument("--bag", type=int, default=16, help="ids per bag in the bag group")
    p.add_argument("--alpha", type=float, default=1.15, help="Zipf exponent of the ids")
    p.add_argument("--steps", type=int, default=15, help="timed rounds per group")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first allocates the state)")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", nargs="*", default=None, help="run only these groups (default: all)")
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the copy bandwidth ceiling")
    p.add_argument("--json", default=os.path.join(run_folder(), "cpu_breadth.json"))
    args = p.parse_args(argv)
    if min(args.rows, args.dim, args.batch, args.bag, args.steps, args.warmup, args.threads) < 1:
        p.error("every size must be >= 1")
    if args.batch % args.bag:
        p.error("--batch must be a multiple of --bag")
    return args


# --- contenders: (module, optimizer) makers, each built after the same seed

# Tables of another dtype are the float32 table of the same seed, cast: the
# same starting rows, rounded.

def host(opt_cls, dtype=torch.float32, **hyper):
    def make(args):
        emb = hostembed.Embedding(args.rows, args.dim).to(dtype)
        return emb, opt_cls(emb.parameters(), **hyper)
    return make


def torch_sparse(opt_cls, dtype=torch.float32, **hyper):
    def make(args):
        emb = torch.nn.Embedding(args.rows, args.dim, sparse=True).to(dtype)
        return emb, opt_cls(emb.parameters(), **hyper)
    return make


def half_group(dtype, yardstick):
    """hostembed SparseAdam on a table of a half dtype (plain and fused)
    against torch SparseAdam on an nn.Embedding of that dtype, with the
    float32 yardstick in the same rounds; checked against the yardstick:
    within an ulp of the dtype (2^-7 relative for bfloat16, 2^-10 for
    float16) plus the warm-up's updates, which the dtype may round away
    (Adam moves a weight <= lr a step)."""
    name = str(dtype).removeprefix("torch.")
    ours = f"hostembed SparseAdam, {name} table"
    makes = {YARDSTICK: yardstick,
             ours: host(hostembed.SparseAdam, dtype, lr=1e-3),
             ours + "(fused=True)": host(hostembed.SparseAdam, dtype, lr=1e-3, fused=True),
             f"torch SparseAdam, {name} table": torch_sparse(torch.optim.SparseAdam, dtype, lr=1e-3)}
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    return (makes, ours, f"torch SparseAdam, {name} table", False,
            {"check_against": YARDSTICK, "rtol": ulp, "atol": 2 * 3 * 1e-3})


def bag(cls, fused=False):
    def make(args):
        module = cls(args.rows, args.dim, mode="sum", sparse=True)
        if cls is hostembed.EmbeddingBag:
            return module, hostembed.SparseAdam(module.parameters(), lr=1e-3, fused=fused)
        return module, torch.optim.SparseAdam(module.parameters(), lr=1e-3)
    return make


def rowwise_bag(fused):
    def make(args):
        module = hostembed.EmbeddingBag(args.rows, args.dim, mode="sum")
        return module, hostembed.RowWiseAdagrad(module.parameters(), lr=0.01, fused=fused)
    return make


def groups():
    """{group: ({contender: make}, the contender checked, its reference
    (torch's, or FBGEMM's) or None, bags?[, {check_against, rtol}])}."""
    adam = host(hostembed.SparseAdam, lr=1e-3)
    specs = {
        "SGD": ({"hostembed SGD": host(hostembed.SGD, lr=0.01),
                 "hostembed SGD(fused=True)": host(hostembed.SGD, lr=0.01, fused=True),
                 "torch SGD": torch_sparse(torch.optim.SGD, lr=0.01), YARDSTICK: adam},
                "hostembed SGD", "torch SGD", False),
        "Adagrad": ({"hostembed Adagrad": host(hostembed.Adagrad, lr=0.01),
                     "hostembed Adagrad(fused=True)": host(hostembed.Adagrad, lr=0.01, fused=True),
                     "torch Adagrad": torch_sparse(torch.optim.Adagrad, lr=0.01), YARDSTICK: adam},
                    "hostembed Adagrad", "torch Adagrad", False),
        "RowWiseAdagrad": ({"hostembed RowWiseAdagrad": host(hostembed.RowWiseAdagrad, lr=0.01),
                            "hostembed RowWiseAdagrad(fused=True)": host(hostembed.RowWiseAdagrad, lr=0.01,
                                                                         fused=True),
                            YARDSTICK: adam}, None, None, False),
        "SparseAdam": ({YARDSTICK: adam, "hostembed SparseAdam(fused=True)": host(hostembed.SparseAdam, lr=1e-3,
                                                                                  fused=True),
                        "torch SparseAdam": torch_sparse(torch.optim.SparseAdam, lr=1e-3)},
                       YARDSTICK, "torch SparseAdam", False),
        "EmbeddingBag(sum)": ({"hostembed EmbeddingBag + SparseAdam": bag(hostembed.EmbeddingBag),
                               "hostembed EmbeddingBag + SparseAdam(fused=True)": bag(hostembed.EmbeddingBag, True),
                               "torch EmbeddingBag + SparseAdam": bag(torch.nn.EmbeddingBag)},
                              "hostembed EmbeddingBag + SparseAdam", "torch EmbeddingBag + SparseAdam", True),
        **{f"{name} table": half_group(dtype, adam) for name, dtype in HALF_DTYPES.items()},
    }
    if fbgemm_available():
        rowwise = specs["RowWiseAdagrad"][0]
        rowwise[FBGEMM_ROWWISE] = fbgemm(False)
        specs["RowWiseAdagrad"] = (rowwise, "hostembed RowWiseAdagrad", FBGEMM_ROWWISE, False)
        specs["EmbeddingBag(sum) + row-wise Adagrad"] = (
            {"hostembed EmbeddingBag + RowWiseAdagrad": rowwise_bag(False),
             "hostembed EmbeddingBag + RowWiseAdagrad(fused=True)": rowwise_bag(True),
             FBGEMM_ROWWISE_BAG: fbgemm(True)},
            "hostembed EmbeddingBag + RowWiseAdagrad", FBGEMM_ROWWISE_BAG, True)
    return specs


class FbgemmTable(torch.nn.Module):
    """FBGEMM's table-batched embedding (one table in host memory, CPU
    compute) behind the benchmark's module(ids) call: rows (pooling NONE)
    or bags (SUM) of the ids' last dimension. Its row-wise Adagrad update
    runs in backward."""

    def __init__(self, rows, dim, bags, lr):
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)
        self.bags = bags
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=1e-10,
            pooling_mode=PoolingMode.SUM if bags else PoolingMode.NONE)
        with torch.no_grad():
            self.weight.copy_(torch.randn(rows, dim))  # hostembed's and torch's N(0, 1) draws

    @property
    def weight(self):
        return self.tbe.split_embedding_weights()[0]

    def forward(self, ids):
        flat = ids.reshape(-1)
        size = ids.shape[-1] if self.bags else 1
        return self.tbe(flat, torch.arange(0, flat.numel() + 1, size))


class UpdatedInBackward:
    """The optimizer of a table FBGEMM updates in backward: step() and
    zero_grad() have nothing to do; state lists its momentum tensors."""

    def __init__(self, table):
        self.state = {"momentum": {name: t for name, t in table.tbe.named_parameters() if name.startswith("momentum")}}

    def step(self):
        pass

    def zero_grad(self):
        pass


def fbgemm(bags):
    def make(args):
        table = FbgemmTable(args.rows, args.dim, bags, lr=0.01)
        return table, UpdatedInBackward(table)
    return make


def fbgemm_available():
    try:
        import fbgemm_gpu
        return fbgemm_gpu is not None
    except Exception:  # not installed, or built for another torch
        return False


def table_bytes(module):
    return module.weight.numel() * module.weight.element_size()


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def step(module, opt, ids, grad_out):
    """grad_out: the fixed output gradient by dtype, so that each contender
    gets it in its output's dtype, as the layer above would hand it on
    (autograd would otherwise convert it inside the timed step)."""
    t0 = time.perf_counter()
    out = module(ids)
    out.backward(grad_out[out.dtype])
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def run_group(args, name, spec, batches):
    makes, checked, twin, bags = spec[:4]
    check = spec[4] if len(spec) > 4 else {}
    rtol, atol, against = check.get("rtol", 1e-4), check.get("atol", 1e-5), check.get("check_against", twin)
    shape = (args.batch // args.bag, args.bag) if bags else (args.batch,)
    inputs = [ids.view(shape) for ids in batches]
    grad_out = torch.randn(shape[0], args.dim, generator=torch.Generator().manual_seed(args.seed + 1))
    grad_out = {dtype: grad_out.to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    built, rss = {}, {}
    warm, timed = inputs[:args.warmup], inputs[args.warmup:args.warmup + args.steps]
    peak = PeakRss()
    for contender, make in makes.items():
        # Each contender is built and warmed up on its own, so that the peak
        # RSS it adds (table, state as the warm-up backs it, temporaries) is
        # its own.
        peak.start()
        before = peak.window()
        torch.manual_seed(args.seed)
        built[contender] = make(args)
        for ids in warm:
            step(*built[contender], ids, grad_out)
        top = peak.window()
        rss[contender] = None if top is None else top - before
    check = None
    if checked is not None:
        ours, theirs = built[checked][0].weight.detach().float(), built[against][0].weight.detach().float()
        if not torch.allclose(ours, theirs, rtol=rtol, atol=atol):
            fail(f"{name}: after {len(warm)} steps hostembed's weights differ from {against}'s by "
                 f"{(ours - theirs).abs().max().item():.3g}; not timing a wrong result")
        difference = (ours - theirs).abs_()
        check = {"against": against, "max_difference": difference.max().item(), "rtol": rtol, "atol": atol,
                 # allclose's test, |a - b| <= atol + rtol |b|, as the share of its bound used (<= 1)
                 "of_tolerance": difference.div_(theirs.abs().mul_(rtol).add_(atol)).max().item()}
        del ours, theirs, difference
    other_load = OtherLoad()
    names = list(built)
    seconds = {n: [] for n in names}
    for i, ids in enumerate(timed):
        for n in names[i % len(names):] + names[:i % len(names)]:
            seconds[n].append(step(*built[n], ids, grad_out))
    contenders = {}
    for n in names:
        contenders[n] = summarize_ms(seconds[n])
        contenders[n]["all_ms"] = [s * 1e3 for s in seconds[n]]
        contenders[n]["state_bytes"] = state_bytes(built[n][1])
        contenders[n]["table_bytes"] = table_bytes(built[n][0])
        contenders[n]["peak_rss_bytes"] = rss[n]
    del built
    gc.collect()
    return {"contenders": contenders, "checked": checked, "reference": twin, "bags": bags, "check": check,
            "cpu_fraction_used_by_others": other_load.fraction()}


def traffic_bytes(args, contender, unique):
    """The modelled bytes of one hostembed step (see the module docstring):
    the gather reads and writes each looked-up row (B rows; a bag reads each
    distinct row once), the update moves UPDATE_BYTES per updated element."""
    kind = next(k for k in ("RowWiseAdagrad", "Adagrad", "SGD", "SparseAdam") if k in contender)
    looked_up = unique if "EmbeddingBag" in contender else args.batch
    # A half table moves half the bytes per weight: 2 read + 2 written per
    # gathered element, 4 fewer per updated one.
    half = any(f"{name} table" in contender for name in HALF_DTYPES)
    gather = 4 if half else 8
    return gather * looked_up * args.dim + (UPDATE_BYTES[kind] - (4 if half else 0)) * unique * args.dim


def derive(args, report):
    """The figures worked out from the measured ones, for the report and the
    rows alike: each hostembed contender's modelled traffic and its share of
    the copy bandwidth, its speed against its group's reference (the checked
    contender and its fused twin; the reference itself, 1) and against the
    yardstick."""
    copy_bps = report["copy_bandwidth"]["bytes_per_s"]
    for result in report["groups"].values():
        contenders = result["contenders"]
        reference_ms = contenders[result["reference"]]["median_ms"] if result["reference"] else None
        yard = contenders.get(YARDSTICK, {}).get("median_ms")
        for n, r in contenders.items():
            if n == result["reference"]:
                r["vs_reference"] = 1.0  # its own reference: 1.00x
            if not n.startswith("hostembed"):
                continue
            ms = r["median_ms"]
            r["traffic_bytes"] = traffic_bytes(args, n, report["unique_mean"])
            r["copy_bandwidth_share"] = r["traffic_bytes"] / (ms / 1e3) / copy_bps
            if reference_ms and n.split("(")[0] == result["checked"]:
                r["vs_reference"] = reference_ms / ms
            if yard and n != YARDSTICK:
                r["vs_yardstick"] = yard / ms


def result_rows(args, report, context):
    """The run's figures as result rows (benchmarks/_rows.py's schema):
    a group's rows carry its name and bag size in their workload."""
    base = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "alpha": args.alpha, "threads": args.threads,
            "seed": args.seed}
    copy = report["copy_bandwidth"]
    out = [make_row(context, {**base, "buffer_bytes": copy["buffer_bytes"]}, "host copy (dst.copy_(src))",
                    "copy_bandwidth", copy["bytes_per_s"], "bytes/s"),
           make_row(context, base, "the ids", "unique_ids_mean", report["unique_mean"], "ids")]
    for group, result in report["groups"].items():
        workload = {"group": group, **base, "bag": args.bag if result["bags"] else None, "steps": args.steps,
                    "warmup": args.warmup}
        if result["cpu_fraction_used_by_others"] is not None:
            out.append(make_row(context, workload, "other processes", "cpu_share",
                                result["cpu_fraction_used_by_others"], "fraction"))
        check = result["check"]
        if check:  # its workload also names what it was checked against, within what
            checked = {**workload, **{k: check[k] for k in ("against", "rtol", "atol")}}
            out += [make_row(context, checked, result["checked"], "check_max_difference", check["max_difference"],
                             "weight"),
                    make_row(context, checked, result["checked"], "check_of_tolerance", check["of_tolerance"],
                             "fraction")]
        for n, r in result["contenders"].items():
            out += spread_rows(context, workload, n, "step_time", r["all_ms"], "ms")
            figures = [("speed_vs_reference", r.get("vs_reference"), "x"),
                       ("speed_vs_hostembed_sparse_adam", r.get("vs_yardstick"), "x"),
                       ("copy_bandwidth_share", r.get("copy_bandwidth_share"), "fraction"),
                       ("traffic_modelled", r.get("traffic_bytes"), "bytes/step"),
                       ("table_size", r["table_bytes"], "bytes"), ("state_size", r["state_bytes"], "bytes"),
                       ("peak_rss_added", r["peak_rss_bytes"], "bytes")]
            out += [make_row(context, workload, n, metric, value, unit) for metric, value, unit in figures
                    if value is not None]
    return out


def print_report(args, report):
    copy_bps = report["copy_bandwidth"]["bytes_per_s"]
    print(f"\nN={args.rows:,} x D={args.dim}, B={args.batch:,} Zipf({args.alpha}) ids "
          f"({report['unique_mean']:,.0f} unique on average), {args.threads} threads; bags of {args.bag}; median "
          f"of {args.steps} interleaved rounds; host copy bandwidth {copy_bps / 1e9:.1f} GB/s\n")
    print("| group | contender | ms/step | vs reference | vs hostembed SparseAdam | of copy bandwidth | table | "
          "state | peak RSS added |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for group, result in report["groups"].items():
        for n, r in result["contenders"].items():
            ms = r["median_ms"]
            vs_reference = f"{r['vs_reference']:.2f}x" if "vs_reference" in r else ""
            vs_yard = f"{r['vs_yardstick']:.2f}x" if "vs_yardstick" in r else ""
            share = f"{r['copy_bandwidth_share']:.0%}" if "copy_bandwidth_share" in r else ""
            rss = "" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**20:.0f} MiB"
            print(f"| {group} | {n} | {fmt_ms(ms)} | {vs_reference} | {vs_yard} | {share} | "
                  f"{r['table_bytes'] / 2**20:.0f} MiB | {r['state_bytes'] / 2**20:.1f} MiB | {rss} |")
    others = [r["cpu_fraction_used_by_others"] for r in report["groups"].values()]
    known = [o for o in others if o is not None]
    print(f"\nOther processes took {max(known):.0%} of the CPUs at most during a group" if known else
          "\nOther processes' load: unknown")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    batches = zipf_batches(args.rows, args.batch, args.alpha, args.warmup + args.steps, args.seed)
    log(f"host copy bandwidth ({args.copy_mib} MiB buffers)")
    report = {"machine": machine_info(threads=args.threads), "args": vars(args), "groups": {},
              "copy_bandwidth": copy_bandwidth(args.copy_mib << 20, 5, args.threads),
              "unique_mean": sum(torch.unique(ids).numel() for ids in batches) / len(batches)}
    for name, spec in groups().items():
        if args.groups is not None and name not in args.groups:
            continue
        log(f"{name}: building, {args.warmup} warm-up steps, check, {args.steps} timed rounds")
        report["groups"][name] = run_group(args, name, spec, batches)
    derive(args, report)
    print_report(args, report)
    write_json(args.json, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                      result_rows(args, report, run_context("cpu_breadth", info=report["machine"])))
    log(f"wrote {args.json} and {path}")


if __name__ == "__main__":
    main()
