"""How much faster is training if nn.Embedding becomes hostembed.Embedding, and what does it cost in memory?

The workload is collaborative filtering with user and item tables too big
for the GPU (the PyTorch forum thread behind this project: CPU embeddings +
Adam at 5 s/iteration, CPU + SparseAdam at 15 it/s, GPU + SparseAdam at 90
it/s). The model scores an interaction as <u, i> / sqrt(D) + MLP([u, i]) and
trains on binary cross-entropy. The dense part runs on the output device
(the GPU if there is one, else the CPU) and is trained by torch.optim.Adam
in every case. The contenders differ only in the tables:

  1. torch nn.Embedding on the CPU + torch.optim.Adam (dense); fewer steps,
     and skipped where its dense gradients and Adam state would not fit in RAM
  2. torch nn.Embedding(sparse=True) on the CPU + torch.optim.SparseAdam
  3. torch nn.Embedding(sparse=True) on the GPU + torch.optim.SparseAdam,
     where there is a GPU and the tables and their state fit in its memory
  4. hostembed.Embedding + hostembed.SparseAdam
  5. the same with SparseAdam(fused=True): the tables' update runs in
     backward, with no weight.grad
  6. torch nn.Embedding on the CPU + torch.optim.Adam(fused=True) (dense):
     torch's fastest dense Adam
  7. hostembed.Embedding + torch.optim.Adam: the plain swap with the dense
     optimizer kept; hostembed steps the tables over every row without a
     dense gradient, with torch's results
  8. hostembed.Embedding(cache_rows=...) + SparseAdam(fused=True), with GPU
     outputs: a row cache in GPU memory of --cache-fraction of each
     table's rows, the rest in host memory

Every contender starts from the same weights and trains on the same
batches. Contenders 2-5 and 8 (SparseAdam) must follow the same loss curve to
float rounding, and so must 1, 6 and 7 (dense Adam, fewer steps), or the
script fails without reporting timings.

After the run, its figures go as result rows (benchmarks/_common.py's
schema; benchmarks/_compare/rows.py) to rows.jsonl beside the JSON, and the
plots are drawn from those rows: every step's loss is a row. The plots
carry the run's date and machine in their titles. --plot-from draws them
again, with no training, from a run folder's rows (or a rows.jsonl, or a
run's JSON), so a plot shown beside a table is that run's.

This script reads the command line, runs the parts and writes the JSON
and plots; the parts are in benchmarks/_compare/: the workload and model,
the contenders, the runs and checks, the printed report and plots.

Usage (after `pip install .`, or an in-place build with PYTHONPATH=python):
    python benchmarks/compare.py [--size default|large|tiny] [--users N --dim D ...] [--json RUN/compare.json]
    python benchmarks/compare.py --plot-from RUN_FOLDER [--plot-run RUN] --out benchmarks/figures
"""
import argparse
import json
import os
import sys
import time

import torch

from _common import (DENSE_ADAM_WARMUP, REPO_ROOT, ROWS_FILE, OtherLoad, PeakRss, commit_of, log, machine_info,
                     machine_summary, read_rows_file, require_hostembed, run_context, run_folder, usable_cpus,
                     write_json, write_plots, write_rows)
from _compare.contenders import CONTENDERS
from _compare.reporting import (plot_inputs, plot_losses, plot_ms_per_step, print_report, run_date, run_label,
                                timing_notes)
from _compare.rows import run_rows
from _compare.running import dense_floor, run_contenders
from _compare.workload import make_batches, workload_stats

FIGURES_DIR = os.path.join(REPO_ROOT, "benchmarks", "figures")  # the plots the docs show

hostembed = require_hostembed()

