"""Helpers shared by the benchmarks: progress bars, peak RSS, machine info,
host copy bandwidth, summary statistics, Zipf-distributed ids, JSON and plots,
and result rows (one measured figure a row; see "result rows" below).

tqdm and matplotlib are optional (progress bars and plots only). psutil is
not used: on Linux it has no peak-RSS figure, which /proc/self/status (VmHWM)
gives directly.

Result rows. Every figure a benchmark measures is one row, a JSON object with
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
(benchmarks/report.py) renders docs/results.md's tables from them.
"""
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional: plain loops without it
    _tqdm = None

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
GIB = 1 << 30

# Dense Adam: one untimed step allocates its state; more would cost seconds each.
DENSE_ADAM_WARMUP = 1


def require_hostembed():
    """The hostembed module, or an exit that says how to build it."""
    try:
        import hostembed
    except ImportError as exc:
        sys.exit(f"cannot import hostembed ({exc}): build it with `python3 setup.py build_ext --inplace` "
                 "and run with PYTHONPATH=python, or pip install the package")
    return hostembed


def log(msg: str) -> None:
    """Progress notes go to stderr so that stdout holds only the report."""
    print(msg, file=sys.stderr, flush=True)


def progress(iterable, desc: str):
    """A bar on a terminal; nothing in a log file or a pipe, where tqdm's
    in-place redraws pile up as thousands of '\r' updates (the phase lines
    the benchmarks print say where a run is)."""
    if _tqdm is None or not sys.stderr.isatty():
        return iterable
    return _tqdm(iterable, desc=desc, file=sys.stderr, leave=False)


def fail(msg):
    """Ends the run with a non-zero status: a fast wrong answer is not a result."""
    sys.exit(f"\nCORRECTNESS CHECK FAILED: {msg}\nNo timings are reported for a wrong answer.")


def summarize_ms(seconds) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def fmt_ms(ms):
    return f"{ms:,.1f}" if ms >= 100 else f"{ms:.2f}"


def fmt_gib(nbytes):
    return "n/a" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def synchronize(device) -> None:
    """Waits for the device's queued work, so the clock measures it (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- workload -------------------------------------------------------------------

class ZipfIds:
    """Ids Zipf(alpha)-distributed over ranks 1..rows (bounded Zipf by inverse CDF).

    A random permutation maps rank -> row, so the hot rows are scattered
    over the table as in a real vocabulary. Draws come from `rng`, which the
    caller may share with other draws to keep one seed for a whole workload.
    """

    def __init__(self, rows, alpha, rng):
        cdf = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
        np.cumsum(cdf, out=cdf)  # in place: at 10^8 rows every float64 copy is 800 MB
        cdf /= cdf[-1]
        self._cdf = cdf
        self._rank_to_row = rng.permutation(rows).astype(np.int64)
        self._rng = rng

    def draw(self, n) -> torch.Tensor:
        """n int64 ids."""
        # side="right" and the clip keep u == cdf[-1] == 1.0 in range.
        ranks = np.minimum(np.searchsorted(self._cdf, self._rng.random(n), side="right"), len(self._cdf) - 1)
        return torch.from_numpy(self._rank_to_row[ranks])


def zipf_batches(rows, batch, alpha, count, seed):
    """`count` batches of `batch` int64 ids drawn by ZipfIds(rows, alpha)."""
    ids = ZipfIds(rows, alpha, np.random.default_rng(seed))
    return [ids.draw(batch) for _ in range(count)]


def add_sharded_workload_args(p):
    """The workload options of the sharded-table benchmarks (sharded_step.py
    and its TorchRec peer): one table, a global batch split over P processes."""
    p.add_argument("--procs", default="1,2,4", help="process counts")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65_536, help="ids a step, all processes together")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batches", type=int, default=4, help="distinct global batches, cycled")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)


def sharded_global_batches(args):
    """The global batches those options describe: the same draws in every
    script that takes them."""
    return zipf_batches(args.rows, args.batch, args.alpha, args.batches, seed=0)


# --- peak RSS ---------------------------------------------------------------

def _vm_hwm_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_vm_hwm() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0),
    # which lets each contender report its own peak in one process.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """The process's peak RSS, and the peak within windows started by start()."""

    def __init__(self):
        self.overall = 0
        self._resettable = False

    def _read(self):
        hwm = _vm_hwm_bytes()
        if hwm is None:  # not Linux: ru_maxrss is the process peak (KiB on Linux, bytes on macOS)
            scale = 1 if sys.platform == "darwin" else 1024
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        self.overall = max(self.overall, hwm)
        return hwm

    def start(self) -> None:
        self._read()
        self._resettable = _reset_vm_hwm()

    def window(self):
        """Peak since start(), or None where the peak cannot be reset."""
        hwm = self._read()
        return hwm if self._resettable else None


