"""A row cache in GPU memory (Embedding(cache_rows=N, device="cuda"),
float32): its records are updated by the GPU kernel, and training gives
the bits of the uncached table on the CPU path (itself checked against
torch), also with batches planned ahead while the previous step's rows are
still in use, and with evictions every step.

Every test checks that the records were in GPU memory and updated there
(the cache moves them to host memory for an optimizer without a GPU
update, which would give the same values)."""
import pathlib
import sys
import warnings

import pytest
import torch

import hostembed
from hostembed._core import cuda as _cuda
from hostembed._core.ops import update as _ops
from hostembed._core.ops.gpu_cache import GpuCacheState

from conftest import zipf_ids
from test_cache_module import DIM, OPTIMIZERS, ROWS, _batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
]


def _gpu_pair(name="SparseAdam", cache=24, **opt_kwargs):
    cls, hyper = OPTIMIZERS[name]
    torch.manual_seed(0)
    plain = hostembed.Embedding(ROWS, DIM)
    cached = hostembed.Embedding(ROWS, DIM, cache_rows=cache, device="cuda")
    with torch.no_grad():
        cached.weight.copy_(plain.weight)
    hyper = dict(hyper, **opt_kwargs)
    return (plain, cls(plain.parameters(), **hyper)), (cached, cls(cached.parameters(), **hyper))


def _assert_records_on_gpu(module, opt=None):
    cache = module._table.cache
    assert cache.device.type == "cuda"
    assert all(records.is_cuda for records in cache.cached.values())
    if opt is not None:
        assert opt._last_update == "cache"
        assert {"exp_avg", "exp_avg_sq"} <= set(cache.cached)
        # From the sums the GPU backward left on the GPU, not weight.grad's host copy.
        assert cache.last_update_from.type == "cuda"


def _train(pairs, batches, prefetch=False, ids_device="cpu"):
    gen = torch.Generator().manual_seed(2)
    for b, ids in enumerate(batches):
        target = torch.randn(*ids.shape, DIM, generator=gen)
        outs = []
        for module, opt in pairs:
            on_gpu = module.output_device.type == "cuda"
            out = module(ids.to(ids_device) if on_gpu else ids)
            if on_gpu and prefetch and b:
                assert module._table.prefetch_outcome == "taken: planned ahead"
            loss = (out - target.to(out.device)).pow(2).sum()
            loss.backward()
            if prefetch and b + 1 < len(batches):
                module.prefetch(batches[b + 1])  # planned while this step's rows are still to be updated
            opt.step()
            opt.zero_grad()
            outs.append(out.detach().cpu())
            if on_gpu:
                module._table.prefetch_outcome = None
        assert torch.equal(outs[0], outs[1]), f"step {b}: the GPU cache's lookup differs"


