"""The GPU's frequency planner (cuda/he_cuda_cache_frequency.cuh: its
kernels, and he_cache_plan_frequency, the order they run in), run on the
host over device_shim.h (tests/kernel_twin/cache_frequency.cpp: a plain
prefix sum and std::sort where the GPU has CUB's), against the CPU planner
(csrc/cache_plan.c) batch by batch: every batch's slots and evictions, and
at the end where every row is, on the streams benchmarks/cache/
cache_plan_record.py records from a GPU (the window opens on two of them).

Not covered: CUB's scans and sorts (their results are defined: a prefix
sum; keys ascending, distinct), the GPU's scheduling of the kernels' races
(none decide anything: distinct slots and rows; tests/test_cache_gpu.py
compares the GPU planner itself when a GPU is lent)."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernel_twin_build import build_twin

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "cache"), str(BENCHMARKS)]  # the oracles import benchmarks/_common
import _cache_oracles as oracles  # noqa: E402  (benchmarks/ on the path first)
import cache_plan_record  # noqa: E402

SLOT_MASK = (1 << 28) - 1  # include/he_cache_policy.h: slot + 1 in the entry's low bits


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    return build_twin(tmp_path_factory.mktemp("cache_twin"), "cache_frequency", ("status",))


def _twin_decisions(harness, folder, config):
    """cache_plan_record.gpu_decisions' lists, made by the twin."""
    batches = cache_plan_record.stream(config)
    blob = [np.array([config["rows"], config["capacity"], config["protect"], len(batches)], dtype=np.int64)]
    for unique in batches:
        blob += [np.array([unique.numel()], dtype=np.int64), unique.numpy().astype(np.int64)]
    (folder / "in.bin").write_bytes(b"".join(a.tobytes() for a in blob))
    res = subprocess.run([harness, folder / "in.bin", folder / "out.bin"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the planner's twin failed ({res.returncode}): {res.stderr}"
    data, at, out = (folder / "out.bin").read_bytes(), 0, []

    def take(dtype, count):
        nonlocal at
        width = np.dtype(dtype).itemsize * count
        array = torch.from_numpy(np.frombuffer(data, dtype=dtype, count=count, offset=at).copy())
        at += width
        return array

    windows = []
    for _ in batches:
        n, misses, window = take(np.int64, 3).tolist()
        windows.append(window)
        slot = take(np.int32, n)
        miss, evict_row = take(np.int64, misses), take(np.int64, misses)
        evicting = evict_row >= 0
        out.append((slot, slot[miss[evicting]], evict_row[evicting]))
    entry = take(np.uint32, config["rows"]).long()
    assert at == len(data), "the twin wrote more than its plans"
    return (out, ((entry & SLOT_MASK) - 1).to(torch.int32)), windows


@pytest.mark.parametrize("config", cache_plan_record.FREQUENCY_CONFIGS,
                         ids=lambda c: f"capacity{c['capacity']}-seed{c['seed']}")
def test_the_gpu_frequency_planner_makes_the_cpu_planners_decisions(harness, tmp_path, config):
    twin, windows = _twin_decisions(harness, tmp_path, config)
    cpu = cache_plan_record.cpu_decisions(config)
    assert cache_plan_record.differences(twin, cpu) == []
    if config["capacity"] in (40, 400, 1200, 1500):  # where slots change hands
        assert sum(len(evicted) for _, _, evicted in twin[0]) > 0
    # The window the GPU's gate sizes after each batch is the simulator's
    # (benchmarks/cache/_cache_oracles.py, which makes the CPU planner's
    # decisions): on the recurring streams it opens, on the phased one it
    # opens, changes size and shuts.
    stream = oracles.Stream("twin", config["rows"], [b.numpy().astype(np.int64) for b in
                                                    cache_plan_record.stream(config)], 0, config["capacity"], {})
    report = {}
    oracles.simulate(stream, config["capacity"], oracles.FREQUENCY, config["protect"], report)
    assert windows == report["windows"]
    if config.get("fresh"):
        assert max(windows) > 0
    if config.get("phased"):
        assert len(set(windows) - {0}) >= 3 and 0 in windows[windows.index(max(windows)):]
