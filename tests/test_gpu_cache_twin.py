"""The GPU row cache's executor (_cache.GpuRowCache) on its host twin: the
same plan / move / gather / update sequence the GPU runs, with the CPU
planner (the GPU planner's twin, the same decisions: compared batch by
batch in tests/test_cache_gpu.py) and host-memory records. Training
through it gives the uncached table's bits, also with each batch planned
a step ahead (before the previous step's update), and its own waits for
the device are none on a step's path."""
import warnings

import pytest
import torch

from hostembed._cache.gpu_cache import GpuRowCache
from hostembed._core.ops import update as _ops
from hostembed._core.table import HostTable

HYPER = dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, maximize=False)


def _skewed_batch(gen, rows, count):
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return torch.unique((rows * u ** 4).long())


def _pair(rows, dim, gen):
    tables = [HostTable(rows, dim) for _ in range(2)]
    init = torch.randn(rows, dim, generator=gen)
    for t in tables:
        t.tensor.copy_(init)
    states = [{"exp_avg": t.zeros(), "exp_avg_sq": t.zeros()} for t in tables]
    return tables, states


def _flushed_alike(cache, tables, states):
    """After a flush, the cached table (tables[1], states[1]) holds the
    uncached one's bits: weight and every state tensor."""
    cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)
    for key in states[0]:
        assert torch.equal(states[1][key], states[0][key]), key


def _train_alike(cache, tables, states, batches, gen, ahead, plans, kind=_ops.ADAM, hyper=HYPER):
    """Optimizer `kind` (SparseAdam by default) on batches of unique rows:
    tables[0] uncached, tables[1] through the cache (each batch planned at
    its lookup, or ahead, during the step before; plans: batches planned
    already), its lookups checked against the uncached rows."""
    dim = tables[0].dim
    for b, unique in enumerate(batches):
        n = unique.numel()
        plan = plans.pop(b) if b in plans else cache.plan_batch(unique, n)
        assert torch.equal(cache.gather(plan, unique, n), tables[0].tensor[unique]), f"stale rows at step {b}"
        if ahead and b + 1 < len(batches):
            plans[b + 1] = cache.plan_batch(batches[b + 1], batches[b + 1].numel())
        grad = torch.randn(n, dim, generator=gen)
        _ops.sparse_update(kind, tables[0].tensor, states[0], unique, grad, step=b + 1, **hyper)
        cache.note_distinct(unique)
        cache.update(kind, states[1], unique, grad, step=b + 1, **hyper)


