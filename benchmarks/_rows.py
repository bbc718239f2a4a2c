"""Result rows: every figure a benchmark measures is one row, a JSON object with
exactly these fields (ROW_FIELDS):

    benchmark  str   the script's name without .py ("lm_step")
    run        str   names one invocation within its run folder; a folder
                     may hold several runs (of one or more benchmarks)
    workload   dict  the parameters of what was measured ({"vocab": 50257,
                     "tied": true, ...}): JSON scalars (or lists of them)
    contender  str   what ran ("torch nn.Embedding", "hostembed, table on disk")
    metric     str   what was measured, without its unit ("step_time_median")
    value      int or float, finite; never a bool or a string
    unit       str   "ms", "s", "bytes", "GiB", "fraction" (0-1), "x" (a ratio), ...
    device     str   where the figure ran: "cpu", or the GPU's name ("NVIDIA H200")
    machine    dict  {cpu_model, cores, gpu, torch, cuda}: str/int, or null where
                     unknown (gpu and cuda null on a machine without a GPU)
    commit     str or null   the git commit of the tree measured; "-dirty"
                     appended when that tree had uncommitted changes
    date       str or null   ISO 8601: a date ("2026-11-28") or a date and time
    command    str or null   the command line that ran it; null where not kept

Spreads are rows of their own, never extra fields: a statistic is the
metric name's last word, so one step time is the rows "step_time_median",
"step_time_min" and "step_time_max" (and "_mean" where a run reports it).
A run's rows go to <run folder>/rows.jsonl, one object a line (write_rows);
read_rows reads every run folder under benchmarks/results/. The report
(benchmarks/report.py) renders the tables of docs/results.md and README.md
from them.

run_context (in _common.py, since it reads the machine) gives the fields a
run's rows share; _common.py re-exports everything here, so a script may
take these from either.
"""
import datetime
import json
import math
import os
import statistics

import numpy as np

# Defined here, not taken from _common, which imports this module: benchmarks/results/.
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

ROWS_FILE = "rows.jsonl"
MACHINE_FIELDS = {"cpu_model": (str,), "cores": (int,), "gpu": (str,), "torch": (str,), "cuda": (str,)}
_NULL = type(None)
ROW_FIELDS = {
    "benchmark": (str,), "run": (str,), "workload": (dict,), "contender": (str,), "metric": (str,),
    "value": (int, float), "unit": (str,), "device": (str,), "machine": (dict,),
    "commit": (str, _NULL), "date": (str, _NULL), "command": (str, _NULL),
}


def row_problems(row) -> list:
    """What makes `row` not a row of the schema (empty when it is one)."""
    if not isinstance(row, dict):
        return [f"not an object: {row!r}"]
    problems = [f"missing field {f!r}" for f in ROW_FIELDS if f not in row]
    problems += [f"unknown field {f!r}" for f in row if f not in ROW_FIELDS]
    for field, types in ROW_FIELDS.items():
        if field in row and (not isinstance(row[field], types) or isinstance(row[field], bool)):
            problems.append(f"{field} is {type(row[field]).__name__}, not {' or '.join(t.__name__ for t in types)}")
    if isinstance(row.get("value"), float) and not math.isfinite(row["value"]):
        problems.append(f"value is {row['value']}")
    machine = row.get("machine")
    if isinstance(machine, dict):
        if set(machine) != set(MACHINE_FIELDS):
            problems.append(f"machine has {sorted(machine)}, not {sorted(MACHINE_FIELDS)}")
        for field, types in MACHINE_FIELDS.items():
            value = machine.get(field)
            if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
                problems.append(f"machine.{field} is {type(value).__name__}")
    if isinstance(row.get("workload"), dict):
        for key, value in row["workload"].items():
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (str, int, float, bool, _NULL)) for v in items):
                problems.append(f"workload.{key} is not a JSON scalar or a list of them")
    if isinstance(row.get("date"), str):
        try:
            datetime.datetime.fromisoformat(row["date"])
        except ValueError:
            problems.append(f"date {row['date']!r} is not ISO 8601")
    return problems