def _assert_same(pairs):
    (plain, plain_opt), (cached, cached_opt) = pairs
    assert torch.equal(cached.weight, plain.weight)
    mine, theirs = cached_opt.state_dict()["state"], plain_opt.state_dict()["state"]
    for index, entry in theirs.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(mine[index][key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("ids_device", ["cpu", "cuda"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_sparse_adam_through_a_gpu_cache_gives_the_uncached_bits(fused, prefetch, ids_device):
    pairs = _gpu_pair(fused=fused)
    _train(pairs, _batches(100), prefetch, ids_device)
    _assert_records_on_gpu(*pairs[1])
    stats = pairs[1][0].cache_stats
    assert stats["hits"] > 0 and stats["evictions"] > 0 and stats["bypassed"] > 0
    _assert_same(pairs)


# The optimizers besides SparseAdam whose records the GPU updates
# (cuda/he_cuda_optim_cached.cuh): their kind and state keys.
GPU_UPDATED = {"SGD": (_ops.SGD, ()), "Adagrad": (_ops.ADAGRAD, ("sum",)),
               "RowWiseAdagrad": (_ops.ROWWISE_ADAGRAD, ("row_sum",))}


@pytest.mark.parametrize("ids_device", ["cpu", "cuda"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["planned-at-lookup", "planned-ahead"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", list(GPU_UPDATED))
def test_sgd_and_adagrads_through_a_gpu_cache_give_the_uncached_bits(monkeypatch, name, fused, prefetch, ids_device):
    """SGD, Adagrad (lr_decay on: its step counts) and row-wise Adagrad
    (one value a row, records one word wide) update their records in GPU
    memory, every step by the kernel (cuda/cache.cu's he_cuda_cache_update),
    to the CPU core's bits: the cached table and its state equal the
    uncached table's, whose update runs on the CPU."""
    kind, keys = GPU_UPDATED[name]
    calls, update = [], GpuCacheState.update
    monkeypatch.setattr(GpuCacheState, "update",
                        lambda self, *args, **kwargs: calls.append(args[0]) or update(self, *args, **kwargs))
    pairs = _gpu_pair(name, fused=fused)
    steps = 60
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no GPU update.*")
        _train(pairs, _batches(steps), prefetch, ids_device)
    cached = pairs[1][0]
    cache = cached._table.cache
    assert cache.device.type == "cuda" and all(records.is_cuda for records in cache.cached.values())
    assert set(keys) <= set(cache.cached)
    if name == "RowWiseAdagrad":
        assert cache.cached["row_sum"].shape == (cache.capacity,)
    assert calls == [kind] * steps
    stats = cached.cache_stats
    assert stats["hits"] > 0 and stats["evictions"] > 0 and stats["bypassed"] > 0
    _assert_same(pairs)


def test_a_gpu_cache_holding_every_row_reads_and_updates_only_records():
    pairs = _gpu_pair(cache=ROWS)
    batches = _batches(5)
    _train(pairs, batches + batches)
    stats = pairs[1][0].cache_stats
    assert stats["bypassed"] == 0 and stats["evictions"] == 0
    _assert_records_on_gpu(*pairs[1])
    _assert_same(pairs)


def test_repeated_rows_of_several_lookups_are_summed_before_the_kernel(monkeypatch):
    # Fused, two lookups of the table in one backward: one update of their
    # concatenated sums, rows repeated, which the kernel cannot take.
    calls = []
    summed = _ops.sum_repeated_rows
    monkeypatch.setattr(_ops, "sum_repeated_rows", lambda *a: calls.append(1) or summed(*a))
    pairs = _gpu_pair(fused=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        first, second = (torch.randint(0, ROWS, (40,), generator=gen) for _ in range(2))
        for module, opt in pairs:
            (module(first).sum() + module(second).pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
    assert calls, "the repeated rows never reached the summing path"
    _assert_records_on_gpu(*pairs[1])
    _assert_same(pairs)


def _hot_id_pairs(make, dim, steps=4):
    """An uncached GPU-output table and one with a 40-row cache, trained
    alike by make(module)'s optimizer on Zipf ids hot enough that the GPU
    backward sums the hottest rows in chunks (cuda/grad_reduce.cu)."""
    torch.manual_seed(0)
    plain = hostembed.Embedding(700, dim, device="cuda")
    cached = hostembed.Embedding(700, dim, cache_rows=40, device="cuda")
    with torch.no_grad():
        cached.weight.copy_(plain.weight)
    pairs = [(m, make(m)) for m in (plain, cached)]
    gen = torch.Generator().manual_seed(0)
    hottest = 0
    for _ in range(steps):
        ids, grad = zipf_ids(700, 300, alpha=1.1, generator=gen), torch.randn(300, dim, generator=gen)
        hottest = max(hottest, int(torch.bincount(ids).max()))
        for module, opt in pairs:
            module(ids.cuda()).backward(grad.cuda())
            opt.step()
            opt.zero_grad()
    assert hottest > 32, "no id was hot enough for the chunked sums"
    return pairs


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_hot_ids_through_a_small_gpu_cache_give_the_uncached_gpu_bits(fused):
    """Most of each batch's rows bypass a 40-row cache, and the hottest id
    comes more than 32 times a batch, so the GPU backward sums its rows in
    chunks (cuda/grad_reduce.cu): the cache must give the uncached GPU
    path's bits, which round differently from the CPU core's straight sums
    (the tests above, with fewer repeats, compare with the CPU path)."""
    pairs = _hot_id_pairs(lambda m: hostembed.SparseAdam(m.parameters(), lr=0.01, fused=fused), 16)
    _assert_records_on_gpu(*pairs[1])
    _assert_same(pairs)


@pytest.mark.parametrize("form", ["bfloat16_adagrad", "int8_rowwise"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_records_moved_to_host_memory_keep_the_uncached_gpu_bits(form, fused):
    """A state without a GPU update (Adagrad's sum in bfloat16; SparseAdam
    with a row-wise second moment) moves the records to host memory; with
    hot ids, the gradient of GPU outputs must still be summed as the
    uncached GPU path sums it (in chunks), or the cached table drifts from
    the uncached one by an ulp."""
    if form == "bfloat16_adagrad":
        make = lambda m: hostembed.Adagrad(m.parameters(), lr=0.1, fused=fused,  # noqa: E731
                                           state_dtype=torch.bfloat16)
    else:
        make = lambda m: hostembed.SparseAdam(m.parameters(), lr=0.01, fused=fused,  # noqa: E731
                                              state_dtype=torch.int8, rowwise_exp_avg_sq=True)
    with pytest.warns(UserWarning, match="no GPU update"):
        pairs = _hot_id_pairs(make, 16)
    assert pairs[1][0]._table.cache.device.type == "cpu"
    assert pairs[0][0]._table.cache is None
    _assert_same(pairs)


@pytest.mark.parametrize("form,dim", [("bfloat16", 16), ("int8", 16), ("int8", 260), ("bfloat16", 260),
                                      ("bfloat16", 6), ("int8", 4)])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_compact_moments_in_gpu_records_give_the_uncached_bits(form, dim, fused):
    """bfloat16 and 8-bit moments (260 columns: a block of 256 and a part,
    each with its scale; 6 and 4: rows of an odd number of words, and four
    arrays one word wide, moved in two calls) stay in GPU records, updated there by the kernel
    (cuda/cache.cu's adam_compact_cached) to the CPU core's bits: the
    cached table and its state equal the uncached table's, whose update
    runs on the CPU."""
    make = lambda m: hostembed.SparseAdam(m.parameters(), lr=0.01, fused=fused,  # noqa: E731
                                          state_dtype=getattr(torch, form))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no GPU update.*")
        pairs = _hot_id_pairs(make, dim)
    cached, opt = pairs[1]
    cache = cached._table.cache
    assert cache.device.type == "cuda" and cache.cached["exp_avg"].is_cuda
    assert cache.cached["exp_avg"].dtype == (torch.bfloat16 if form == "bfloat16" else torch.int8)
    assert opt._last_update == "cache" and cache.last_update_from.type == "cuda"
    if fused:
        # The update took the backward's sums as they were: no check of
        # them on the host (a dedup a lookup is the step's one wait).
        ids = torch.arange(0, 700, 7, device="cuda")
        pairs[0][0](ids).sum().backward()
        waits = cache.host_waits
        cached(ids).sum().backward()
        assert cache.host_waits - waits == 1
    _assert_same(pairs)


def test_checkpoints_and_weight_reads_see_the_gpu_records(tmp_path):
    pairs = _gpu_pair()
    _train(pairs, _batches(20))
    (plain, _), (cached, cached_opt) = pairs
    assert "weight" in cached._table.cache.dirty
    hostembed.save(tmp_path / "c.pt", cached, cached_opt)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(saved["model"]["weight"], plain.weight)
    _train(pairs, _batches(5, seed=3))
    for module, opt in pairs:
        hostembed.load(tmp_path / "c.pt", module, opt)
    _train(pairs, _batches(10, seed=4))
    _assert_records_on_gpu(*pairs[1])
    _assert_same(pairs)


def test_an_optimizer_without_a_gpu_update_moves_the_records_to_host_memory():
    # SparseAdam with one second moment a row (FBGEMM's partial row-wise
    # Adam) has no kernel for records (SGD, Adagrad and RowWiseAdagrad do).
    pairs = _gpu_pair("SparseAdam", rowwise_exp_avg_sq=True)
    with pytest.warns(UserWarning, match="SparseAdam's row-wise second moment has no GPU update"):
        _train(pairs, _batches(20))
    assert pairs[1][0]._table.cache.device.type == "cpu"
    _assert_same(pairs)


def test_bad_ids_raise_and_change_nothing_on_the_gpu():
    (_, _), (cached, opt) = _gpu_pair()
    ids = _batches(1)[0]
    cached(ids).sum().backward()
    opt.step()
    _assert_records_on_gpu(cached, opt)
    before, stats = cached.weight.clone(), cached.cache_stats
    with pytest.raises(IndexError):
        cached(torch.tensor([1, ROWS], device="cuda"))
    assert cached.cache_stats == stats and torch.equal(cached.weight, before)


# ---- the planner on the GPU, and a step that never waits for it

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks" / "cache"))
import cache_plan_record  # noqa: E402  (benchmarks/cache/ on the path first)


@pytest.mark.parametrize("config", cache_plan_record.ALL_CONFIGS,
                         ids=lambda c: f"{c.get('policy', 'clock')}-capacity{c['capacity']}-seed{c['seed']}")
def test_the_gpu_planner_makes_the_cpu_planners_decisions(config):
    gpu = cache_plan_record.gpu_decisions(config)
    if config["capacity"] in (40, 400, 1200, 1500):  # one slot is never free of the last two batches; 2500 hold them all
        assert sum(len(evicted) for _, _, evicted in gpu[0]) > 0
    assert cache_plan_record.differences(gpu, cache_plan_record.cpu_decisions(config)) == []


def test_a_step_planned_ahead_never_makes_the_host_wait_but_for_the_dedup():
    # torch raises on any op that waits for the GPU (sync debug mode); the
    # dedup's own wait (in the extension) is the one the cache counts.
    (plain, plain_opt), (cached, opt) = _gpu_pair(fused=True)
    batches = [ids.cuda() for ids in _batches(30)]
    grads = [torch.randn(*ids.shape, DIM, device="cuda") for ids in batches]
    cache = cached._table.cache
    cached.prefetch(batches[0])
    for b, ids in enumerate(batches):
        waits = cache.host_waits
        torch.cuda.set_sync_debug_mode("error")
        try:
            cached(ids).backward(grads[b])
            if b + 1 < len(batches):
                cached.prefetch(batches[b + 1])
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert cached._table.prefetch_outcome == "taken: planned ahead"
        assert cache.host_waits - waits == (1 if b + 1 < len(batches) else 0)
        plain(ids.cpu()).backward(grads[b].cpu())
        plain_opt.step()
        plain_opt.zero_grad()
    _assert_records_on_gpu(cached, opt)
    stats = cached.cache_stats
    assert stats["evictions"] > 0 and stats["bypassed"] > 0
    _assert_same([(plain, plain_opt), (cached, opt)])
