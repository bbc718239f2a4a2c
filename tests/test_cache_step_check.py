"""benchmarks/gpu/cache_step.py's check before timing: a table with a row cache
must train to the uncached table's bits (each step's output, the weight,
every optimizer state entry) at every timed cache size. Faults injected
into the cache (a neighbouring row served once, a state record zeroed
once, one bit of a state written back wrong) must each end the run; on
the CPU the cache is RowCache, so that is where they are injected."""
import pathlib

import pytest
import torch

from hostembed._cache.row_cache import RowCache

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
SMALL = ["--device", "cpu", "--scale", "0.0005", "--warmup", "2", "--steps", "2"]
# (protocol, optimizer, state, fractions): plain lookups planned a step
# ahead with Adam (float32 and 8-bit moments with their scales), and
# FBGEMM's sum bags with row-wise Adagrad, a value a row.
CASES = [("fresh", "adam", "float32", "1,0.2,0.05"), ("fresh", "adam", "int8", "0.2"),
         ("fbgemm", "rowwise_adagrad", "float32", "1,0.2")]


@pytest.fixture
def cache_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "gpu"))
    import cache_step
    return cache_step


def _check(cache_step, protocol, optimizer, state, fractions):
    args = cache_step.parse_args(SMALL + ["--protocols", protocol, "--optimizers", optimizer, "--states", state,
                                          "--fractions", fractions])
    return cache_step.check_bits(protocol, optimizer, state, args, torch.device("cpu"))


class _Fault:
    """Wraps RowCache.`method` so that `corrupt(cache, result, *args)` runs
    once: at the `at`-th call (0-based) made by the `nth` cache that calls
    it (the check builds one cache a timed size, in the order of the
    fractions), when corrupt returns True (it did change something)."""

    def __init__(self, monkeypatch, method, corrupt, nth=0, at=0, before=False):
        self.corrupt, self.nth, self.at, self.before = corrupt, nth, at, before
        self.caches, self.calls, self.fired = [], 0, 0
        real = getattr(RowCache, method)

        def wrapped(cache, *args, **kwargs):
            if self.before:
                self._maybe(cache, None, args)
            result = real(cache, *args, **kwargs)
            if not self.before:
                self._maybe(cache, result, args)
            return result

        monkeypatch.setattr(RowCache, method, wrapped)

    def _maybe(self, cache, result, args):
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)
        if self.fired or self.caches[self.nth:self.nth + 1] != [cache]:
            return
        if self.calls >= self.at and self.corrupt(cache, result, *args):
            self.fired += 1
        self.calls += 1


def _serve_neighbour(cache, out, plan, unique):
    """The first cached row of the lookup replaced by the record of the
    slot next to its own."""
    held = (plan.slot >= 0).nonzero().view(-1)
    if not held.numel() or cache.capacity < 2:
        return False
    k = int(held[0])
    out[k] = cache.cached["weight"][(int(plan.slot[k]) + 1) % cache.capacity]
    return True


def _state_keys(cache):
    return sorted(k for k in cache.cached if k != "weight")


def _zero_a_state_record(cache, _, kind, state, indices, values, **hyper):
    """One just-updated cached row's first state record set to zero."""
    slots = cache.planner.slots_of(indices.cpu()).long()
    for key in _state_keys(cache)[:1]:
        records = cache.cached[key]
        for slot in slots[slots >= 0].tolist():
            if bool((records[slot] != 0).any()):
                records[slot] = 0
                return True
    return False


def _flip_a_bit_of_state(cache, _, keys=None):
    """Just before a write-back of the state: the lowest bit of one live
    record of the last state tensor flipped (the weight untouched)."""
    keys = [k for k in _state_keys(cache) if k in cache.dirty and (keys is None or k in keys)]
    live = cache._live_slots()
    if not keys or not live.numel():
        return False
    records = cache.cached[keys[-1]]
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[records.element_size()]
    records.view(ints)[int(live[0])].view(-1)[0] ^= 1
    return True