def machine_summary(info) -> dict:
    """The row's machine from a machine_info() dict (or a run's JSON
    "machine", which is one)."""
    gpu = info.get("gpu") or {}
    return {"cpu_model": info.get("cpu_model"), "cores": info.get("usable_cpus"), "gpu": gpu.get("name"),
            "torch": info.get("torch"), "cuda": gpu.get("cuda")}


def commit_of(git):
    """A machine_info()["git"] as the row's commit: the hash, "-dirty" when
    the tree had changes; None where git could not say."""
    if not git:
        return None
    return git["commit"] + ("-dirty" if git.get("dirty") else "")




def make_row(context, workload, contender, metric, value, unit) -> dict:
    """One row: a run's shared fields (run_context) and one figure. Raises
    ValueError for a row the schema does not allow (a bool, a NaN, a string
    value), so a benchmark fails where it writes one, not in the report."""
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()  # a numpy scalar is a figure too; JSON wants Python's
    row = {"benchmark": context["benchmark"], "run": context["run"], "workload": dict(workload),
           "contender": contender, "metric": metric, "value": value, "unit": unit, "device": context["device"],
           "machine": dict(context["machine"]), "commit": context["commit"], "date": context["date"],
           "command": context["command"]}
    problems = row_problems(row)
    if problems:
        raise ValueError(f"not a result row ({'; '.join(problems)}): {row}")
    return row


def spread_rows(context, workload, contender, metric, values, unit) -> list:
    """The median, min and max of `values` as three rows (metric_median,
    metric_min, metric_max): the spread of a timing, as the schema keeps it."""
    return [make_row(context, workload, contender, f"{metric}_{name}", stat(values), unit)
            for name, stat in (("median", statistics.median), ("min", min), ("max", max))]


def figure_rows(context, workload, contender, figures) -> list:
    """Rows from (metric, value, unit) triples; a missing value (None) is no
    figure and no row."""
    return [make_row(context, workload, contender, metric, value, unit)
            for metric, value, unit in figures if value is not None]


def summary_figures(metric, summary, unit="ms") -> list:
    """A summarize_ms() dict ({median_ms, min_ms, max_ms}) as (metric_median,
    value, unit), (metric_min, ...), (metric_max, ...) figures; a statistic
    the summary lacks is a None value."""
    return [(f"{metric}_{stat}", summary.get(f"{stat}_ms"), unit) for stat in ("median", "min", "max")]


def read_rows_file(path) -> list:
    """The rows of one rows.jsonl, as written (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_rows(folder, rows) -> str:
    """Writes `rows` to folder/rows.jsonl, replacing the rows of the runs
    they belong to and keeping every other run's (several benchmarks may
    write into one run folder; writing a run again replaces it, in place, so
    that a converter run twice writes the same file). Returns the path."""
    for row in rows:
        problems = row_problems(row)
        if problems:
            raise ValueError(f"not a result row ({'; '.join(problems)}): {row}")
    path = os.path.join(folder, ROWS_FILE)
    old = read_rows_file(path) if os.path.exists(path) else []
    new_runs = {}
    for row in rows:
        new_runs.setdefault(row["run"], []).append(row)
    merged, placed = [], set()
    for row in old:
        if row["run"] not in new_runs:
            merged.append(row)
        elif row["run"] not in placed:  # a replaced run keeps its place in the file
            merged += new_runs[row["run"]]
            placed.add(row["run"])
    merged += [row for run, run_rows in new_runs.items() if run not in placed for row in run_rows]
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        for row in merged:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(temporary, path)
    return path


def read_rows(results_dir=RESULTS_DIR) -> list:
    """Every row under results_dir, each with "folder" (its run folder's
    name) added: folders in name order, rows in file order."""
    rows = []
    for name in sorted(os.listdir(results_dir)):
        path = os.path.join(results_dir, name, ROWS_FILE)
        if os.path.isfile(path):
            rows += [dict(row, folder=name) for row in read_rows_file(path)]
    return rows
