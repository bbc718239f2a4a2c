"""Helpers shared by the benchmarks: progress bars, peak RSS, machine info,
host copy bandwidth, summary statistics, Zipf-distributed ids, JSON and plots,
and the fields a run's result rows share (run_context). The rows' schema,
checks and files are _rows.py's, re-exported here so that a script takes
every helper from one module.

tqdm and matplotlib are optional (progress bars and plots only). psutil is
not used: on Linux it has no peak-RSS figure, which /proc/self/status (VmHWM)
gives directly.
"""
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from _rows import (MACHINE_FIELDS, RESULTS_DIR, ROW_FIELDS, ROWS_FILE, commit_of, figure_rows,  # noqa: F401
                   machine_summary, make_row, read_rows, read_rows_file, row_problems, spread_rows,
                   summary_figures, write_rows)

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional: plain loops without it
    _tqdm = None

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def device_label(device="cpu"):
    """'h100', 'h200', ... from a CUDA device's GPU name; 'cpu' otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else name.split()[-1]).lower()


def run_folder(device="cpu"):
    """Where a run's JSON and rows go unless told otherwise: the results
    folder of this device and day (benchmarks/results/<device>-<date>/),
    so that no run lands outside a run folder."""
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return os.path.join(RESULTS_DIR, f"{device_label(device)}-{today}")


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


# --- result rows: what a run's rows share (the rows themselves: _rows.py) ------------------

def run_context(benchmark, *, run=None, device="cpu", info=None, command=None, date=None) -> dict:
    """The fields every row of one run shares, for a benchmark writing the
    rows of the run it just made: the machine and commit from machine_info()
    (or `info`), the date and time now (UTC), the command line it was
    started with, and `run` (by default the benchmark and the time, so that
    a second run adds rows instead of replacing the first's). `device`: the
    torch device the benchmark measured on; a CUDA one is named by its GPU."""
    info = machine_info() if info is None else info
    exact = datetime.datetime.now(datetime.timezone.utc)
    now = exact.replace(microsecond=0)
    date = now.isoformat() if date is None else date
    if torch.device(device).type == "cuda":
        device = (info.get("gpu") or {}).get("name") or "cuda"
    else:
        device = torch.device(device).type
    if command is None:
        command = " ".join(["python", os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:])
    # To the microsecond: two runs of one benchmark into one folder in the
    # same second must not replace each other's rows (write_rows replaces a run).
    return {"benchmark": benchmark, "run": run or f"{benchmark}-{exact.strftime('%Y%m%dT%H%M%S.%fZ')}",
            "device": device, "machine": machine_summary(info), "commit": commit_of(info.get("git")),
            "date": date, "command": command}
