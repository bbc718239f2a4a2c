"""benchmarks/cache/_cache_oracles.py, the yardsticks benchmarks/cache/cache_plan.py
--protocol holds the row cache's policy against: the static top-frequency
cache and Belady's optimum on hand-made streams whose hit rates are worked
out below, and the simulator of the shipped policy against the CPU planner
itself (the simulator's other candidates are only as good as that match)."""
import pathlib

import numpy as np
import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def oracles(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # _common
    monkeypatch.syspath_prepend(str(BENCHMARKS / "cache"))
    import _cache_oracles
    return _cache_oracles


def stream(oracles, batches, warmup, rows=5):
    return oracles.Stream("hand", rows, [np.array(b, dtype=np.int64) for b in batches], warmup, rows, {})


def test_static_and_belady_on_a_hand_made_stream(oracles):
    # Batches using each row: 0 three, 1, 2 and 3 two, 4 one. Timed: the
    # last three batches, 2 + 2 + 3 = 7 unique rows.
    s = stream(oracles, [[0, 1, 2], [0, 3], [0, 1], [2, 3, 4]], warmup=1)
    # One slot: row 0, hit in [0, 3] and [0, 1].
    assert oracles.static_top(s, 1) == pytest.approx(2 / 7)
    # Two: row 0 and, of the rows used twice, the lowest, 1: hits 1 + 2 + 0.
    assert oracles.static_top(s, 2) == pytest.approx(3 / 7)
    # Belady, one slot: after [0,1,2] it keeps 0 (next used first), which
    # [0,3] and [0,1] hit; 3's next use (the last batch) is farther than
    # 0's, so 3 bypasses; after [0,1] nothing cached is used again.
    assert oracles.belady(s, 1) == pytest.approx(2 / 7)
    # Two slots: 0 and 1 kept, 3 bypassed (used after both): hits 1 + 2 + 0.
    assert oracles.belady(s, 2) == pytest.approx(3 / 7)


def test_belady_follows_a_moving_hot_set_and_bypasses(oracles):
    # Each row used by two batches in a row: a fixed cache of one row hits
    # once; Belady keeps each row for its second batch.
    moving = stream(oracles, [[0], [0], [1], [1], [2], [2]], warmup=0)
    assert oracles.static_top(moving, 1) == pytest.approx(2 / 6)
    assert oracles.belady(moving, 1) == pytest.approx(3 / 6)
    # Alternating rows, one slot: 1's next use comes after 0's, so 1
    # bypasses and 0 is hit once (an LRU cache would hit nothing).
    alternating = stream(oracles, [[0], [1], [0], [1]], warmup=0)
    assert oracles.belady(alternating, 1) == pytest.approx(1 / 4)
    # The static cache holds its rows before the first batch, which no
    # online policy can: here it beats Belady (from an empty cache).
    assert oracles.static_top(alternating, 1) == pytest.approx(2 / 4)
    assert oracles.belady(alternating, 2) == pytest.approx(2 / 4)


@pytest.mark.parametrize("protocol, scale", [("dynamicemb", 0.005), ("replayed", 0.001), ("fbgemm", 0.01)])
def test_the_simulator_of_each_shipped_policy_is_the_cpu_planner(oracles, protocol, scale):
    from cache_plan import planner_hit_rate  # beside _cache_oracles, on the path the fixture set
    s = oracles.load(protocol, scale)
    opened = False
    for fraction in (0.5, 0.1):
        capacity = max(1, round(fraction * s.base))
        for protect in (1, 2):
            for name, policy in oracles.SHIPPED.items():
                # Exact: the same decisions batch by batch give the same hits.
                report = {}
                assert oracles.simulate(s, capacity, policy, protect, report) == \
                    planner_hit_rate(s, capacity, protect, name), (fraction, protect, name)
                opened |= report["window_opened"]
    # FBGEMM's stream brings rows back a few batches apart: the frequency
    # policy's window opens there, and the planner follows it too.
    assert opened == (protocol == "fbgemm")
