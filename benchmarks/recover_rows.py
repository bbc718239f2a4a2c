"""Writes rows.jsonl (the schema of _rows.py: one measured figure a row)
into the run folders committed before the benchmarks wrote rows themselves,
from each run's own JSON.

    python benchmarks/recover_rows.py

A one-off converter that can run again: it rewrites the runs it recovers
(write_rows replaces a run's rows in place and keeps any other run's), so a
second run writes the same files.

Where each field comes from, per folder:

- cpu-2026-11-28 (no README, machine or command file): the machine and
  commit from each JSON's "machine" (its "git"; "-dirty" where the tree had
  changes; the before/after runs imported hostembed from another checkout,
  hostembed_path in the JSON, while "git" is the benchmark script's tree);
  the date is the folder's (2026-11-28), or the JSON's own "date" where it
  has one (state_quality_kg); command null: the command lines were not kept
  (the JSON's parsed arguments are in each row's workload).
- cpu-2026-11-29-cache-policy, and cpu-2026-11-29-cache-planner's
  cache_policy run (runs made before cache_plan.py wrote rows; its own
  _cache_plan_rows.py converts their JSON; the planner folder's later runs
  wrote their rows themselves): the machine from machine.txt (lscpu and
  torch's version), the command from command.txt's first line, the commit
  from the JSON's "git", the date the folder's.
- h200-2026-11-25, -26, -27: the machine from the folder's callN_machine.log
  (call1's where a call has none); the commit is the tree the README names
  for the call (the copies carried a stale .git, so the JSON's "git" is
  wrong there), resolved to its full hash; the date the README's; the
  command the callN_summary.log line that ran it, where one was kept, else
  what the README says ran (11-27), else null (11-25's calls 2 and 3).

Logs are read only where a run has no JSON and the log is a machine-readable
table: h200-2026-11-27/call1_compare.log (compare.py's Markdown table, its
figures as printed, so rounded). Not recovered: the logs of runs that have
JSON (the same figures), h200-2026-11-25's call1_cache_step.log,
call1_gpu_bench.log and call2_compare.log (failed before any table), and
h200-2026-11-26/call1_benchmark.log (gpu.py's progress lines, not a table).
"""
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(sys.path[0], "cache"))  # benchmarks/cache/: _cache_plan_rows
from _cache_plan_rows import policy_rows  # noqa: E402
from _common import (RESULTS_DIR, commit_of, figure_rows, machine_summary, make_row,  # noqa: E402
                     summary_figures, write_rows)
from _compare.rows import compare_log_rows, compare_rows  # noqa: E402  (compare.py's rows)
# Each benchmark's own converter from its JSON to rows, as it writes them after a run.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients"))  # benchmarks/clients/
from state_quality import result_rows as state_quality_rows  # noqa: E402
from lm_step import result_rows as lm_step_rows  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu"))  # benchmarks/cpu/
from row_layout import result_rows as row_layout_rows  # noqa: E402
from state_step import result_rows as state_step_rows  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))  # benchmarks/gpu/
from gpu import result_rows as gpu_rows  # noqa: E402

UNKNOWN_MACHINE = {"cpu_model": None, "cores": None, "gpu": None, "torch": None, "cuda": None}

# The trees each GPU call ran, as the folders' READMEs name them (full hashes
# from `git rev-parse`).
H200_TREES = {
    ("h200-2026-11-25", 2): "e0c420d4c1e124d0095765cb4c446d94795a9bef",
    ("h200-2026-11-25", 3): "2dd205709d5e465e4da1c0e81050f1fc5ad6eb13",
    ("h200-2026-11-26", 1): "ada9589e0b01761b1353d935909c2f98e3d3ca73",
    ("h200-2026-11-26", 2): "a51986a729447f2564dba413332dfd56ac4a6633",
    ("h200-2026-11-27", 1): "fa98366d32b0e38f3ac0cbe1e69991233e6e6ab0",
}
# README of h200-2026-11-27: call 1 ran "`compare.py --cache-fraction 1`"
# (that folder kept no summary log with the command line).
H200_27_COMPARE_COMMAND = "compare.py --cache-fraction 1"
# The figures a run's JSON carries as published by others ("published_ms"):
# the READMEs say "Published for the stream (H100, Adam)".
PUBLISHED_DEVICE = "NVIDIA H100"


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _folder_date(folder):
    return re.search(r"\d{4}-\d{2}-\d{2}", os.path.basename(folder)).group(0)


