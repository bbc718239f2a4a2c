"""Table dtypes: float32, float16, bfloat16 and float64 tables (dtype=,
from_pretrained, module casts, torch's default dtype) against torch's own
modules of the same dtype: outputs, gradients, optimizer updates, gradcheck
in float64, checkpoints, the memory a cast takes, and stochastic rounding of
half tables."""
import copy
import os

import pytest
import torch
from torch import nn

import hostembed

HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float64)
ROWS, DIM = 60, 8


def _ids(n=40, seed=0, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    # Zipf-like: a few hot rows repeat within a batch.
    hot = torch.randint(0, 6, (n,), generator=g)
    cold = torch.randint(0, rows, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, hot, cold)


def _pair(kind, dtype, **options):
    torch.manual_seed(0)
    if kind == "embedding":
        ref = nn.Embedding(ROWS, DIM, sparse=True, dtype=dtype, **options)
        ours = hostembed.Embedding(ROWS, DIM, dtype=dtype, **options)
    else:
        ref = nn.EmbeddingBag(ROWS, DIM, mode=kind, sparse=kind != "max", dtype=dtype, **options)
        ours = hostembed.EmbeddingBag(ROWS, DIM, mode=kind, dtype=dtype, **options)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
    return ref, ours


def _call(module, kind, ids):
    return module(ids) if kind == "embedding" else module(ids.reshape(-1, 4))


def _dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


@pytest.mark.parametrize("kind", ["embedding", "sum", "mean", "max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tables_of_every_dtype_look_up_and_differentiate_as_torch(dtype, kind):
    ref, ours = _pair(kind, dtype, padding_idx=3)
    assert ours.weight.dtype == dtype and ours.output_dtype == dtype
    ids = _ids()
    out_ref, out = _call(ref, kind, ids), _call(ours, kind, ids)
    assert out.dtype == dtype
    assert torch.equal(out, out_ref)  # rows copied, pooled by torch's own embedding_bag
    upstream = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    (out_ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    assert ours.weight.grad.dtype == dtype
    got, want = _dense(ours.weight.grad).double(), _dense(ref.weight.grad).double()
    # Sums of the same terms in another order: a few roundings of the dtype apart.
    eps = torch.finfo(dtype).eps
    assert torch.allclose(got, want, rtol=8 * eps, atol=8 * eps * want.abs().max().item())


def _train(module, kind, opt, steps, seed=1):
    for step in range(steps):
        ids = _ids(seed=seed + step)
        opt.zero_grad()
        out = _call(module, kind, ids)
        # A convex loss, so that rounding differences do not grow.
        ((out.double() - 0.5) ** 2).sum().mul(0.5).backward()
        opt.step()


OPTIMIZERS = {
    "SparseAdam": (lambda p: hostembed.SparseAdam(p, lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    "SGD": (lambda p: hostembed.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "Adagrad": (lambda p: hostembed.Adagrad(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
}


@pytest.mark.parametrize("kind", ["embedding", "sum"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float64_tables_train_as_torch_in_float64(name, kind):
    ref, ours = _pair(kind, torch.float64)
    make_ours, make_ref = OPTIMIZERS[name]
    opt, ref_opt = make_ours([ours.weight]), make_ref([ref.weight])
    _train(ours, kind, opt, 50)
    _train(ref, kind, ref_opt, 50)
    # float64 arithmetic in torch's order: within a few float64 roundings.
    assert torch.allclose(ours.weight.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)
    for key, value in ref_opt.state[ref.weight].items():
        if key != "step":
            assert opt.state[ours.weight][key].dtype == torch.float64
            assert torch.allclose(opt.state[ours.weight][key], value, rtol=1e-12, atol=1e-14), key


def test_float64_rowwise_adagrad_against_its_formula():
    _, ours = _pair("embedding", torch.float64)
    w = ours.weight.detach().clone()
    state = torch.zeros(ROWS, dtype=torch.float64)
    opt = hostembed.RowWiseAdagrad([ours.weight], lr=0.1, eps=1e-8)
    for step in range(20):
        ids = _ids(seed=step)
        opt.zero_grad()
        (ours(ids).sin().sum()).backward()
        g = torch.zeros(ROWS, DIM, dtype=torch.float64).index_add_(0, ids, torch.cos(w[ids]))
        rows = ids.unique()
        state[rows] += (g[rows] ** 2).mean(1)
        w[rows] -= (0.1 / (state[rows].sqrt() + 1e-8)).unsqueeze(1) * g[rows]
        opt.step()
    assert torch.allclose(ours.weight.detach(), w, rtol=1e-12, atol=1e-13)
    assert torch.allclose(opt.state[ours.weight]["row_sum"], state, rtol=1e-12)


@pytest.mark.parametrize("name", ["SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_tables_train_within_their_rounding_of_float32(dtype, name):
    make = {"SparseAdam": lambda p: hostembed.SparseAdam(p, lr=0.01), "SGD": lambda p: hostembed.SGD(p, lr=0.1),
            "Adagrad": lambda p: hostembed.Adagrad(p, lr=0.1),
            "RowWiseAdagrad": lambda p: hostembed.RowWiseAdagrad(p, lr=0.1)}[name]
    _, half = _pair("embedding", dtype)
    full = hostembed.Embedding.from_pretrained(half.weight.detach().float(), freeze=False)
    start = full.weight.detach().clone()
    opt_h, opt_f = make([half.weight]), make([full.weight])
    steps = 50
    _train(half, "embedding", opt_h, steps)
    _train(full, "embedding", opt_f, steps)
    got, want = half.weight.detach().float(), full.weight.detach()
    assert half.weight.dtype == dtype
    # State stays float32, and the rows really trained.
    assert all(v.dtype == torch.float32 for k, v in opt_h.state[half.weight].items() if k != "step")
    moved = (want - start).abs().max().item()
    assert moved > 0.05
    # Each step rounds every updated weight once (half an ulp), and the
    # gradients see the rounded weights: bounded by steps x ulp of the
    # largest weight.
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    assert (got - want).abs().max().item() <= steps * ulp


@pytest.mark.parametrize("name", ["SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["embedding", "mean"])
def test_fused_updates_give_the_unfused_bits_for_every_dtype(kind, dtype, name):
    make = {"SparseAdam": hostembed.SparseAdam, "SGD": hostembed.SGD, "Adagrad": hostembed.Adagrad,
            "RowWiseAdagrad": hostembed.RowWiseAdagrad}[name]
    _, plain = _pair(kind, dtype)
    fused = copy.deepcopy(plain)
    opt_p, opt_f = make([plain.weight], lr=0.05), make([fused.weight], lr=0.05, fused=True)
    for step in range(5):
        for module, opt in ((plain, opt_p), (fused, opt_f)):
            opt.zero_grad()
            _call(module, kind, _ids(seed=step)).double().cos().sum().backward()
            opt.step()
    assert torch.equal(plain.weight.view(-1), fused.weight.view(-1))


@pytest.mark.parametrize("kind", ["embedding", "sum", "mean"])
def test_gradcheck_in_float64(kind):
    _, ours = _pair(kind, torch.float64)
    ours.sparse = False  # gradcheck compares dense Jacobians
    ids = _ids(12)
    if kind == "embedding":
        fn = lambda weight: ours(ids)  # noqa: E731  (weight is ours.weight, perturbed in place)
        assert torch.autograd.gradcheck(fn, (ours.weight,))
    else:
        psw = torch.rand(3, 4, dtype=torch.float64, requires_grad=kind == "sum")
        fn = lambda weight, w: ours(ids.reshape(3, 4), per_sample_weights=w if kind == "sum" else None)  # noqa
        assert torch.autograd.gradcheck(fn, (ours.weight, psw))


CASTS = {
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "double": (lambda m: m.double(), torch.float64),
    "to(float64)": (lambda m: m.to(torch.float64), torch.float64),
    "double().float()": (lambda m: m.double().float(), torch.float32),
}


@pytest.mark.parametrize("kind", ["embedding", "sum"])
@pytest.mark.parametrize("cast", CASTS)
def test_module_casts_convert_the_table_as_torch_does(cast, kind):
    apply, dtype = CASTS[cast]
    ref, ours = _pair(kind, torch.float32)
    ref_model, model = apply(nn.Sequential(ref, nn.Linear(DIM, 2))), apply(nn.Sequential(ours, nn.Linear(DIM, 2)))
    with torch.no_grad():
        model[1].load_state_dict(ref_model[1].state_dict())
    assert ours.weight.dtype == dtype and ours.weight.device.type == "cpu"
    assert torch.equal(ours.weight, ref.weight)
    ids = _ids()
    x = ids if kind == "embedding" else ids.reshape(-1, 4)
    out_ref, out = ref_model(x), model(x)
    assert out.dtype == dtype and torch.equal(out, out_ref)
    out_ref.float().sum().backward()
    out.float().sum().backward()
    assert ours.weight.grad.dtype == dtype
    eps = torch.finfo(dtype).eps
    want = _dense(ref.weight.grad).double()
    assert torch.allclose(_dense(ours.weight.grad).double(), want, rtol=8 * eps, atol=8 * eps * want.abs().max())


def test_optimizer_state_converts_with_a_cast_at_the_next_step():
    _, ours = _pair("embedding", torch.float32)
    opt = hostembed.SparseAdam([ours.weight], lr=0.01)
    _train(ours, "embedding", opt, 3)
    moments = {k: v.clone() for k, v in opt.state[ours.weight].items() if k != "step"}
    ours.double()
    twin = hostembed.Embedding.from_pretrained(ours.weight.detach(), freeze=False)
    twin_opt = hostembed.SparseAdam([twin.weight], lr=0.01)
    twin_opt.load_state_dict(opt.state_dict())
    _train(ours, "embedding", opt, 2, seed=9)
    _train(twin, "embedding", twin_opt, 2, seed=9)
    for key, before in moments.items():
        after = opt.state[ours.weight][key]
        assert after.dtype == torch.float64 and not torch.equal(after.float(), before)
    # The same as an optimizer loaded from the pre-cast state into a float64 table.
    assert torch.equal(ours.weight, twin.weight)
    ours.half()  # float64 state converts back to float32, the half table's
    _train(ours, "embedding", opt, 1)
    assert all(v.dtype == torch.float32 for k, v in opt.state[ours.weight].items() if k != "step")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_initial_rows_are_torchs_for_the_same_seed(dtype):
    torch.manual_seed(5)
    ref = nn.Embedding(ROWS, DIM, dtype=dtype)
    torch.manual_seed(5)
    assert torch.equal(hostembed.Embedding(ROWS, DIM, dtype=dtype).weight, ref.weight)


def test_torch_default_dtype_applies_to_new_tables():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        emb, bag = hostembed.Embedding(5, 2), hostembed.EmbeddingBag(5, 2)
    finally:
        torch.set_default_dtype(previous)
    assert emb.weight.dtype == torch.float64 and bag.weight.dtype == torch.float64
    assert hostembed.Embedding(5, 2).weight.dtype == previous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_checkpoints_and_state_dicts_keep_the_dtype(tmp_path, dtype):
    _, ours = _pair("embedding", dtype)
    opt = hostembed.SparseAdam([ours.weight], lr=0.01)
    _train(ours, "embedding", opt, 2)
    hostembed.save(tmp_path / "ck", ours, opt)
    fresh = hostembed.Embedding(ROWS, DIM, dtype=dtype)
    fresh_opt = hostembed.SparseAdam([fresh.weight], lr=0.01)
    hostembed.load(tmp_path / "ck", fresh, fresh_opt)
    assert fresh.weight.dtype == dtype and torch.equal(fresh.weight, ours.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert fresh_opt.state[fresh.weight][key].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(fresh_opt.state[fresh.weight][key], opt.state[ours.weight][key])
    # torch's own load_state_dict path (it casts state to the parameter's dtype) keeps it too.
    for make in (hostembed.SparseAdam, hostembed.Adagrad):
        first, second = make([ours.weight], lr=0.01), make([fresh.weight], lr=0.01)
        _train(ours, "embedding", first, 1)
        second.load_state_dict(first.state_dict())
        for key, value in first.state[ours.weight].items():
            if key != "step":
                assert torch.equal(second.state[fresh.weight][key], value), (make, key)
    torch.save(ours.state_dict(), tmp_path / "sd.pt")
    loaded = hostembed.Embedding.from_pretrained(tmp_path / "sd.pt")
    assert loaded.weight.dtype == dtype and torch.equal(loaded.weight, ours.weight)


def _peak_rss_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("start, to", [(torch.float32, torch.bfloat16), (torch.float32, torch.float64),
                                       (torch.bfloat16, torch.float32)])
def test_a_cast_peaks_at_the_larger_table_plus_a_chunk(start, to):
    rows, dim = 1 << 18, 128  # 128 MiB as float32
    emb = hostembed.Embedding(rows, dim, dtype=start)
    old_bytes = rows * dim * start.itemsize
    new_bytes = rows * dim * to.itemsize
    expected = emb.weight.detach().to(to)
    _peak_rss_reset()
    base = _rss_kib("VmRSS:") * 1024  # the old table is resident
    emb.to(to)
    peak = _rss_kib("VmHWM:") * 1024 - base
    after = _rss_kib("VmRSS:") * 1024 - base
    # Old pages go as their rows are converted: never both tables.
    assert peak <= max(new_bytes - old_bytes, 0) + (32 << 20), (peak >> 20, old_bytes >> 20, new_bytes >> 20)
    assert after <= new_bytes - old_bytes + (32 << 20)
    assert emb.weight.dtype == to and torch.equal(emb.weight.detach(), expected)


def test_a_cast_leaves_a_kept_view_of_the_old_rows_intact():
    # torch's cast makes new memory: a view taken before still reads the
    # old values. The old memory is then released only after the copy.
    emb = hostembed.Embedding(5000, 64)
    kept = emb.weight.detach()[10:20]
    before = kept.clone()
    emb.bfloat16()
    assert torch.equal(kept, before)
    assert torch.equal(emb.weight.detach()[10:20], before.bfloat16())
    del kept
    emb.float()  # nothing else sees the bfloat16 rows: released as they go
    assert torch.equal(emb.weight.detach()[10:20], before.bfloat16().float())


def test_stochastic_rounding_keeps_small_updates_on_average_and_repeats_with_the_seed():
    def run(stochastic, seed=0):
        torch.manual_seed(seed)
        emb = hostembed.Embedding(2000, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            emb.weight.fill_(1.0)
        emb.stochastic_rounding = stochastic
        opt = hostembed.SGD([emb.weight], lr=1e-3)
        ids = torch.arange(2000)
        for _ in range(20):
            opt.zero_grad()
            emb(ids).sum().backward()  # gradient 1: each step subtracts 1e-3, an eighth of bf16's ulp at 1
            opt.step()
        return emb.weight.detach().float()

    nearest = run(False)
    assert torch.equal(nearest, torch.ones_like(nearest))  # every update rounded away
    sr = run(True)
    # Unbiased: the mean lands near 1 - 20e-3 (to within 5 standard errors).
    mean = sr.mean().item()
    assert abs(mean - (1 - 20e-3)) < 5 * 2 ** -8 / (sr.numel() ** 0.5) * 20 ** 0.5
    assert torch.equal(sr, run(True))  # same torch seed, same bits
    assert not torch.equal(sr, run(True, seed=1))
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool"):
        hostembed.Embedding(2, 2).stochastic_rounding = 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_bag_takes_per_sample_weights_of_its_own_dtype_only_as_torch(dtype):
    ref, ours = _pair("sum", dtype)
    ids = _ids(12).reshape(3, 4)
    psw = torch.rand(3, 4).to(dtype)
    assert torch.equal(ours(ids, per_sample_weights=psw), ref(ids, per_sample_weights=psw))
    with pytest.raises(RuntimeError, match="have the same type as"):
        ref(ids, per_sample_weights=psw.float())
    with pytest.raises(RuntimeError, match=f"have the same type as the weight \\({dtype}\\), got torch.float32"):
        ours(ids, per_sample_weights=psw.float())


def test_replace_embeddings_keeps_each_tables_dtype():
    model = nn.Sequential(nn.Embedding(50, 4, dtype=torch.bfloat16), nn.EmbeddingBag(40, 4, dtype=torch.float64))
    weights = [m.weight.detach().clone() for m in model]
    hostembed.replace_embeddings(model, min_rows=1)
    assert isinstance(model[0], hostembed.Embedding) and isinstance(model[1], hostembed.EmbeddingBag)
    for module, weight in zip(model, weights):
        assert module.weight.dtype == weight.dtype and torch.equal(module.weight, weight)


def test_a_cast_drops_an_outstanding_prefetch():
    emb = hostembed.Embedding(20, 4)
    ids = torch.tensor([1, 2, 3])
    emb.prefetch(ids)
    emb.half()
    out = emb(ids)
    assert out.dtype == torch.float16 and torch.equal(out, emb.weight[ids])
