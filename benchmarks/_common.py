"""Helpers shared by the benchmarks: progress bars, peak RSS, machine info,
host copy bandwidth, summary statistics.

tqdm is optional (progress bars only). psutil is not used: on Linux it has no
peak-RSS figure, which /proc/self/status (VmHWM) gives directly.
"""
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional: plain loops without it
    _tqdm = None

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def log(msg: str) -> None:
    """Progress notes go to stderr so that stdout holds only the report."""
    print(msg, file=sys.stderr, flush=True)


def progress(iterable, desc: str):
    if _tqdm is None:
        return iterable
    return _tqdm(iterable, desc=desc, file=sys.stderr, leave=False)


def summarize_ms(seconds) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


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


def _mem_total_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info(**extra) -> dict:
    # Imported here so that the other helpers work without a built hostembed.
    import numpy
    import hostembed
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "mem_total_bytes": _mem_total_bytes(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
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
        self._own = sum(os.times()[:2])
        self.loadavg_before = os.getloadavg()

    def fraction(self, min_seconds=0.2):
        """Others' share of all usable CPUs since construction; None where
        unknown or where the window is too short for 10 ms accounting ticks."""
        busy, wall = _busy_cpu_seconds(), time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall < min_seconds:
            return None
        others = (busy - self._busy) - (sum(os.times()[:2]) - self._own)
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
