"""Whether one record a row (weight, moments and scales side by side) makes
the core's CPU step faster than today's separate arrays in host memory.

The core's SparseAdam update (he_sparse_update, 2 moments) of NNZ rows at
random of a ROWS x DIM float32 table, with float32 moments and with 8-bit
ones, each laid out both ways in one process (row_layout_driver.c, built
here from the core's sources with the extension's flags), timed in
alternating rounds after every row's state is written once; medians, the
host copy bandwidth of the same run beside them. A row's update reads and
writes 1,536 bytes in three places (float32 moments, D=128) or 776 bytes in
five (8-bit codes and two scales), where a record is one place. The
figures go to --json and, as result rows (result_rows), to rows.jsonl
beside it.

Usage:
    python benchmarks/cpu/row_layout.py [--rows 2000000 --dim 128 --nnz 14200 --rounds 21]
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import (REPO_ROOT, OtherLoad, run_folder, copy_bandwidth, log, machine_info, make_row,  # noqa: E402
                     run_context, usable_cpus, write_json, write_rows)

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_layout_driver.c")
# setup.py's CFLAGS for the core (and OpenMP, as the extension links it where the compiler has it).
CFLAGS = ["-std=c11", "-O3", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def build(out_dir):
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    exe = os.path.join(out_dir, "row_layout_driver")
    sources = sorted(glob.glob(os.path.join(REPO_ROOT, "csrc", "*.c")))
    subprocess.run([cc, *CFLAGS, "-I", os.path.join(REPO_ROOT, "csrc"), "-I", os.path.join(REPO_ROOT, "include"),
                    DRIVER, *sources, "-o", exe, "-lm"], check=True)
    return exe


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--nnz", type=int, default=14_200, help="rows a step (cpu_step.py's batch has ~14,200 unique)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the host copy bandwidth")
    p.add_argument("--json", default=os.path.join(run_folder(), "row_layout.json"))
    args = p.parse_args()
    load = OtherLoad()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        runs = []
        for form in ("float32", "int8"):
            log(f"{form}: {args.rows:,} x {args.dim}, {args.nnz:,} rows a step, {args.rounds} rounds")
            out = subprocess.run([exe, str(args.rows), str(args.dim), str(args.nnz), str(args.rounds), form],
                                 check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out))
            if not runs[-1]["same_bits"]:
                raise SystemExit(f"{form}: the two layouts disagree after the same updates (a bug in strided tables)")
    bandwidth = copy_bandwidth(args.copy_mib << 20, 5, usable_cpus())
    base = statistics.median(runs[0]["separate_s"])
    print("\n| moments | record bytes | separate ms | records ms | records / separate | float32 separate / this "
          "| huge pages |\n|---|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        sep, rec = statistics.median(run["separate_s"]), statistics.median(run["records_s"])
        run.update(separate_ms=sep * 1e3, records_ms=rec * 1e3)
        print(f"| {run['form']} | {run['record_bytes']} | {sep * 1e3:.3f} | {rec * 1e3:.3f} | {rec / sep:.2f}x "
              f"| {base / sep:.2f}x | {run['anon_huge_bytes'] / run['table_bytes']:.0%} |")
    others = load.fraction()
    print(f"host copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s; other load "
          f"{'unknown' if others is None else f'{others:.0%}'}")
    report = {"machine": machine_info(), "args": vars(args), "copy_bandwidth": bandwidth,
              "other_load_fraction": others, "runs": runs}
    write_json(args.json, report)
    path = write_rows(os.path.dirname(os.path.abspath(args.json)),
                      result_rows(run_context("row_layout", info=report["machine"]), report))
    log(f"wrote {args.json} and {path}")


def result_rows(ctx, report):
    """A run's report (its JSON) as result rows (benchmarks/_rows.py's
    schema): the host copy bandwidth; per form of the moments and layout
    (the contender) the update's time (the JSON's median, as printed; min
    and max), a record's bytes, and the huge pages and bytes of the table
    and its state. recover_rows.py converts the committed runs' JSON with
    it too."""
    copy = report["copy_bandwidth"]
    rows = [make_row(ctx, {"threads": copy["threads"], "buffer_bytes": copy["buffer_bytes"]}, "host copy (copy_)",
                     "bandwidth", copy["bytes_per_s"], "bytes/s")]
    for run in report["runs"]:
        workload = {k: report["args"][k] for k in ("rows", "dim", "nnz", "rounds") if k in report["args"]}
        workload.update(form=run["form"], threads=run["threads"])
        figures = []
        for key, contender in (("separate", "separate arrays"), ("records", "one record a row")):
            seconds = run[f"{key}_s"]
            figures += [(contender, "update_time_median", run[f"{key}_ms"], "ms"),
                        (contender, "update_time_min", 1e3 * min(seconds), "ms"),
                        (contender, "update_time_max", 1e3 * max(seconds), "ms")]
        figures += [("one record a row", "record_size", run["record_bytes"], "bytes"),
                    ("separate arrays", "huge_pages", run["anon_huge_bytes"], "bytes"),
                    ("separate arrays", "table_and_state", run["table_bytes"], "bytes")]
        rows += [make_row(ctx, workload, contender, metric, value, unit)
                 for contender, metric, value, unit in figures if value is not None]
    return rows


if __name__ == "__main__":
    main()
