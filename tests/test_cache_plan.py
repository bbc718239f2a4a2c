"""The row cache's planner through its binding, against a model of what
the cache holds: every plan, applied to the model, must put each of the
batch's rows where it says, never evict a row in use, and flag exactly the
fetches of rows the last batch updated in host memory. (The C tests train
through a cache of CPU records and compare bits with no cache.)"""
import json
import pathlib

import pytest
import torch

from hostembed._cache.row_cache import RowCache
from hostembed._core.ops import update as _ops
from hostembed._core.ops.cache_plan import CachePlanner
from hostembed._core.table import HostTable


def _skewed_batch(gen, rows, count):
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return torch.unique((rows * u ** 4).long())


@pytest.mark.parametrize("policy", ["frequency", "clock"])
@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("capacity", [1, 40, 400, 5000])
def test_plans_keep_the_cache_model_consistent(lookahead, capacity, policy):
    rows, gen = 3000, torch.Generator().manual_seed(capacity + lookahead)
    planner = CachePlanner(rows, capacity, lookahead=lookahead, policy=policy)
    held = {}  # slot -> row
    previous, previous_bypassed = set(), set()
    totals = dict(rows=0, hits=0, fetches=0, evictions=0, bypassed=0)
    for _ in range(60):
        unique = _skewed_batch(gen, rows, 250)
        batch = set(unique.tolist())
        cached_before = set(held.values())
        plan = planner.plan(unique)
        evicted = plan.evict_row.tolist()
        for slot, row in zip(plan.evict_slot.tolist(), evicted):
            assert held.pop(slot) == row
        # Never a row of this batch, nor (planned a step ahead) of the last.
        assert not set(evicted) & batch
        if lookahead:
            assert not set(evicted) & previous
        fetched = plan.fetch_row.tolist()
        assert fetched == sorted(fetched) and not set(fetched) & cached_before
        for slot, row in zip(plan.fetch_slot.tolist(), fetched):
            assert slot not in held
            held[slot] = row
        assert plan.fetch_after_update.tolist() == [row in previous_bypassed for row in fetched]
        bypassed = set()
        for row, slot in zip(unique.tolist(), plan.slot.tolist()):
            if slot < 0:
                bypassed.add(row)
                assert row not in held.values()
            else:
                assert held[slot] == row
        assert len(held) <= capacity
        totals["rows"] += len(batch)
        totals["hits"] += len(batch & cached_before)
        totals["fetches"] += len(fetched)
        totals["evictions"] += len(evicted)
        totals["bypassed"] += len(bypassed)
        previous, previous_bypassed = batch, bypassed
    stats = planner.stats
    assert stats == dict(batches=60, **totals)
    assert stats["hits"] + stats["fetches"] + stats["bypassed"] == stats["rows"]
    if capacity >= 5000:
        assert stats["evictions"] == 0 and stats["bypassed"] == 0
    if capacity <= 40:
        assert stats["bypassed"] > 0


def test_bad_batches_are_refused_and_change_nothing():
    planner = CachePlanner(10, 4)
    planner.plan(torch.tensor([1, 2, 3]))
    before = planner.stats
    with pytest.raises(IndexError, match=r"row 10 at 1 is not in \[0, 10\)"):
        planner.plan(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="ascending and distinct"):
        planner.plan(torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="1-D int64 CPU tensor"):
        planner.plan(torch.tensor([1, 2], dtype=torch.int32))
    assert planner.stats == before
    assert planner.plan(torch.tensor([1, 2, 3])).slot.tolist() == [0, 1, 2]  # all hits, as before
    with pytest.raises(ValueError, match="capacity"):
        CachePlanner(10, 0)


def test_cache_benchmark_finds_every_row_of_a_replayed_stream_in_a_full_cache(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "cache"))
    import cache_plan
    out = tmp_path / "plan.json"
    cache_plan.main(["--rows", "20000", "--batch", "4000", "--stream", "4", "--warmup", "4", "--steps", "8",
                     "--fractions", "1,0.2", "--json", str(out)])
    sizes = json.loads(out.read_text())["sizes"]
    full, small = sizes["1"], sizes["0.2"]
    assert full["hit_rate"] == 1.0 and full["record_bytes_per_step"] == 0
    # The frequency policy settles on a replayed stream: its rows stay, the
    # rest bypass the cache, nothing churns.
    assert 0 < small["hit_rate"] < 1 and small["bypassed_per_step"] > 0 and small["evictions_per_step"] == 0


# ---- the executor: training through a cache of CPU records