@pytest.mark.parametrize("protocol,optimizer,state,fractions", CASES)
def test_the_check_passes_a_correct_cache_at_every_timed_size(cache_step, protocol, optimizer, state, fractions):
    counts = _check(cache_step, protocol, optimizer, state, fractions)
    assert sorted(counts) == sorted(float(f) for f in fractions.split(","))
    # Rows came back to the cache in later steps at every size, and the
    # smaller caches evicted and bypassed: the check went through the
    # paths a timed run takes.
    assert all(c["hits"] > 0 for c in counts.values())
    smallest = counts[min(counts)]
    assert smallest["evictions"] > 0 and smallest["bypassed"] > 0


@pytest.mark.parametrize("at", [0, 3], ids=["first-lookup", "later-lookup"])
@pytest.mark.parametrize("nth", [0, 2])
def test_a_neighbouring_row_served_once_at_one_cache_size_is_refused(cache_step, monkeypatch, nth, at):
    # At the first lookup every served row was just fetched into a table
    # that has not trained yet: from an all-zero table a neighbour's row
    # would be the same zeros, and no later step would tell.
    fault = _Fault(monkeypatch, "rows", _serve_neighbour, nth=nth, at=at)
    fractions = [1, 0.2, 0.05]
    with pytest.raises(SystemExit, match=rf"CORRECTNESS CHECK FAILED: fresh, adam float32, cache {fractions[nth]:g} "
                                         rf"\(.*: step {at}'s lookup output differs"):
        _check(cache_step, "fresh", "adam", "float32", ",".join(map(str, fractions)))
    assert fault.fired == 1 and len(fault.caches) == nth + 1


@pytest.mark.parametrize("protocol,optimizer,state,fractions", CASES)
def test_a_state_record_zeroed_once_is_refused(cache_step, monkeypatch, protocol, optimizer, state, fractions):
    fault = _Fault(monkeypatch, "update", _zero_a_state_record, at=2)
    with pytest.raises(SystemExit, match=rf"CORRECTNESS CHECK FAILED: {protocol}, {optimizer} {state}, "
                                         rf"cache {fractions.split(',')[0]} "):
        _check(cache_step, protocol, optimizer, state, fractions)
    assert fault.fired == 1


@pytest.mark.parametrize("protocol,optimizer,state,fractions", CASES)
def test_one_wrong_bit_of_state_written_back_is_refused_though_the_weights_agree(
        cache_step, monkeypatch, protocol, optimizer, state, fractions):
    # Written back after the last update, the wrong bit reaches no weight:
    # only comparing the optimizer's state finds it.
    fault = _Fault(monkeypatch, "flush", _flip_a_bit_of_state, before=True)
    with pytest.raises(SystemExit, match=rf"CORRECTNESS CHECK FAILED: {protocol}, {optimizer} {state}, cache "
                                         rf"{fractions.split(',')[0]} .*: state\[0\]\.\w+ differs in 1 row\(s\)"):
        _check(cache_step, protocol, optimizer, state, fractions)
    assert fault.fired == 1


def test_a_draw_that_never_finds_a_cached_row_again_is_refused(cache_step, monkeypatch):
    # One step of fresh ids: every row is fetched or bypassed, none found
    # again, and agreeing bits would say nothing about the cache.
    monkeypatch.setitem(cache_step.CHECK_DRAW, "warmup", 0)
    monkeypatch.setitem(cache_step.CHECK_DRAW, "steps", 1)
    with pytest.raises(SystemExit, match="no cached row was found again"):
        _check(cache_step, "fresh", "adam", "float32", "0.2")


def test_the_run_stops_before_timing_when_the_check_fails(cache_step, monkeypatch, tmp_path):
    fault = _Fault(monkeypatch, "rows", _serve_neighbour, nth=1, at=1)
    with pytest.raises(SystemExit, match="CORRECTNESS CHECK FAILED: fresh, adam float32, cache 0.8 "):
        cache_step.main(SMALL + ["--protocols", "fresh", "--json", str(tmp_path / "r.json")])
    assert fault.fired == 1
    assert not (tmp_path / "r.json").exists(), "nothing timed"
