"""SparseAdam(update="auto"): where a GPU-fed table's update runs is settled
by timing both places on the first steps (the GPU side of it is in
test_gpu.py; the choice itself is plain logic, tested here)."""
import pytest

import hostembed
from hostembed.optim.update_choice import UpdateChooser


def run(chooser, seconds):
    """Feeds the chooser until it settles; returns the modes it asked for."""
    asked = []
    while not chooser.settled:
        mode = chooser.next_mode()
        asked.append(mode)
        chooser.record(mode, seconds[mode])
        assert len(asked) <= 2 * (UpdateChooser.WARMUP + UpdateChooser.TRIALS), "never settles"
    return asked


@pytest.mark.parametrize("gpu, cpu, expected", [(0.020, 0.0148, "cpu"), (0.010, 0.030, "gpu"), (0.01, 0.01, "cpu")])
def test_keeps_the_faster_mode(gpu, cpu, expected):
    chooser = UpdateChooser()
    asked = run(chooser, {"gpu": gpu, "cpu": cpu})
    assert chooser.choice == expected
    # Both modes were tried as often, alternating, warm-up included.
    assert asked.count("gpu") == asked.count("cpu") == UpdateChooser.WARMUP + UpdateChooser.TRIALS
    assert all(a != b for a, b in zip(asked, asked[1:]))
    assert chooser.next_mode() == expected
    chooser.record("gpu" if expected == "cpu" else "cpu", 0.0)  # late samples change nothing
    assert chooser.choice == expected


def test_warm_up_step_is_not_counted():
    # The first GPU step pins the whole optimizer state: very slow, once.
    chooser = UpdateChooser()
    first = {"gpu": True}
    while not chooser.settled:
        mode = chooser.next_mode()
        if mode == "gpu" and first["gpu"]:
            chooser.record(mode, 10.0)
            first["gpu"] = False
        else:
            chooser.record(mode, 0.010 if mode == "gpu" else 0.020)
    assert chooser.choice == "gpu"


def test_median_not_mean():
    chooser = UpdateChooser()
    gpu_times = iter([1.0, 0.010, 0.010, 5.0])  # one outlier among the counted ones
    while not chooser.settled:
        mode = chooser.next_mode()
        chooser.record(mode, next(gpu_times) if mode == "gpu" else 0.015)
    assert chooser.choice == "gpu"


def test_default_is_auto():
    emb = hostembed.Embedding(10, 2)
    assert hostembed.SparseAdam(emb.parameters()).update == "auto"