def _context(benchmark, run, device, machine, commit, date, command):
    return {"benchmark": benchmark, "run": run, "device": device, "machine": machine, "commit": commit,
            "date": date, "command": command}


def _pick(mapping, keys):
    """The workload: the named parameters of a JSON's arguments or config."""
    return {k: mapping[k] for k in keys if k in mapping}




# --- cpu-2026-11-28 ---------------------------------------------------------------

DISK_FIGURES = [  # disk_table.py's result keys: (metric, unit)
    ("open_s", "open_time", "s"), ("warmup_steps", "warmup_steps", "steps"), ("peak_rss_bytes", "peak_rss", "bytes"),
    ("cgroup_peak_bytes", "cgroup_peak", "bytes"), ("flush_s", "flush_time", "s"),
    ("record_bytes", "record_size", "bytes"), ("disk_bytes", "files_on_disk", "bytes"),
    ("cache_rows", "cache_capacity", "rows"), ("hit_rate", "hit_rate", "fraction"),
    ("unique_rows_per_step", "unique_rows", "rows/step"), ("misses_per_step", "misses", "rows/step"),
    ("evicted_per_step", "evictions", "rows/step"), ("disk_read_bytes_per_step", "disk_read", "bytes/step"),
    ("disk_written_bytes_per_step", "disk_written", "bytes/step"),
    ("min_read_bytes_per_step", "minimum_read", "bytes/step"),
    ("min_written_bytes_per_step", "minimum_written", "bytes/step"),
    ("reads_per_miss", "reads_per_miss", "requests"), ("writes_per_eviction", "writes_per_eviction", "requests"),
    ("row_reads_per_step", "read_requests", "requests/step"),
    ("row_writes_per_step", "write_requests", "requests/step"), ("io_floor_ms", "io_floor", "ms"),
]
DISK_CONTENDERS = {"disk": "hostembed, table on disk", "memory": "hostembed, table in memory",
                   "save": "hostembed.save of the table in memory",
                   "convert": "hostembed.load of that checkpoint into a table on disk"}


def disk_table_rows(ctx, data):
    args, rates = data["args"], data["disk"]
    base = _pick(args, ("rows", "dim", "batch", "alpha", "warmup", "steps", "limit", "budget", "threads"))
    rows = figure_rows(ctx, dict(base, row_bytes=rates["row_bytes"], direct_io=rates["direct_io"]),
                 "the disk, rows at random", [("read_rate", rates["read_rows_per_s"], "rows/s"),
                                              ("write_rate", rates["write_rows_per_s"], "rows/s")])
    rows += figure_rows(ctx, base, DISK_CONTENDERS["disk"], [("files_made_time", data["files_made_s"], "s")])
    for result in data["results"]:
        result = dict(result)
        if result["where"] == "disk" and "io_floor_ms" not in result:
            # The JSONs of the runs disk_table and disk_table_run2 lack the
            # request counts and the floor their logs print: disk_table.py's
            # main() computes them from these fields, as here.
            reads = result["misses_per_step"] * result["reads_per_miss"]
            writes = result["evicted_per_step"] * result["writes_per_eviction"]
            result["row_reads_per_step"], result["row_writes_per_step"] = reads, writes
            result["io_floor_ms"] = 1e3 * (reads / rates["read_rows_per_s"] + writes / rates["write_rows_per_s"])
        workload = dict(base, optimizer=result["optimizer"], ids=result["ids"])
        steps = result["ms_steps"]
        figures = [("step_time_median", result["ms_per_step"], "ms"), ("step_time_min", min(steps), "ms"),
                   ("step_time_max", max(steps), "ms")]
        figures += [(metric, result.get(key), unit) for key, metric, unit in DISK_FIGURES]
        rows += figure_rows(ctx, workload, DISK_CONTENDERS[result["where"]], figures)
    for result in data["conversion"]:
        rows += figure_rows(ctx, dict(base, optimizer=result["optimizer"]), DISK_CONTENDERS[result["where"]],
                      [("time", result["seconds"], "s"), ("checkpoint_size", result["checkpoint_bytes"], "bytes"),
                       ("peak_rss", result["peak_rss_bytes"], "bytes"),
                       ("cgroup_peak", result.get("cgroup_peak_bytes"), "bytes")])
    return rows


CPU_2026_11_28 = [  # (file name pattern, benchmark, converter)
    ("disk_table*.json", "disk_table", disk_table_rows),
    ("lm_step.json", "lm_step", lm_step_rows),
    ("row_layout_run*.json", "row_layout", row_layout_rows),
    ("state_quality_kg.json", "state_quality", lambda ctx, data: state_quality_rows(ctx, data, curves=False)),
    ("state_step.json", "state_step", state_step_rows),
]