@pytest.mark.parametrize("ahead", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("capacity", [1, 96, 3000])
def test_training_through_the_twin_gives_the_uncached_bits(capacity, ahead):
    rows, dim, steps = 3000, 8, 80
    gen = torch.Generator().manual_seed(capacity + ahead)
    tables, states = _pair(rows, dim, gen)
    cache = GpuRowCache(tables[1], capacity, device="cpu")
    batches = [_skewed_batch(gen, rows, 300) for _ in range(steps)]
    for unique in batches[:3]:  # lookups before the first update: records hold rows only
        plan = cache.plan_batch(unique, unique.numel())
        assert torch.equal(cache.gather(plan, unique, unique.numel()), tables[0].tensor[unique])
    _train_alike(cache, tables, states, batches, gen, ahead, {0: cache.plan_batch(batches[0], batches[0].numel())})
    waits = cache.host_waits
    stats = cache.stats
    _flushed_alike(cache, tables, states)
    assert waits == 0
    assert stats["hits"] + stats["fetches"] + stats["bypassed"] == stats["rows"]
    assert stats["batches"] == 3 + steps
    if capacity == 3000:
        assert stats["bypassed"] == 0 and stats["evictions"] == 0
    else:
        assert stats["evictions"] > 0 or capacity == 1
        assert stats["bypassed"] > 0


# The other optimizers a GPU cache updates on its device: kind, a table's
# state (Adagrad's accumulators start at 0.1, initial_accumulator_value),
# hyperparameters (maximize on for one, Adagrad's lr_decay on: its step
# counts).
OTHERS = {
    "SGD": (_ops.SGD, lambda t: {}, dict(lr=0.1, maximize=True)),
    "Adagrad": (_ops.ADAGRAD, lambda t: {"sum": t.zeros().fill_(0.1)}, dict(lr=0.1, eps=1e-10, lr_decay=0.01,
                                                                            maximize=False)),
    "RowWiseAdagrad": (_ops.ROWWISE_ADAGRAD, lambda t: {"row_sum": t.zeros(per_row=True).fill_(0.1)},
                       dict(lr=0.1, eps=1e-10, maximize=False)),
}


@pytest.mark.parametrize("ahead", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("name", list(OTHERS))
def test_sgd_and_adagrads_through_the_twin_give_the_uncached_bits(name, ahead):
    """SGD, Adagrad and row-wise Adagrad (13 columns: eight lanes and a
    tail of row-wise Adagrad's sum) keep their records in the cache,
    updated there by the update the GPU runs (GpuCacheState.update's twin),
    with evictions and bypassed rows: the table and its state train to
    the uncached table's bits."""
    kind, state_of, hyper = OTHERS[name]
    rows, dim, steps, capacity = 2000, 13, 40, 96
    gen = torch.Generator().manual_seed(dim + ahead + kind)
    tables = [HostTable(rows, dim) for _ in range(2)]
    init = torch.randn(rows, dim, generator=gen)
    for t in tables:
        t.tensor.copy_(init)
    states = [state_of(t) for t in tables]
    cache = tables[1].cache = GpuRowCache(tables[1], capacity, device="cpu")
    calls = []
    device_update = cache.ops.update
    cache.ops.update = lambda *args, **kwargs: calls.append(args[0]) or device_update(*args, **kwargs)
    batches = [_skewed_batch(gen, rows, 200) for _ in range(steps)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no GPU update.*")
        _train_alike(cache, tables, states, batches, gen, ahead, {}, kind, hyper)
    assert tables[1].cache is cache and calls == [kind] * steps  # every step by the device's update
    for key, tensor in states[1].items():
        assert cache.cached[key].shape == (capacity, *tensor.shape[1:])  # row_sum: one value a slot
    stats = cache.stats
    assert stats["evictions"] > 0 and stats["bypassed"] > 0 and stats["hits"] > 0
    assert not torch.equal(tables[0].tensor, init)
    _flushed_alike(cache, tables, states)


def _compact_states(tables, form):
    """SparseAdam's compact moments for each table, in update_ops' form
    (codes, scales or None, stochastic): bfloat16, or 8-bit with a scale
    a block of 256 columns."""
    states = []
    for t in tables:
        if form == "bfloat16":
            states.append({"exp_avg": (t.zeros(dtype=torch.bfloat16), None, False),
                           "exp_avg_sq": (t.zeros(dtype=torch.bfloat16), None, False)})
        else:
            blocks = -(-t.dim // 256)
            states.append({"exp_avg": (t.zeros(dtype=torch.int8), t.zeros(dtype=torch.float32, width=blocks), False),
                           "exp_avg_sq": (t.zeros(dtype=torch.uint8), t.zeros(dtype=torch.float32, width=blocks),
                                          False)})
    return states


@pytest.mark.parametrize("ahead", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("form,dim", [("bfloat16", 6), ("int8", 8), ("int8", 260)])
def test_compact_moments_in_the_twins_records_give_the_uncached_bits(form, dim, ahead):
    """bfloat16 and 8-bit moments (260 columns: a block and a part, each
    with its scale) stay in the cache's records, updated there, and the
    table trains to the uncached compact table's bits, with evictions."""
    rows, steps, capacity = 2000, 40, 96
    gen = torch.Generator().manual_seed(dim + ahead)
    tables = [HostTable(rows, dim) for _ in range(2)]
    init = torch.randn(rows, dim, generator=gen)
    for t in tables:
        t.tensor.copy_(init)
    states = _compact_states(tables, form)
    cache = tables[1].cache = GpuRowCache(tables[1], capacity, device="cpu")
    batches = [_skewed_batch(gen, rows, 200) for _ in range(steps)]
    _train_alike(cache, tables, states, batches, gen, ahead, {})
    assert tables[1].cache is cache  # not moved to host records
    keys = {"exp_avg", "exp_avg_sq"} | ({"exp_avg_scale", "exp_avg_sq_scale"} if form == "int8" else set())
    assert keys <= set(cache.cached)
    assert cache.cached["exp_avg"].dtype == states[1]["exp_avg"][0].dtype
    stats = cache.stats
    assert stats["evictions"] > 0 and stats["bypassed"] > 0
    cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)
    for key in states[0]:
        for mine, theirs in zip(states[1][key][:2], states[0][key][:2]):
            if theirs is not None:
                assert torch.equal(mine, theirs), key


def test_compact_moments_the_device_cannot_update_move_to_host_records():
    """Stochastic rounding (its draw is the row's number, a record's would
    be its slot's) and 8-bit codes whose rows are not whole words move the
    records to host memory."""
    for dim, stochastic, state_of in (
            (8, True, lambda t: {"exp_avg": (t.zeros(dtype=torch.bfloat16), None, True),
                                 "exp_avg_sq": (t.zeros(dtype=torch.bfloat16), None, True)}),
            (6, False, lambda t: _compact_states([t], "int8")[0])):
        table = HostTable(50, dim)
        cache = table.cache = GpuRowCache(table, 8, device="cpu")
        unique = torch.tensor([1, 4])
        cache.plan_batch(unique, 2)
        with pytest.warns(UserWarning, match="compact optimizer state has no GPU update"):
            if stochastic:  # which a cache of host records refuses in turn
                with pytest.raises(NotImplementedError, match="rounded to nearest"):
                    cache.update(_ops.ADAM, state_of(table), unique, torch.ones(2, dim), step=1, **HYPER)
            else:
                cache.update(_ops.ADAM, state_of(table), unique, torch.ones(2, dim), step=1, **HYPER)
        assert type(table.cache).__name__ == "RowCache"


def test_a_gradient_with_repeats_is_checked_and_summed_on_the_host():
    # Two lookups' sums concatenated (rows repeated), and an index outside
    # the table: the update that cannot take them as they are checks them
    # on the host (one wait), sums the repeats as the core does, and
    # refuses a bad one before anything is written.
    rows, dim = 400, 4
    gen = torch.Generator().manual_seed(1)
    tables, states = _pair(rows, dim, gen)
    cache = GpuRowCache(tables[1], 8, device="cpu")
    for step in range(1, 20):
        first, second = _skewed_batch(gen, rows, 20), _skewed_batch(gen, rows, 20)
        cache.plan_batch(first, first.numel())
        cache.plan_batch(second, second.numel())
        indices = torch.cat([first, second])
        grad = torch.randn(indices.numel(), dim, generator=gen)
        _ops.sparse_update(_ops.ADAM, tables[0].tensor, states[0], indices, grad, step=step, **HYPER)
        before = cache.host_waits
        cache.update(_ops.ADAM, states[1], indices, grad, step=step, **HYPER)
        assert cache.host_waits - before == 1
    with pytest.raises(IndexError, match=f"row {rows} at 1 is not in"):
        cache.update(_ops.ADAM, states[1], torch.tensor([0, rows]), torch.ones(2, dim), step=20, **HYPER)
    _flushed_alike(cache, tables, states)


def test_host_rows_written_through_torch_are_reread_by_the_twin():
    table = HostTable(50, 4)
    table.tensor.copy_(torch.randn(50, 4))
    cache = table.cache = GpuRowCache(table, 8, device="cpu")
    unique = torch.tensor([1, 5, 7])
    cache.plan_batch(unique, 3)
    new = torch.randn(50, 4)
    table.tensor.copy_(new)  # the version counter moves: the records are re-read
    plan = cache.plan_batch(unique, 3)
    assert torch.equal(cache.gather(plan, unique, 3), new[unique])
    table.tensor.data.copy_(new * 2)  # unseen by torch ...
    table.rows_changed(None)  # ... until announced, as a load does
    plan = cache.plan_batch(unique, 3)
    assert torch.equal(cache.gather(plan, unique, 3), 2 * new[unique])


@pytest.mark.parametrize("kind, state_of, why", [
    (_ops.ROWWISE_ADAM, lambda t: {"exp_avg": t.zeros(), "exp_avg_sq": t.zeros(per_row=True)},
     "SparseAdam's row-wise second moment"),
    (_ops.ADAGRAD, lambda t: {"sum": (t.zeros(dtype=torch.bfloat16), None, False)}, "this compact optimizer state"),
], ids=["rowwise-adam", "bfloat16-adagrad"])
def test_another_optimizer_moves_the_cache_to_host_records(kind, state_of, why):
    rows, dim = 300, 4
    gen = torch.Generator().manual_seed(3)
    tables, _ = _pair(rows, dim, gen)
    states = [state_of(t) for t in tables]
    cache = tables[1].cache = GpuRowCache(tables[1], 16, device="cpu")
    unique = _skewed_batch(gen, rows, 40)
    cache.plan_batch(unique, unique.numel())
    grad = torch.randn(unique.numel(), dim, generator=gen)
    _ops.sparse_update(kind, tables[0].tensor, states[0], unique, grad, step=1, **HYPER)
    with pytest.warns(UserWarning, match=f"{why} has no GPU update"):
        _ops.sparse_update(kind, tables[1].tensor, states[1], unique, grad, step=1, **HYPER)
    assert type(tables[1].cache).__name__ == "RowCache" and tables[1].cache.device.type == "cpu"
    tables[1].cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)


def test_two_host_tensors_written_at_once_are_both_reread():
    # The weight and a state tensor written through torch while the cache
    # holds them clean: both records re-read at the next batch.
    rows, dim = 60, 4
    table = HostTable(rows, dim)
    state = {"exp_avg": table.zeros(), "exp_avg_sq": table.zeros()}
    cache = GpuRowCache(table, 8, device="cpu")
    unique = torch.tensor([2, 9])
    cache.plan_batch(unique, 2)
    cache.update(_ops.ADAM, state, unique, torch.ones(2, dim), step=1, **HYPER)
    cache.flush()
    table.tensor.copy_(torch.full((rows, dim), 3.0))
    state["exp_avg"].copy_(torch.full((rows, dim), 0.5))
    cache.plan_batch(unique, 2)
    assert torch.equal(cache.cached["weight"][cache.ops.planner.slots_of(unique).long()], torch.full((2, dim), 3.0))
    assert torch.equal(cache.cached["exp_avg"][cache.ops.planner.slots_of(unique).long()], torch.full((2, dim), 0.5))


def _reads_of(cache, batches, tables, states, gen):
    """The rows of arrays the fetches of `batches` read from host memory."""
    before = cache.stats["host_reads"]
    _train_alike(cache, tables, states, batches, gen, False, {})
    return cache.stats["host_reads"] - before


def test_a_fetched_row_whose_state_was_never_written_reads_only_its_weight():
    """SparseAdam's moments start as zeros: a row fetched for the first
    time gets zeros for them, unread (one read a row, not three); a row
    updated in host memory since (bypassed, or evicted) reads them all; a
    write to the state the cache did not make stops the zeros. Training
    gives the uncached bits throughout."""
    rows, dim = 1000, 8
    gen = torch.Generator().manual_seed(11)
    tables, states = _pair(rows, dim, gen)
    cache = GpuRowCache(tables[1], 250, device="cpu")
    span = lambda a, b: torch.arange(a, b)  # noqa: E731
    assert _reads_of(cache, [span(0, 100)], tables, states, gen) == 100  # before the state came: the weight
    assert cache.zero_known == {"exp_avg", "exp_avg_sq"}
    assert _reads_of(cache, [span(100, 200), span(200, 250)], tables, states, gen) == 150  # new rows: weight only
    # The cache is full: new rows are turned away, updated in host memory;
    # used again, they take the least recently used slots and read all three.
    assert _reads_of(cache, [span(250, 300)], tables, states, gen) == 0
    assert cache.stats["bypassed"] == 50
    assert _reads_of(cache, [span(250, 300)], tables, states, gen) == 150
    assert cache.stats["evictions"] == 50
    # A write torch sees (the cache written back first): that state is no
    # longer known, and new rows read it again.
    cache.flush()
    for state in states:
        state["exp_avg_sq"][rows - 1] += 0.0
    fetches = cache.stats["fetches"]
    reads = _reads_of(cache, [span(0, 50)], tables, states, gen)  # some evicted rows back: written
    assert reads == 3 * (cache.stats["fetches"] - fetches) and reads > 0
    assert cache.zero_known == {"exp_avg"}
    _flushed_alike(cache, tables, states)


def test_a_state_written_outside_the_cache_is_read_again():
    rows, dim = 100, 8
    gen = torch.Generator().manual_seed(12)
    tables, states = _pair(rows, dim, gen)
    cache = GpuRowCache(tables[1], 50, device="cpu")
    _train_alike(cache, tables, states, [torch.arange(0, 10)], gen, False, {})
    cache.flush()
    for state in states:
        state["exp_avg_sq"][rows - 1] += 1.0  # a row never fetched: only a read shows it
    # New rows, free slots: the weight and exp_avg_sq read, exp_avg (still
    # all zero where unwritten) not.
    assert _reads_of(cache, [torch.arange(90, 100)], tables, states, gen) == 20
    cache.flush()
    for key in states[0]:
        assert torch.equal(states[1][key], states[0][key]), key


def test_state_attached_again_with_values_is_read_for_rows_never_fetched():
    # Moments assigned by hand after a first step: the key's new tensor is
    # not zero, so rows fetched later read it (not the zeros of the first).
    rows, dim = 100, 8
    gen = torch.Generator().manual_seed(13)
    tables, states = _pair(rows, dim, gen)
    cache = GpuRowCache(tables[1], 50, device="cpu")
    _train_alike(cache, tables, states, [torch.arange(0, 10)], gen, False, {})
    assert cache.zero_known == {"exp_avg", "exp_avg_sq"}
    loaded = []
    for table, state in zip(tables, states):
        new = {key: table.zeros().fill_(value) for key, value in (("exp_avg", 0.25), ("exp_avg_sq", 0.5))}
        for key in new:
            new[key][:10] = states[0][key][:10]
        loaded.append(new)
    _train_alike(cache, tables, loaded, [torch.arange(0, 10)], gen, False, {})  # attaches the new tensors
    assert cache.zero_known == set()
    _train_alike(cache, tables, loaded, [torch.arange(20, 30)], gen, False, {})  # rows never fetched
    cache.flush()
    assert torch.equal(tables[1].tensor, tables[0].tensor)
    for key in loaded[0]:
        assert torch.equal(loaded[1][key], loaded[0][key]), key