# Every size parameter of a preset is also a command-line option that overrides it.
PRESETS = {
    # Seconds: for trying the script out, not for judging anything.
    "tiny": dict(users=200_000, items=50_000, dim=32, hidden=32, batch=4_096, steps=30, warmup=2, adam_steps=2),
    # A 2-core, 24 GB laptop-sized machine, under 3 minutes in all: 1.2 GiB of
    # tables, 7.7 GB for dense Adam.
    "default": dict(users=4_000_000, items=1_000_000, dim=64, hidden=64, batch=16_384, steps=200, warmup=5,
                    adam_steps=3),
    # A GPU box: 64M rows x 128 = 30.5 GiB of tables, 91.6 GiB with SparseAdam
    # state (more than an 80 GB GPU holds) and ~183 GiB for dense Adam.
    "large": dict(users=40_000_000, items=24_000_000, dim=128, hidden=256, batch=65_536, steps=100, warmup=5,
                  adam_steps=2),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, but not the None of options a preset fills in."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def preset_help(what, key):
    return f"{what} (preset: " + ", ".join(f"{name} {sizes[key]:,}" for name, sizes in PRESETS.items()) + ")"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--size", choices=sorted(PRESETS), default="default",
                   help="preset for the size options below; each option given overrides it")
    p.add_argument("--users", type=int, help=preset_help("rows of the user table", "users"))
    p.add_argument("--items", type=int, help=preset_help("rows of the item table", "items"))
    p.add_argument("--dim", type=int, help=preset_help("embedding dim D", "dim"))
    p.add_argument("--hidden", type=int, help=preset_help("hidden units of the MLP", "hidden"))
    p.add_argument("--batch", type=int, help=preset_help("interactions per batch", "batch"))
    p.add_argument("--steps", type=int, help=preset_help("timed steps (sparse contenders)", "steps"))
    p.add_argument("--warmup", type=int, help=preset_help(
        "untimed steps first (>= 1: the first allocates the optimizer state)", "warmup"))
    p.add_argument("--adam-steps", type=int, help=preset_help(
        f"timed steps of dense Adam, after {DENSE_ADAM_WARMUP} untimed; 0 skips it", "adam_steps"))
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of users and items")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every optimizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--cache-fraction", type=float, default=0.2,
                   help="contender 8: rows of each table its GPU row cache holds, as a fraction")
    p.add_argument("--device", default="auto", help="output device: auto (cuda if available, else cpu), cpu, cuda[:N]")
    p.add_argument("--out", help="directory for the JSON, rows and plots (default: the run folder "
                                 "benchmarks/results/<device>-<date>; with --json, the JSON's folder; with "
                                 "--plot-from, benchmarks/figures)")
    p.add_argument("--json", help="the run's JSON (default: --out/compare_SIZE.json); its rows go to rows.jsonl "
                                  "beside it")
    p.add_argument("--plot-from", metavar="RUN",
                   help="no run: draw into --out the plots of a compare.py run from its rows (a run folder or its "
                        "rows.jsonl; the newest compare run there unless --plot-run names one) or from its JSON")
    p.add_argument("--plot-run", metavar="NAME", help="with --plot-from: the run (its rows' \"run\") to draw")
    args = p.parse_args(argv)
    if args.plot_from is not None:
        return args
    for key, value in PRESETS[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.users, args.items, args.dim, args.hidden, args.batch, args.steps, args.warmup, args.threads) < 1:
        p.error("--users, --items, --dim, --hidden, --batch, --steps, --warmup and --threads must be >= 1")
    if args.adam_steps < 0:
        p.error("--adam-steps must be >= 0")
    if not 0 < args.cache_fraction <= 1:
        p.error("--cache-fraction must be in (0, 1]")
    try:
        args.device = output_device(args.device)
    except (RuntimeError, ValueError) as exc:
        p.error(f"--device: {exc}")
    return args


def output_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: only cpu and cuda are supported")
    return device


def draw_plots(rows, out_dir):
    """The plots (ms per step; loss curves where the rows have them) of one
    run from its rows, titled with its date and machine; (paths written, note)."""
    cfg, results, floor_ms, agreement, about, date = plot_inputs(rows)
    run = run_label(about, date)
    ran = any("median_ms" in r for r in results.values())
    stem = f"compare_{cfg.size}"
    figures = {f"{stem}_ms_per_step.png": plot_ms_per_step(cfg, results, floor_ms, run)} if ran else {}
    if any("losses" in r for r in results.values()):
        figures[f"{stem}_loss.png"] = plot_losses(cfg, results, agreement, run)
    plots, note = write_plots(out_dir, figures)
    return plots, note or ("" if ran else "plots skipped: no contender ran")


def json_rows(json_path):
    """A run's JSON as its rows (and the JSON), for a run kept as JSON only."""
    with open(json_path) as f:
        report = json.load(f)
    if report.get("benchmark") != "compare":
        sys.exit(f"{json_path} is not a JSON of compare.py (benchmark: {report.get('benchmark')!r})")
    date = run_date(report, os.path.abspath(json_path))
    if not report.get("date"):
        log(f"{json_path} records no date; " + (f"the date in its path, {date}, titles the plots" if date else
                                                 "the plots say the date was not recorded"))
    machine = report["machine"]
    # An older run's JSON may lack labels and the config's device: what the script says of them now.
    data = dict(report, config=dict({"device": machine.get("output_device")}, **report["config"]),
                contenders={c.key: dict({"label": c.label}, **report["contenders"][c.key]) for c in CONTENDERS
                            if c.key in report["contenders"]})
    on_gpu = str(data["config"]["device"]).startswith("cuda") and machine.get("gpu")
    ctx = {"benchmark": "compare", "run": os.path.basename(json_path).rsplit(".", 1)[0],
           "device": machine["gpu"]["name"] if on_gpu else "cpu", "machine": machine_summary(machine),
           "commit": commit_of(machine.get("git")), "date": date, "command": None}
    return run_rows(ctx, data), report


