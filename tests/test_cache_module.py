"""Embedding(cache_rows=N): training through the row cache gives the bits
of the same module without one (every optimizer, fused or not, planned a
step ahead or not), and whatever reads or writes the table from Python
(weight, state_dict, hostembed.save/load, load_state_dict, in-place
writes, casts, copies) sees and sets the current values."""
import copy
import pickle

import pytest
import torch

import hostembed
from hostembed._core.ops import cpu as cpu_ops
from hostembed._cache.row_cache import CacheConflict

from conftest import zipf_ids

ROWS, DIM, CACHE = 600, 8, 24

OPTIMIZERS = {
    "SparseAdam": (hostembed.SparseAdam, dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "SGD": (hostembed.SGD, dict(lr=0.1)),
    "Adagrad": (hostembed.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "RowWiseAdagrad": (hostembed.RowWiseAdagrad, dict(lr=0.1)),
}


def _pair(name, fused=False, dtype=torch.float32, cache=CACHE, **module_kwargs):
    """(uncached module, its optimizer), (cached module, its optimizer),
    with the same rows."""
    cls, hyper = OPTIMIZERS[name]
    if fused:
        hyper = dict(hyper, fused=True)
    torch.manual_seed(0)
    plain = hostembed.Embedding(ROWS, DIM, dtype=dtype, **module_kwargs)
    cached = hostembed.Embedding(ROWS, DIM, dtype=dtype, cache_rows=cache, **module_kwargs)
    with torch.no_grad():
        cached.weight.copy_(plain.weight)
    return (plain, cls(plain.parameters(), **hyper)), (cached, cls(cached.parameters(), **hyper))


def _batches(steps, seed=1, batch=64):
    gen = torch.Generator().manual_seed(seed)
    return [zipf_ids(ROWS, batch, generator=gen).view(8, -1) for _ in range(steps)]


def _step(module, opt, ids, target):
    out = module(ids)
    loss = (out - target).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return out.detach()


def _train(pairs, batches, prefetch=False):
    gen = torch.Generator().manual_seed(2)
    for b, ids in enumerate(batches):
        target = torch.randn(*ids.shape, DIM, generator=gen).to(pairs[0][0].weight.dtype)
        outs = []
        for module, opt in pairs:
            module._table.prefetch_outcome = None
            out = module(ids)
            if prefetch and b and module.cache_rows:
                assert module._table.prefetch_outcome == "taken: planned ahead"
            loss = (out - target).pow(2).sum()
            loss.backward()
            if prefetch and b + 1 < len(batches):
                # The next batch planned before this step's update.
                module.prefetch(batches[b + 1])
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), f"step {b}: the cached table's lookup differs"


def _assert_same_training_state(pairs):
    (plain, plain_opt), (cached, cached_opt) = pairs
    assert torch.equal(cached.weight, plain.weight)
    mine, theirs = cached_opt.state_dict(), plain_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert mine["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            got = mine["state"][index][key]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), key


@pytest.mark.parametrize("prefetch", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_through_a_small_cache_gives_the_uncached_bits(name, fused, prefetch):
    # 100 Zipf steps through 24 slots (rows found, fetched, evicted and
    # bypassed every step), with padding_idx and scale_grad_by_freq.
    pairs = _pair(name, fused, padding_idx=3, scale_grad_by_freq=True)
    _train(pairs, _batches(100), prefetch)
    stats = pairs[1][0].cache_stats
    assert stats["hits"] > 0 and stats["evictions"] > 0 and stats["bypassed"] > 0
    assert stats["hits"] + stats["fetches"] + stats["bypassed"] == stats["rows"]
    assert stats["fetched_bytes"] > 0 and stats["written_back_bytes"] > 0
    _assert_same_training_state(pairs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_table_dtypes_train_bit_identically(dtype):
    pairs = _pair("SparseAdam", dtype=dtype)
    _train(pairs, _batches(40), prefetch=True)
    _assert_same_training_state(pairs)


def test_outputs_and_moved_rows_in_recycled_memory_stay_valid_while_kept():
    # A cached lookup's rows, its output and the records it moves are
    # copies in recycled scratch memory once they are big (a quarter MiB):
    # one kept across later steps (and their evictions) keeps its values.
    torch.manual_seed(0)
    plain = hostembed.Embedding(5000, 64)
    cached = hostembed.Embedding(5000, 64, cache_rows=1000)
    with torch.no_grad():
        cached.weight.copy_(plain.weight)
    opts = [hostembed.SparseAdam(m.parameters(), lr=0.05) for m in (plain, cached)]
    kept = []
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        ids = torch.randint(0, 5000, (2048,), generator=gen)
        outs = []
        for module, opt in zip((plain, cached), opts):
            out = module(ids)
            outs.append(out)
            opt.zero_grad()
            out.sin().sum().backward()
            opt.step()
        assert outs[1].nbytes >= 256 << 10
        kept.append((outs[1], outs[0].detach().clone()))
    assert cached.cache_stats["evictions"] > 0
    for ours, expected in kept:
        assert torch.equal(ours, expected)
    assert torch.equal(cached.weight, plain.weight)
    rows = torch.randn(3000, 64)
    index = torch.randint(0, 3000, (5000,))
    assert torch.equal(cpu_ops.rows_at(rows, index), rows[index])
    assert torch.equal(cpu_ops.rows_at(rows[:, 0], index[:10]), rows[:, 0][index[:10]])


def test_a_cache_holding_every_row_hits_after_the_first_touch():
    pairs = _pair("SparseAdam", cache=ROWS)
    batches = _batches(5)
    _train(pairs, batches + batches)
    stats = pairs[1][0].cache_stats
    assert stats["bypassed"] == 0 and stats["evictions"] == 0
    assert stats["fetches"] == torch.unique(torch.cat([b.view(-1) for b in batches])).numel()
    _assert_same_training_state(pairs)


def test_gradients_accumulated_over_several_lookups_update_rows_where_they_are(monkeypatch):
    # Bit for bit against the core's unfused lookups: a small call through
    # torch's op leaves a row's gradient from each lookup unsummed, and the
    # optimizer sums a row repeated over lookups in another order.
    monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)
    pairs = _pair("SparseAdam")
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        first, second = zipf_ids(ROWS, 40, generator=gen), zipf_ids(ROWS, 40, generator=gen)
        for module, opt in pairs:
            (module(first).sum() + module(second).pow(2).sum()).backward()  # the second may evict the first's rows
            (module(first) * 0.5).sum().backward()
            opt.step()
            opt.zero_grad()
    _assert_same_training_state(pairs)


def test_state_dict_and_weight_reads_see_the_cached_rows():
    pairs = _pair("SparseAdam")
    _train(pairs, _batches(20))
    (plain, _), (cached, _) = pairs
    assert "weight" in cached._table.cache.dirty  # the newest rows are in the cache here
    assert torch.equal(cached.state_dict()["weight"], plain.weight)
    _train(pairs, _batches(5, seed=3))
    assert torch.equal(cached.weight[: ROWS // 2], plain.weight[: ROWS // 2])
    _train(pairs, _batches(5, seed=4))
    assert torch.equal(copy.deepcopy(cached).weight, plain.weight)
    assert torch.equal(pickle.loads(pickle.dumps(cached)).weight, plain.weight)
    copied = copy.deepcopy(cached)
    assert copied._table.cache is not cached._table.cache and copied.cache_rows == CACHE
    _assert_same_training_state(pairs)


@pytest.mark.parametrize("saved_from", ["cached", "plain"])
def test_checkpoints_of_cached_and_uncached_tables_are_interchangeable(tmp_path, saved_from):
    pairs = _pair("SparseAdam")
    _train(pairs, _batches(15))
    (plain, plain_opt), (cached, cached_opt) = pairs
    path = tmp_path / "ckpt.pt"
    source = pairs[0] if saved_from == "plain" else pairs[1]
    hostembed.save(path, *source)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["model"]["weight"], plain.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(saved["optimizer"]["state"][0][key], plain_opt.state[plain.weight][key])
    _train(pairs, _batches(5, seed=7))  # both move away from the file, the cache fills with newer rows
    for module, opt in pairs:
        hostembed.load(path, module, opt)
    _train(pairs, _batches(15, seed=8))
    _assert_same_training_state(pairs)


@pytest.mark.parametrize("name", ["SparseAdam", "Adagrad"])
def test_module_and_optimizer_loads_mid_training_take_effect(name):
    pairs = _pair(name)
    _train(pairs, _batches(10))
    snapshot_model = copy.deepcopy(pairs[0][0].state_dict())
    snapshot_opt = copy.deepcopy(pairs[0][1].state_dict())
    _train(pairs, _batches(10, seed=5))
    for module, opt in pairs:  # back to the snapshot, with the cache full of newer rows and state
        module.load_state_dict(snapshot_model)
        opt.load_state_dict(snapshot_opt)
    _train(pairs, _batches(10, seed=6))
    _assert_same_training_state(pairs)


def test_writes_through_the_weight_are_seen_by_the_next_lookup():
    pairs = _pair("SparseAdam")
    _train(pairs, _batches(10))
    hot = torch.unique(torch.cat([b.view(-1) for b in _batches(10)]))[:10]
    for module, _ in pairs:
        with torch.no_grad():
            module.weight[hot] = 0.25  # rows the cache holds
    _train(pairs, _batches(5, seed=9))
    replacement = torch.randn(ROWS, DIM)
    for module, _ in pairs:
        module.weight.data = replacement.clone()  # adopted into the table
    _train(pairs, _batches(5, seed=10))
    _assert_same_training_state(pairs)


def test_a_write_through_an_old_reference_while_the_cache_holds_newer_rows_is_refused():
    (_, _), (cached, opt) = _pair("SparseAdam")
    weight = cached.weight
    ids = _batches(1)[0]
    _step(cached, opt, ids, torch.zeros(*ids.shape, DIM))
    with torch.no_grad():
        weight[ids[0, 0]] = 1.0  # the cache holds that row's update; host memory has this
    with pytest.raises(CacheConflict, match="written in place while the cache held updates"):
        cached(ids)
    assert issubclass(CacheConflict, RuntimeError)


def test_flush_cache_brings_host_memory_up_to_date():
    pairs = _pair("RowWiseAdagrad")
    _train(pairs, _batches(10))
    (plain, plain_opt), (cached, cached_opt) = pairs
    weight = cached._parameters["weight"]  # a reference that does not flush
    row_sum = cached_opt.state[weight]["row_sum"]
    assert not torch.equal(weight, plain.weight)  # the cache holds newer rows
    cached.flush_cache()
    assert torch.equal(weight, plain.weight)
    assert torch.equal(row_sum, plain_opt.state[plain.weight]["row_sum"])


def test_a_cast_writes_the_cache_back_and_starts_it_anew():
    pairs = _pair("SparseAdam")
    _train(pairs, _batches(10))
    for module, _ in pairs:
        module.to(torch.bfloat16)
    assert pairs[1][0]._table.cache.records.dtype == torch.bfloat16
    _train(pairs, _batches(10, seed=11))
    _assert_same_training_state(pairs)


def test_bad_ids_raise_and_change_nothing():
    (_, _), (cached, opt) = _pair("SparseAdam")
    _train([_pair("SparseAdam")[0], (cached, opt)], _batches(3))
    cached.flush_cache()
    before, stats = cached.weight.clone(), cached.cache_stats
    with pytest.raises(IndexError, match=str(ROWS)):
        cached(torch.tensor([1, ROWS]))
    assert cached.cache_stats == stats
    assert torch.equal(cached.weight, before)


def test_options_a_cache_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="cache_rows must be in"):
        hostembed.Embedding(10, 4, cache_rows=0)
    with pytest.raises(TypeError, match="cache_rows must be an int"):
        hostembed.Embedding(10, 4, cache_rows=2.5)
    with pytest.raises(TypeError, match="cache_rows must be an int"):
        hostembed.Embedding(10, 4, cache_rows=True)
    with pytest.raises(ValueError, match="max_norm"):
        hostembed.Embedding(10, 4, max_norm=1.0, cache_rows=4)
    emb = hostembed.Embedding(10, 4, dtype=torch.bfloat16, cache_rows=4)
    with pytest.raises(ValueError, match="stochastic rounding"):
        emb.stochastic_rounding = True
    emb.max_norm = 1.0
    with pytest.raises(RuntimeError, match="max_norm"):
        emb(torch.tensor([1]))
    big = hostembed.Embedding(10, 4, cache_rows=1000)
    assert big.cache_rows == 1000 and big._table.cache.capacity == 10
    assert hostembed.Embedding(10, 4).cache_stats is None


def test_from_pretrained_takes_cache_rows():
    rows = torch.randn(50, 4)
    emb = hostembed.Embedding.from_pretrained(rows, freeze=False, cache_rows=5)
    assert emb.cache_rows == 5
    ids = torch.tensor([[1, 2], [2, 49]])
    assert torch.equal(emb(ids), rows[ids])


def test_cache_rows_can_be_changed_between_steps():
    pairs = _pair("SparseAdam")
    _train(pairs, _batches(10))
    cached = pairs[1][0]
    cached.cache_rows = 100  # written back, a new cache of 100 rows
    assert cached._table.cache.capacity == 100 and cached.cache_stats["batches"] == 0
    _train(pairs, _batches(10, seed=12))
    cached.cpu()  # outputs stay where they were: the same cache
    assert cached.cache_stats["batches"] == 10
    cached.cache_rows = None
    assert cached.cache_stats is None and cached._table.cache is None
    _train(pairs, _batches(5, seed=13))
    with pytest.raises(ValueError, match="cache_rows must be in"):
        cached.cache_rows = -1
    _assert_same_training_state(pairs)