# --- machine ----------------------------------------------------------------

def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit():
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def _meminfo_bytes(key):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_available_bytes():
    """What the kernel says can be allocated now without swapping (None where unknown)."""
    return _meminfo_bytes("MemAvailable")


def gpu_info():
    """The CUDA device torch would use, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "total_memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda}


def machine_info(**extra) -> dict:
    # Imported here so that the other helpers work without a built hostembed.
    import hostembed
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "mem_total_bytes": _meminfo_bytes("MemTotal"),
        "gpu": gpu_info(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "hostembed": hostembed.__version__,
        "hostembed_path": os.path.dirname(hostembed.__file__),
        "git": _git_commit(),
        **extra,
    }


# --- other load on the machine -------------------------------------------------

def _busy_cpu_seconds():
    # /proc/stat's first line: user nice system idle iowait irq softirq steal ... in clock ticks.
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much CPU other processes (and the hypervisor, as steal) took while
    we ran: on a small shared machine they are the main source of noise."""

    def __init__(self):
        self._wall = time.perf_counter()
        self._busy = _busy_cpu_seconds()
        self._own = sum(os.times()[:4])  # children too: a benchmark's own processes are not other load
        self.loadavg_before = os.getloadavg()

    def fraction(self, min_seconds=0.2):
        """Others' share of all usable CPUs since construction; None where
        unknown or where the window is too short for 10 ms accounting ticks."""
        busy, wall = _busy_cpu_seconds(), time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall < min_seconds:
            return None
        others = (busy - self._busy) - (sum(os.times()[:4]) - self._own)
        return max(0.0, others / (wall * usable_cpus()))


# --- host memory bandwidth ----------------------------------------------------

def copy_bandwidth(nbytes: int, repeats: int, threads: int) -> dict:
    """Host copy bandwidth of dst.copy_(src) with `threads` torch threads.

    Counts read + write (2 x nbytes per copy), the same way the benchmarks
    count their own traffic. One untimed copy first so that the page faults
    of dst are not timed.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        numel = nbytes // 4
        src = torch.ones(numel, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
        del src, dst
    finally:
        torch.set_num_threads(saved)
    median_s = statistics.median(seconds)
    return {
        "threads": threads,
        "buffer_bytes": numel * 4,
        "repeats": repeats,
        "median_s": median_s,
        "bytes_per_s": 2 * numel * 4 / median_s,
        "all_bytes_per_s": [2 * numel * 4 / s for s in seconds],
    }


# --- output files ---------------------------------------------------------------------

PLOTS_SKIPPED = ("plots skipped: matplotlib is not installed "
                 "(get them with `pip install matplotlib`, or `pip install '.[bench]'`)")


def write_json(path, report) -> None:
    """Written whole or not at all (a run killed by its time limit mid-write
    leaves the last complete file for a later --append)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(temporary, path)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(out_dir, figures):
    """Draws and saves PNGs; figures maps a file name to draw(plt) -> Figure.

    Returns (paths written, None), or ([], PLOTS_SKIPPED) without matplotlib:
    plots are optional and never worth failing a benchmark over.
    """
    plt = _pyplot()
    if plt is None:
        return [], PLOTS_SKIPPED
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, draw in figures.items():
        fig = draw(plt)
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths, None


# --- result rows: one measured figure a row ---------------------------------------------

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


def run_context(benchmark, *, run=None, device="cpu", info=None, command=None, date=None) -> dict:
    """The fields every row of one run shares, for a benchmark writing the
    rows of the run it just made: the machine and commit from machine_info()
    (or `info`), the date and time now (UTC), the command line it was
    started with, and `run` (by default the benchmark and the time, so that
    a second run adds rows instead of replacing the first's). `device`: the
    torch device the benchmark measured on; a CUDA one is named by its GPU."""
    info = machine_info() if info is None else info
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    date = now.isoformat() if date is None else date
    if torch.device(device).type == "cuda":
        device = (info.get("gpu") or {}).get("name") or "cuda"
    else:
        device = torch.device(device).type
    if command is None:
        command = " ".join(["python", os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:])
    return {"benchmark": benchmark, "run": run or f"{benchmark}-{now.strftime('%Y%m%dT%H%M%SZ')}",
            "device": device, "machine": machine_summary(info), "commit": commit_of(info.get("git")),
            "date": date, "command": command}


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