OPTIMIZERS = {  # kind: (state keys and whether per row, hyperparameters)
    "SparseAdam": (_ops.ADAM, {"exp_avg": False, "exp_avg_sq": False},
                   dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1)),
    "SGD": (_ops.SGD, {}, dict(lr=0.1)),
    "Adagrad": (_ops.ADAGRAD, {"sum": False}, dict(lr=0.1, eps=1e-6, lr_decay=0.01)),
    "RowWiseAdagrad": (_ops.ROWWISE_ADAGRAD, {"row_sum": True}, dict(lr=0.1, eps=1e-6)),
}


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_through_a_small_cache_gives_the_uncached_bits(name, lookahead):
    # 100 skewed batches through a 96-slot cache (many evictions and
    # bypassed rows), planned after each step or a step ahead (then before
    # the step's update, with the flagged fetches after it): every batch
    # reads the uncached table's rows, and after a flush the weights and
    # state are the uncached table's bits.
    kind, layout, hyper = OPTIMIZERS[name]
    rows, dim, capacity, warm, steps = 3000, 8, 96, 3, 100
    gen = torch.Generator().manual_seed(5)
    tables = [HostTable(rows, dim) for _ in range(2)]
    init = torch.randn(rows, dim, generator=gen)
    states = [{k: t.zeros(per_row=per_row) for k, per_row in layout.items()} for t in tables]
    for key, per_row in layout.items():  # state already trained: attach_state must bring it in
        value = torch.rand(rows if per_row else (rows, dim), generator=gen)
        for state in states:
            state[key].copy_(value)
    for t in tables:
        t.tensor.copy_(init)
    cache = RowCache(tables[1], capacity, lookahead=lookahead)
    batches = [_skewed_batch(gen, rows, 300) for _ in range(warm + steps)]
    for unique in batches[:warm]:  # lookups before the optimizer's first step (no update to wait for)
        plan = cache.plan(unique)
        cache.finish(plan)
        assert torch.equal(cache.rows(plan, unique), tables[0].tensor[unique])
    for key in layout:
        cache.attach_state(key, states[1][key])
    batches = batches[warm:]
    plans = [cache.plan(batches[0])]
    cache.finish(plans[0])
    for b, unique in enumerate(batches):
        plan = plans[b]
        assert torch.equal(cache.rows(plan, unique), tables[0].tensor[unique]), f"stale rows at step {b}"
        if lookahead and b + 1 < steps:
            plans.append(cache.plan(batches[b + 1]))  # before this step's update
        grad = torch.randn(unique.numel(), dim, generator=gen)
        step = dict(hyper, step=b + 1, maximize=False)
        _ops.sparse_update(kind, tables[0].tensor, states[0], unique, grad, **step)
        cache.update(kind, states[1], unique, grad, **step)
        if lookahead and b + 1 < steps:
            cache.finish(plans[b + 1])
        elif b + 1 < steps:
            plans.append(cache.plan(batches[b + 1]))
    cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)
    for key in layout:
        assert torch.equal(states[1][key], states[0][key]), key
    stats = cache.planner.stats
    assert stats["hits"] > 0 and stats["evictions"] > 0 and stats["bypassed"] > 0


def test_a_gradient_spanning_batches_updates_rows_where_they_are_now():
    # Two lookups before one step (weight.grad holds both batches): the
    # second plan may evict rows of the first; the update finds each row
    # in its slot or, written back, in host memory.
    rows, dim = 400, 4
    tables = [HostTable(rows, dim) for _ in range(2)]
    init = torch.randn(rows, dim)
    for t in tables:
        t.tensor.copy_(init)
    states = [{"exp_avg": t.zeros(), "exp_avg_sq": t.zeros()} for t in tables]
    cache = RowCache(tables[1], 8)
    for key in states[1]:
        cache.attach_state(key, states[1][key])
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 30):
        first, second = _skewed_batch(gen, rows, 20), _skewed_batch(gen, rows, 20)
        cache.plan(first)
        cache.plan(second)
        indices = torch.unique(torch.cat([first, second]))
        grad = torch.randn(indices.numel(), dim, generator=gen)
        hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=step, maximize=False)
        _ops.sparse_update(_ops.ADAM, tables[0].tensor, states[0], indices, grad, **hyper)
        cache.update(_ops.ADAM, states[1], indices, grad, **hyper)
    assert cache.planner.stats["evictions"] > 0
    cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)
    for key in states[0]:
        assert torch.equal(states[1][key], states[0][key])
    slots = cache.planner.slots_of(torch.tensor([0, rows - 1]))
    assert slots.dtype == torch.int32 and all(-1 <= s < 8 for s in slots.tolist())
    with pytest.raises(IndexError, match=f"row {rows} at 1 is not in"):
        cache.planner.slots_of(torch.tensor([0, rows]))


def test_host_rows_rewritten_unseen_by_torch_are_reread_once_marked_stale():
    # A load writes host memory without torch (pread): the cache re-reads
    # its records when told (HostTable.rows_changed(None) tells it).
    table = HostTable(50, 4)
    table.tensor.copy_(torch.randn(50, 4))
    cache = table.cache = RowCache(table, 8)
    unique = torch.tensor([1, 5, 7])
    cache.plan(unique)
    new = torch.randn(50, 4)
    table.tensor.data.copy_(new)  # .data: the version counter does not move
    plan = cache.plan(unique)
    assert not torch.equal(cache.rows(plan, unique), new[unique])  # the records, as they were
    table.rows_changed(None)
    plan = cache.plan(unique)
    assert torch.equal(cache.rows(plan, unique), new[unique])


def test_the_cpu_planner_makes_the_decisions_recorded_from_the_gpu_planner(monkeypatch):
    # tests/fixtures/gpu_cache_plans.pt: the GPU planner's slots and
    # evictions on benchmarks/cache/cache_plan_record.py's streams, recorded on a
    # GPU (an H200, 2026-11-26). The CPU planner is its host twin: any
    # change of either policy shows here without a GPU.
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "cache"))
    import cache_plan_record
    recorded = torch.load(pathlib.Path(__file__).parent / "fixtures" / "gpu_cache_plans.pt", weights_only=True)
    configs = [r["config"] for r in recorded["recorded"]]
    # The clock policy's at least (the frequency policy's wait for a GPU).
    assert all(c in configs for c in cache_plan_record.CONFIGS)
    assert all(c in cache_plan_record.ALL_CONFIGS for c in configs)
    for r in recorded["recorded"]:
        gpu = (r["batches"], r["final"])
        cpu = cache_plan_record.cpu_decisions(r["config"])
        assert cache_plan_record.differences(gpu, cpu) == [], r["config"]
        assert sum(len(evicted) for _, _, evicted in gpu[0]) > 0 or r["config"]["capacity"] in (1, 2500)
