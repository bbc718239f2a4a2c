"""Where SparseAdam updates a table whose gradient came from the GPU,
settled by timing both places on this machine.

The update can run on the CPU (the core's threads over w, m, v in host
memory: 28 bytes of host-memory traffic per element) or on the GPU (a
kernel reading and writing w, m, v over PCIe through the pinned mapping:
12 bytes each way per element). Which wins depends on the machine: on an
H100 box with 16 cores the CPU update took 14.8 ms and the GPU one 20.0 ms
for the same rows, while a box with few cores or slow memory goes the other
way. Both give the same bits, so the first steps of training can time each
in turn at no cost to the result.
"""
import statistics

MODES = ("gpu", "cpu")


class UpdateChooser:
    """Alternates the two modes over the first steps, then keeps the faster.

    The first step in each mode is not counted: the GPU one pins the
    optimizer state (every page), the CPU one may fault pages in.
    """

    WARMUP = 1
    TRIALS = 3

    def __init__(self):
        self.seconds = {mode: [] for mode in MODES}
        self.choice = None

    def next_mode(self) -> str:
        if self.choice is not None:
            return self.choice
        return "gpu" if len(self.seconds["gpu"]) <= len(self.seconds["cpu"]) else "cpu"

    @property
    def settled(self) -> bool:
        return self.choice is not None

    def record(self, mode: str, seconds: float) -> None:
        if self.choice is not None:
            return
        self.seconds[mode].append(seconds)
        if all(len(s) >= self.WARMUP + self.TRIALS for s in self.seconds.values()):
            median = {m: statistics.median(s[self.WARMUP:]) for m, s in self.seconds.items()}
            # A tie goes to the CPU: it needs neither pinned state nor the
            # gradient kept on the GPU.
            self.choice = "gpu" if median["gpu"] < median["cpu"] else "cpu"