def recover_cpu_2026_11_28(folder):
    rows = []
    for pattern, benchmark, convert in CPU_2026_11_28:
        for path in sorted(glob.glob(os.path.join(folder, pattern))):
            data = _load(path)
            machine = data["machine"]
            ctx = _context(benchmark, os.path.basename(path)[:-len(".json")], "cpu", machine_summary(machine),
                           commit_of(machine.get("git")), data.get("date") or _folder_date(folder), None)
            rows += convert(ctx, data)
    return rows


# --- cpu-2026-11-29-cache-policy ----------------------------------------------------

def _lscpu_machine(path):
    """machine.txt: lscpu's lines, then torch's version on a line of its own."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {"cpu_model": fields["Model name"].strip(), "cores": int(fields["CPU(s)"]), "gpu": None,
            "torch": lines[-1].strip(), "cuda": None}


def _cache_plan_context(folder, run, json_name):
    """cache_plan.py's run in `folder`: machine.txt's machine, the JSON's
    commit, the folder's date, command.txt's first line."""
    data = _load(os.path.join(folder, json_name))
    with open(os.path.join(folder, "command.txt"), encoding="utf-8") as f:
        command = f.readline().strip()
    ctx = _context("cache_plan", run, "cpu", _lscpu_machine(os.path.join(folder, "machine.txt")),
                   commit_of(data["machine"].get("git")), _folder_date(folder), command)
    return ctx, data


def recover_cpu_2026_11_29_cache_policy(folder):
    ctx, data = _cache_plan_context(folder, "cache_policy", "cache_policy.json")
    return policy_rows(data, ctx)


def recover_cpu_2026_11_29_cache_planner(folder):
    """The anchors' streams (cache_policy.json, command.txt's first line);
    the reference stream's runs there wrote their own rows."""
    ctx, data = _cache_plan_context(folder, "cache_policy", "cache_policy.json")
    return policy_rows(data, ctx)


# --- h200-2026-11-25, -26, -27 ------------------------------------------------------------

def _gpu_machine(path):
    """A callN_machine.log: lscpu's model, the CPUs the process may use,
    torch's and CUDA's versions and the GPU torch saw."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    torch_line = re.search(r"^torch (\S+) cuda (\S+)", text, re.M)
    return {"cpu_model": re.search(r"^Model name:\s+(.+)$", text, re.M).group(1).strip(),
            "cores": int(re.search(r"^nproc \(CPUs this process may use\): (\d+)", text, re.M).group(1)),
            "gpu": re.search(r"^device (.+?) capability", text, re.M).group(1),
            "torch": torch_line.group(1), "cuda": torch_line.group(2)}


def _summary_command(folder, call, stage):
    """The command line a call's summary log shows for `stage`, or None."""
    path = os.path.join(folder, f"call{call}_summary.log")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        found = re.search(rf"^== {re.escape(stage)} \(limit \d+s\): (.+)$", f.read(), re.M)
    return found.group(1).strip() if found else None


def _h200_context(folder, call, benchmark, run, command):
    machine_log = os.path.join(folder, f"call{call}_machine.log")
    if not os.path.exists(machine_log):
        machine_log = os.path.join(folder, "call1_machine.log")
    machine = _gpu_machine(machine_log)
    return _context(benchmark, run, machine["gpu"], machine, H200_TREES[(os.path.basename(folder), call)],
                    _folder_date(folder), command)


def _published_rows(ctx, published):
    """The figures a run carried as published by others: their own rows, on
    the device they were published for, with no date, commit or command of
    ours (workload {"published": true}: not measured by this run)."""
    published_ctx = dict(ctx, device=PUBLISHED_DEVICE, machine=dict(UNKNOWN_MACHINE, gpu=PUBLISHED_DEVICE),
                         commit=None, date=None, command=None)
    return [make_row(published_ctx, {"published": True}, name, "step_time_mean", ms, "ms")
            for name, ms in published.items()]


CACHE_FIGURES = [  # cache_step.py's per-size keys: (metric, unit)
    ("capacity", "cache_capacity", "rows"), ("hit_rate", "hit_rate", "fraction"),
    ("bypassed_per_step", "bypassed_rows", "rows/step"), ("record_bytes_per_step", "record_traffic", "bytes/step"),
    ("pcie_bytes_per_step", "pcie_traffic", "bytes/step"), ("minimum_bytes_per_step", "minimum_traffic", "bytes/step"),
    ("host_waits_per_step", "host_waits", "waits/step"),
]


