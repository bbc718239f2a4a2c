"""The GPU row cache's planner (cuda/cache_plan.cu) against its host twin,
the CPU planner (csrc/cache_plan.c), on fixed streams: every batch's slots
and evictions, and at the end where every row is, for each policy. With a
GPU it records the GPU's decisions to a file and compares them with the
CPU's; CI replays the CPU planner against the recorded file
(tests/test_cache_plan.py), so a change of either planner that makes them
differ fails without a GPU. tests/fixtures/gpu_cache_plans.pt holds the
clock policy's (CONFIGS, recorded on an H200 on 2026-11-26); the frequency
policy's (FREQUENCY_CONFIGS) wait for a GPU to record them.

    python benchmarks/cache/cache_plan_record.py OUT.pt     # a GPU: record and compare
"""
import sys

import torch

# Small streams that go through every case: caches of 1 slot to most of
# the rows touched, batches planned a step ahead (protect 2) or not, empty
# batches, the counts' ageing (every 10 batches), misses beyond what one
# round of the hand finds.
CONFIGS = (
    dict(rows=3000, capacity=40, protect=2, seed=1),
    dict(rows=3000, capacity=400, protect=1, seed=2),
    dict(rows=3000, capacity=2500, protect=2, seed=3),
    dict(rows=500, capacity=1, protect=2, seed=4),
)
# The frequency policy on the same streams; on streams whose rows recur a
# few batches apart (fresh=True: each batch's draws half from the last
# batches' rows), where its window opens; and on one in three phases
# (phased=True: skewed, then recurring, then replayed batches of random
# sizes), where the window opens, changes size and shuts.
FREQUENCY_CONFIGS = tuple(dict(c, policy="frequency") for c in CONFIGS) + (
    dict(rows=20000, capacity=1500, protect=2, seed=5, policy="frequency", fresh=True),
    dict(rows=20000, capacity=1500, protect=1, seed=6, policy="frequency", fresh=True),
    dict(rows=3000, capacity=1200, protect=2, seed=8, policy="frequency", phased=True),
)
ALL_CONFIGS = CONFIGS + FREQUENCY_CONFIGS
BATCHES = 45


def stream(config):
    """The config's batches: ascending distinct rows, skewed, some empty."""
    if config.get("phased"):
        return _phased_stream(config)
    gen = torch.Generator().manual_seed(config["seed"])
    batches = []
    for b in range(BATCHES):
        if b % 13 == 7:
            batches.append(torch.empty(0, dtype=torch.int64))
            continue
        u = torch.rand(250, generator=gen, dtype=torch.float64)
        rows = (config["rows"] * u ** 4).long()
        if config.get("fresh") and b > 2:
            # Half the draws: rows new in one of the last three batches.
            recent = torch.cat(batches[-3:])
            pick = torch.randint(recent.numel(), (125,), generator=gen)
            rows = torch.cat([rows[:125], recent[pick] if recent.numel() else rows[125:],
                              torch.randint(config["rows"], (250,), generator=gen)])
        batches.append(torch.unique(rows))
    return batches


def _phased_stream(config):
    """Phases of 15 batches of 1 to 299 draws: skewed; a third skewed, the
    rest from the last three batches' rows and uniform; the batches of 15
    before again. Every 11th batch (from the 6th) empty."""
    gen, rows, batches = torch.Generator().manual_seed(config["seed"]), config["rows"], []
    for b in range(BATCHES):
        if b % 11 == 5:
            batches.append(torch.empty(0, dtype=torch.int64))
            continue
        size = int(torch.randint(1, 300, (1,), generator=gen))
        u = torch.rand(size, generator=gen, dtype=torch.float64)
        drawn = (rows * u ** 4).long()
        recent = torch.cat(batches[-3:]) if len(batches) > 2 else torch.empty(0, dtype=torch.int64)
        if (b // 15) % 3 == 1 and recent.numel():
            drawn = torch.cat([drawn[:size // 3], recent[torch.randint(recent.numel(), (size,), generator=gen)],
                               torch.randint(rows, (size,), generator=gen)])
        elif (b // 15) % 3 == 2 and batches[b - 15].numel():
            drawn = batches[b - 15]
        batches.append(torch.unique(drawn))
    return batches


def cpu_decisions(config):
    """[(slot, evict_slot, evict_row) a batch], slot of every row at the end."""
    from hostembed._core.ops.cache_plan import CachePlanner
    planner = CachePlanner(config["rows"], config["capacity"], lookahead=config["protect"] == 2,
                           policy=config.get("policy", "clock"))
    out = []
    for unique in stream(config):
        plan = planner.plan(unique)
        out.append((plan.slot.clone(), plan.evict_slot.clone(), plan.evict_row.clone()))
    return out, planner.slots_of(torch.arange(config["rows"]))


def gpu_decisions(config, device="cuda"):
    """cpu_decisions' lists, made by the GPU planner."""
    from hostembed._core.ops.gpu_cache import GpuCacheState
    state = GpuCacheState(config["rows"], config["capacity"], config["protect"], device,
                          config.get("policy", "clock"))
    out = []
    for unique in stream(config):
        n = unique.numel()
        plan = state.plan(unique.to(device), n)
        misses = int(state.counters[2]) if n else 0
        slot = plan.slot[:n].cpu()
        miss, evict_row = plan.miss[:misses].cpu(), plan.evict_row[:misses].cpu()
        evicting = evict_row >= 0
        out.append((slot, slot[miss[evicting]], evict_row[evicting]))
    entry = state.entry.cpu()[:config["rows"]].long() & ((1 << 28) - 1)
    return out, (entry - 1).to(torch.int32)


def differences(a, b):
    """Where two decision lists differ (empty: nowhere)."""
    found = []
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        for name, u, v in zip(("slot", "evict_slot", "evict_row"), x, y):
            if not torch.equal(u.long(), v.long()):
                found.append(f"batch {i}: {name}")
    if len(a[0]) != len(b[0]):
        found.append("batch counts")
    if not torch.equal(a[1].long(), b[1].long()):
        found.append("final slots")
    return found


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(argv) != 1:
        sys.exit(__doc__)
    recorded = []
    for config in ALL_CONFIGS:
        gpu = gpu_decisions(config)
        diff = differences(gpu, cpu_decisions(config))
        print(f"{config}: {'the same decisions' if not diff else 'DIFFER: ' + ', '.join(diff[:5])}")
        recorded.append({"config": config, "batches": gpu[0], "final": gpu[1]})
        if diff:
            raise SystemExit(1)
    torch.save({"device": torch.cuda.get_device_name(), "recorded": recorded}, argv[0])
    print(f"recorded to {argv[0]}")


if __name__ == "__main__":
    main()