def plot_from(path, out_dir, run=None):
    """--plot-from: the plots of a run already made, from its rows (a run
    folder, a rows.jsonl) or its JSON."""
    report = None
    if os.path.isdir(path):
        path = os.path.join(path, ROWS_FILE)
    if path.endswith(".jsonl"):
        rows = [r for r in read_rows_file(path) if r["benchmark"] == "compare"]
    else:
        rows, report = json_rows(path)
    runs = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(row)
    if not runs or (run is not None and run not in runs):
        sys.exit(f"{path}: no rows of compare.py" + (f" in a run {run!r}; runs: {', '.join(runs)}" if runs else ""))
    if run is None:  # the newest; of one date, the last written
        run = max(enumerate(runs), key=lambda item: (runs[item[1]][0]["date"] or "", item[0]))[1]
        if len(runs) > 1:
            log(f"{len(runs)} compare runs in {path}: drawing the newest, {run} (--plot-run picks another)")
    plots, note = draw_plots(runs[run], out_dir)
    if report is not None:
        for line in timing_notes(report["contenders"], report["dense_floor"]):
            print(line)
    print(f"Plots of {run}: {', '.join(plots)}" if plots else note)


def main(argv=None):
    wall_t0 = time.perf_counter()
    cfg = parse_args(argv)
    if cfg.plot_from is not None:
        return plot_from(cfg.plot_from, cfg.out or FIGURES_DIR, cfg.plot_run)
    date = time.strftime("%Y-%m-%d")
    out_device = cfg.device
    if out_device.type == "cuda" and out_device.index is not None:
        torch.cuda.set_device(out_device)
    torch.set_num_threads(cfg.threads)
    hostembed.set_num_threads(cfg.threads)
    peak, other_load = PeakRss(), OtherLoad()

    count = max(cfg.warmup + cfg.steps, DENSE_ADAM_WARMUP + cfg.adam_steps)
    log(f"generating {count} batches of {cfg.batch:,} interactions")
    batches = make_batches(cfg, count)

    results, agreement, dense_agreement = run_contenders(cfg, out_device, batches, peak)
    floor = dense_floor(cfg, out_device, batches)

    report = {
        "benchmark": "compare",
        "date": date,
        "machine": machine_info(threads=cfg.threads, torch_threads=torch.get_num_threads(),
                                hostembed_threads=hostembed.get_num_threads(), output_device=str(out_device)),
        "config": {k: (str(v) if k == "device" else v) for k, v in vars(cfg).items()},
        "workload": workload_stats(batches[:cfg.warmup + cfg.steps]),
        "contenders": {c.key: results[c.key] for c in CONTENDERS},
        "dense_floor": floor,
        "agreement": agreement,
        "dense_agreement": dense_agreement,
        "other_load": {"loadavg_before": other_load.loadavg_before,
                       "cpu_fraction_used_by_others": other_load.fraction()},
    }
    peak.window()  # folds the last window into peak.overall
    report["peak_rss_bytes"] = peak.overall
    report["notes"] = timing_notes(results, floor)
    ran = any("median_ms" in r for r in results.values())
    json_path = cfg.json or os.path.join(cfg.out or run_folder(out_device), f"compare_{cfg.size}.json")
    rows = run_rows(run_context("compare", device=out_device, info=report["machine"]), report)
    plots, plots_note = draw_plots(rows, cfg.out or os.path.dirname(os.path.abspath(json_path)))
    report["plots"] = plots or plots_note
    report["wall_s"] = time.perf_counter() - wall_t0
    write_json(json_path, report)
    rows_path = write_rows(os.path.dirname(os.path.abspath(json_path)), rows)
    print_report(cfg, report, json_path, plots, plots_note)
    print(f"Rows: {rows_path} ({len(rows)})")
    if not ran:
        sys.exit("nothing was measured: every contender was skipped here (the table says why)")


if __name__ == "__main__":
    main()