def _cache_mode_rows(ctx, base, contender, stream, mode):
    rows = figure_rows(ctx, dict(base, stream=stream), "the id stream", [
        ("touched_rows", mode["touched_rows"], "rows"), ("unique_rows", mode["unique_per_step"], "rows/step"),
        ("first_touched_rows", mode["first_touch_per_step"], "rows/step")])
    sizes = [(None, mode["no_cache"])] + [(float(f), size) for f, size in mode["sizes"].items()]
    for fraction, size in sizes:
        phases = size.get("phases_ms", {})
        figures = summary_figures("step_time", size["step"]) + [
            ("forward_time", phases.get("forward"), "ms"), ("backward_time", phases.get("backward"), "ms"),
            ("optimizer_step_time", phases.get("step"), "ms")]
        figures += [(metric, size.get(key), unit) for key, metric, unit in CACHE_FIGURES]
        rows += figure_rows(ctx, dict(base, stream=stream, cache_fraction=fraction), contender, figures)
    return rows


def cache_step_rows(ctx, data):
    args = data["args"]
    contender = "hostembed.Embedding + SparseAdam" + ("" if args["unfused"] else "(fused=True)")
    base = _pick(args, ("rows", "batch", "alpha", "dim", "warmup", "steps", "prefetch", "device", "seed"))
    # Before cache_step.py ran several streams (2026-11-25) its JSON held one,
    # `stream` batches replayed; after, "modes" holds each.
    modes = data.get("modes") or {"replay": {k: data[k] for k in ("touched_rows", "unique_per_step",
                                                                  "first_touch_per_step", "sizes", "no_cache")}}
    rows = []
    for name, mode in modes.items():
        stream = {"replay": "replayed", "fresh": "fresh"}[name]
        workload = dict(base, batches=args["stream"]) if stream == "replayed" else base
        rows += _cache_mode_rows(ctx, workload, contender, stream, mode)
    return rows + _published_rows(ctx, data["published_ms"])


H200_JSON = [  # (folder, call, file, benchmark, converter, the summary log's stage name)
    ("h200-2026-11-25", 2, "call2_gpu.json", "gpu", gpu_rows, None),
    ("h200-2026-11-25", 2, "call2_cache_step.json", "cache_step", cache_step_rows, None),
    ("h200-2026-11-25", 3, "call3_cache_step.json", "cache_step", cache_step_rows, None),
    ("h200-2026-11-25", 3, "call3_compare_default.json", "compare", compare_rows, None),
    ("h200-2026-11-26", 1, "call1_cache_step.json", "cache_step", cache_step_rows, "cache_benchmark"),
    ("h200-2026-11-26", 1, "call1_compare_default.json", "compare", compare_rows, "compare"),
    ("h200-2026-11-26", 2, "call2_compare_default.json", "compare", compare_rows, "compare"),
]


def recover_h200(folder):
    name = os.path.basename(folder)
    rows = []
    for run_folder, call, file, benchmark, convert, stage in H200_JSON:
        if run_folder == name:
            command = _summary_command(folder, call, stage) if stage else None
            ctx = _h200_context(folder, call, benchmark, file[:-len(".json")], command)
            rows += convert(ctx, _load(os.path.join(folder, file)))
    if name == "h200-2026-11-27":
        ctx = _h200_context(folder, 1, "compare", "call1_compare", H200_27_COMPARE_COMMAND)
        rows += compare_log_rows(ctx, os.path.join(folder, "call1_compare.log"), cache_fraction=1.0)
    return rows


FOLDERS = {
    "cpu-2026-11-28": recover_cpu_2026_11_28,
    "cpu-2026-11-29-cache-policy": recover_cpu_2026_11_29_cache_policy,
    "cpu-2026-11-29-cache-planner": recover_cpu_2026_11_29_cache_planner,
    "h200-2026-11-25": recover_h200,
    "h200-2026-11-26": recover_h200,
    "h200-2026-11-27": recover_h200,
}


def main():
    for name, recover in FOLDERS.items():
        folder = os.path.join(RESULTS_DIR, name)
        rows = recover(folder)
        path = write_rows(folder, rows)
        print(f"{os.path.relpath(path)}: {len(rows)} rows, {len({r['run'] for r in rows})} runs")


if __name__ == "__main__":
    main()
