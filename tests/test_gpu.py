"""The GPU path against torch on the GPU: lookups, gradients, SparseAdam.

Skipped with the reason where the GPU path cannot run (no CUDA compiled in,
or no GPU visible). Run only these with `pytest -m gpu`.
"""
import gc

import pytest
import torch
import torch.nn.functional as F

import hostembed
from hostembed import _cuda, _host_memory
from conftest import zipf_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
]

SHAPES = [(), (0,), (7,), (4, 5), (2, 3, 4)]
ID_DTYPES = [torch.int64, torch.int32]
ID_DEVICES = ["cpu", "cuda"]
UNIT = 2.0 ** -24  # float32 unit roundoff


def gpu_pair(num_rows, dim, seed=0, **kwargs):
    """torch nn.Embedding on the GPU and hostembed.Embedding with GPU
    outputs, with the same initial table."""
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(num_rows, dim, **kwargs)
    torch.manual_seed(seed)
    ours = hostembed.Embedding(num_rows, dim, device="cuda", **kwargs)
    assert torch.equal(ref.weight, ours.weight), "same seed must give torch's initial table"
    return ref.cuda(), ours


def exact_grad(ids, grad_out, num_rows, scale_grad_by_freq=False, padding_idx=None):
    """float64 dense gradient, the per-element sum of |terms| and the number
    of terms per row: what bounds any float32 summation order."""
    dim = grad_out.shape[-1]
    ids = ids.reshape(-1).long().cpu()
    rows = grad_out.reshape(-1, dim).double().cpu()
    counts = torch.bincount(ids, minlength=num_rows).double()
    if scale_grad_by_freq:
        rows = rows / counts[ids].unsqueeze(1)
    exact = torch.zeros(num_rows, dim, dtype=torch.float64).index_add_(0, ids, rows)
    abs_sum = torch.zeros(num_rows, dim, dtype=torch.float64).index_add_(0, ids, rows.abs())
    if padding_idx is not None:
        exact[padding_idx] = 0
        abs_sum[padding_idx] = 0
    return exact, abs_sum, counts


def assert_grad_within_rounding(grad, ids, grad_out, num_rows, **kwargs):
    """|grad - exact| <= (terms + 2) u sum|terms| per element: the classic
    bound for summing in any order (+2 for the per-row scale's rounding and
    the final rounding). A missing, doubled or misrouted row breaks it by
    orders of magnitude."""
    exact, abs_sum, counts = exact_grad(ids, grad_out, num_rows, **kwargs)
    dense = grad.to_dense().double().cpu() if grad.is_sparse else grad.double().cpu()
    bound = (counts.unsqueeze(1) + 2) * UNIT * abs_sum
    err = (dense - exact).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0.0, f"gradient off by more than float32 rounding allows (excess {worst:.3g})"


@pytest.mark.parametrize("ids_device", ID_DEVICES)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_bitwise_equal_to_torch(shape, dtype, ids_device):
    ref, ours = gpu_pair(50, 12)
    ids = torch.randint(0, 50, shape, dtype=dtype, device=ids_device)
    out = ours(ids)
    expected = F.embedding(ids.cuda(), ref.weight)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    assert out.shape == expected.shape == shape + (12,)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dim", [1, 13, 16, 128, 512])
def test_forward_all_row_widths_and_zipf(dim):
    # dim % 4 == 0: 16-byte loads; otherwise the scalar kernel.
    ref, ours = gpu_pair(5000, dim)
    ids = zipf_ids(5000, 20_000, generator=torch.Generator().manual_seed(dim)).cuda()
    assert torch.equal(ours(ids), F.embedding(ids, ref.weight))


def test_forward_non_contiguous_gpu_ids():
    ref, ours = gpu_pair(40, 8)
    ids = torch.randint(0, 40, (6, 9), device="cuda").t()
    assert not ids.is_contiguous()
    assert torch.equal(ours(ids), F.embedding(ids, ref.weight))


@pytest.mark.parametrize("ids_device", ID_DEVICES)
@pytest.mark.parametrize("view", [lambda t: t[::2], lambda t: t[:1].expand(9), lambda t: t.view(3, 4)[:, 1]],
                         ids=["strided", "expanded", "column"])
def test_strided_1d_ids_forward_and_backward(view, ids_device):
    # reshape(-1) leaves these 1-D views as they are (strided, or stride 0):
    # the kernels must get packed ids all the same.
    ref, ours = gpu_pair(40, 8)
    ids = view(torch.randperm(40, device=ids_device)[:12])
    assert not ids.is_contiguous()
    out = ours(ids)
    assert torch.equal(out, F.embedding(ids.cuda(), ref.weight))
    grad_out = torch.randn(out.shape, device="cuda")
    out.backward(grad_out)
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 40)


def test_float64_default_dtype_keeps_float32_rows():
    ref, ours = gpu_pair(30, 8)
    ids = torch.randint(0, 30, (50,), device="cuda")
    grad_out = torch.randn(50, 8, device="cuda")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = ours(ids)
        out.backward(grad_out)
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32 and torch.equal(out, F.embedding(ids, ref.weight))
    assert ours.weight.grad.dtype == torch.float32
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_current_device_left_as_it_was():
    # The kernels' runtime shares the thread's current device with torch:
    # work on cuda:1, and freeing a table registered from cuda:0, must not
    # move later torch allocations to another GPU.
    torch.cuda.set_device(0)
    try:
        emb = hostembed.Embedding(100, 8, device="cuda:1")
        opt = hostembed.SparseAdam(emb.parameters())
        emb(torch.tensor([1, 2, 2], device="cuda:1")).sum().backward()
        opt.step()
        assert torch.cuda.current_device() == 0
        torch.cuda.set_device(1)
        registered = len(_host_memory._registered)
        del emb, opt
        gc.collect()
        assert len(_host_memory._registered) < registered, "the table was not freed: nothing was tested"
        assert torch.cuda.current_device() == 1
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("ids_device", ID_DEVICES)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [13, 64])
def test_backward_zipf_gradient_within_rounding_of_exact(dim, dtype, ids_device):
    num_rows = 3000
    ref, ours = gpu_pair(num_rows, dim, sparse=True)
    gen = torch.Generator().manual_seed(1)
    ids = zipf_ids(num_rows, 8192, generator=gen).to(dtype).to(ids_device)
    grad_out = torch.randn(8192, dim, generator=gen).cuda()
    ours(ids).backward(grad_out)
    ref(ids.cuda()).backward(grad_out)
    grad = ours.weight.grad
    # Where the weight lives (autograd's rule), coalesced, torch's rows.
    assert grad.device.type == "cpu" and grad.is_sparse and grad.shape == (num_rows, dim)
    assert grad.dtype == torch.float32
    assert_grad_within_rounding(grad, ids, grad_out, num_rows)
    assert_grad_within_rounding(ref.weight.grad, ids, grad_out, num_rows)  # the bound holds for torch too
    torch_rows = ref.weight.grad.coalesce()._indices()[0].cpu()
    assert torch.equal(grad._indices()[0], torch_rows)


@pytest.mark.parametrize("dim", [4, 7])
def test_backward_hot_ids_across_chunk_boundaries(dim):
    # Ids occurring 1..2000 times: around and far past the 32-position chunks
    # the GPU reduce splits hot ids into.
    counts = [1, 2, 31, 32, 33, 63, 64, 65, 97, 2000]
    ids = torch.cat([torch.full((c,), 3 * i + 1) for i, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    num_rows = 3 * len(counts) + 1
    _, ours = gpu_pair(num_rows, dim)
    grad_out = torch.randn(ids.numel(), dim).cuda()
    ours(ids.cuda()).backward(grad_out)
    grad = ours.weight.grad
    assert grad._indices()[0].tolist() == [3 * i + 1 for i in range(len(counts))]
    assert_grad_within_rounding(grad, ids, grad_out, num_rows)


def test_backward_is_deterministic():
    _, ours = gpu_pair(500, 32)
    ids = zipf_ids(500, 50_000, generator=torch.Generator().manual_seed(2)).cuda()
    grad_out = torch.randn(50_000, 32).cuda()
    grads = []
    for _ in range(3):
        grads.append(torch.autograd.grad(ours(ids), ours.weight, grad_out)[0])
    assert all(torch.equal(g._values(), grads[0]._values()) for g in grads[1:])


@pytest.mark.parametrize("padding_idx", [0, 7, -1])
def test_padding_idx_gets_no_gradient(padding_idx):
    ref, ours = gpu_pair(20, 6, sparse=True, padding_idx=padding_idx)
    ids = torch.tensor([7, 0, 19, 7, 3, 0, 19]).cuda()
    grad_out = torch.randn(7, 6).cuda()
    out = ours(ids)
    assert torch.equal(out, F.embedding(ids, ref.weight))
    out.backward(grad_out)
    pad = ours.padding_idx
    grad = ours.weight.grad
    assert pad not in grad._indices()[0].tolist()
    assert_grad_within_rounding(grad, ids, grad_out, 20, padding_idx=pad)


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_scale_grad_by_freq(padding_idx):
    # torch refuses scale_grad_by_freq with sparse gradients: its dense
    # gradient is the reference; ours is sparse.
    torch.manual_seed(0)
    ref = torch.nn.Embedding(30, 8, scale_grad_by_freq=True, padding_idx=padding_idx).cuda()
    ours = hostembed.Embedding(30, 8, scale_grad_by_freq=True, padding_idx=padding_idx, device="cuda")
    ids = zipf_ids(30, 500, generator=torch.Generator().manual_seed(4)).cuda()
    grad_out = torch.randn(500, 8).cuda()
    ours(ids).backward(grad_out)
    ref(ids).backward(grad_out)
    assert ours.weight.grad.is_sparse
    kwargs = dict(scale_grad_by_freq=True, padding_idx=padding_idx)
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 30, **kwargs)
    assert_grad_within_rounding(ref.weight.grad, ids, grad_out, 30, **kwargs)


def test_dense_gradient():
    with pytest.warns(UserWarning, match="dense gradient"):
        ref, ours = gpu_pair(40, 4, sparse=False)
    ids = torch.randint(0, 40, (100,)).cuda()
    grad_out = torch.randn(100, 4).cuda()
    ours(ids).backward(grad_out)
    assert not ours.weight.grad.is_sparse
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 40)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_max_norm_matches_cpu_path_and_torch(norm_type):
    # Same arithmetic as the CPU core (norm in double, rounded): the table
    # after the renorm agrees with the CPU path's to an ulp of the scale;
    # torch (float accumulation) to float32 rounding.
    torch.manual_seed(3)
    ids = torch.randint(0, 60, (200,))
    ref, ours = gpu_pair(60, 16, max_norm=1.5, norm_type=norm_type)
    torch.manual_seed(0)
    cpu_path = hostembed.Embedding(60, 16, max_norm=1.5, norm_type=norm_type)
    out = ours(ids.cuda())
    expected = ref(ids.cuda())
    cpu_out = cpu_path(ids)
    torch.testing.assert_close(ours.weight, cpu_path.weight, rtol=5e-7, atol=0)
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=4e-6, atol=0)
    assert torch.equal(out, F.embedding(ids.cuda(), ours.weight.detach().cuda()))
    torch.testing.assert_close(out.cpu(), cpu_out, rtol=5e-7, atol=0)
    torch.testing.assert_close(out, expected, rtol=4e-6, atol=0)
    untouched = torch.ones(60, dtype=torch.bool)
    untouched[ids] = False
    torch.manual_seed(0)
    fresh = hostembed.Embedding(60, 16)
    assert torch.equal(ours.weight[untouched], fresh.weight[untouched])


def test_empty_batch():
    ref, ours = gpu_pair(10, 3, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters())
    opt = hostembed.SparseAdam(ours.parameters())
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    out = ours(empty)
    assert out.shape == (0, 3) and out.device.type == "cuda"
    out.sum().backward()
    ref(empty).sum().backward()
    assert ours.weight.grad._nnz() == 0
    opt.step()
    ref_opt.step()
    assert opt.state[ours.weight]["step"] == ref_opt.state[ref.weight]["step"] == 1
    assert torch.equal(ours.weight, ref.weight.detach().cpu())


@pytest.mark.parametrize("ids_device", ID_DEVICES)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [20, 1 << 40, -1], ids=["num_rows", "huge", "negative"])
def test_out_of_range_id_raises_before_any_write(bad, dtype, ids_device):
    if dtype == torch.int32 and bad > 2**31 - 1:
        pytest.skip("not representable in int32")
    # max_norm=0.1 would rewrite every referenced row: nothing may change.
    _, ours = gpu_pair(20, 4, max_norm=0.1)
    opt = hostembed.SparseAdam(ours.parameters())
    before = ours.weight.detach().clone()
    ids = torch.tensor([1, 2, 3, bad, 4, bad], dtype=dtype, device=ids_device)
    with pytest.raises(IndexError, match=rf"id {bad} at position 3 is not in \[0, 20\) for a table of 20 rows"):
        ours(ids)
    torch.cuda.synchronize()
    assert torch.equal(ours.weight, before)
    assert ours.weight.grad is None and len(opt.state) == 0
    # The table and the GPU path still work afterwards.
    ok = torch.tensor([1, 2], device=ids_device, dtype=dtype)
    assert torch.equal(ours(ok), F.embedding(ok.cuda(), ours.weight.detach().cuda()))


def test_table_and_state_are_pinned_in_place():
    _, ours = gpu_pair(100, 8)
    address = ours.weight.data_ptr()
    assert ours.weight.is_pinned()
    opt = hostembed.SparseAdam(ours.parameters())
    ours(torch.tensor([1, 2], device="cuda")).sum().backward()
    opt.step()
    state = opt.state[ours.weight]
    assert state["exp_avg"].is_pinned() and state["exp_avg_sq"].is_pinned()
    assert ours.weight.data_ptr() == address  # registered where it is, never copied


def test_freeing_tables_unregisters_them():
    # Registered buffers are unregistered before munmap: many short-lived
    # 64 MiB tables in a row would fail (or crash) otherwise.
    for _ in range(20):
        emb = hostembed.Embedding(1 << 18, 64, device="cuda")
        assert emb.weight.is_pinned()
        emb(torch.tensor([0, (1 << 18) - 1], device="cuda")).sum().backward()
        del emb
    torch.cuda.synchronize()


def train(emb, opt, batches, grads, device):
    for ids, g in zip(batches, grads):
        opt.zero_grad()
        emb(ids.to(device)).backward(g.to(device))
        opt.step()


@pytest.mark.parametrize("update", ["gpu", "cpu"])
@pytest.mark.parametrize("dim", [16, 13])
def test_fifty_zipf_steps_match_torch_on_the_gpu(update, dim):
    # As tests/test_sparse_adam.py: a float64 run is the exact reference and
    # our float32 error stays within a small multiple of torch's own.
    num_rows = 3000
    ref, ours = gpu_pair(num_rows, dim, sparse=True)
    exact = torch.nn.Embedding(num_rows, dim, sparse=True, _weight=ref.weight.detach().double().clone()).cuda()
    gen = torch.Generator().manual_seed(0)
    batches = [zipf_ids(num_rows, 2048, generator=gen) for _ in range(50)]
    grads = [torch.randn(2048, dim, generator=gen) for _ in range(50)]
    optimizers = {
        "exact": torch.optim.SparseAdam(exact.parameters(), lr=0.01),
        "torch": torch.optim.SparseAdam(ref.parameters(), lr=0.01),
        "ours": hostembed.SparseAdam(ours.parameters(), lr=0.01, update=update),
    }
    train(exact, optimizers["exact"], batches, [g.double() for g in grads], "cuda")
    train(ref, optimizers["torch"], batches, grads, "cuda")
    train(ours, optimizers["ours"], batches, grads, "cuda")
    assert optimizers["ours"]._last_update == update

    def values(name, emb):
        state = optimizers[name].state[emb.weight]
        assert state["step"] == 50
        return {"weight": emb.weight.detach().double().cpu(), "exp_avg": state["exp_avg"].double().cpu(),
                "exp_avg_sq": state["exp_avg_sq"].double().cpu()}

    exact_v, torch_v, ours_v = values("exact", exact), values("torch", ref), values("ours", ours)
    for key in exact_v:
        torch_err = (torch_v[key] - exact_v[key]).abs().max().item()
        ours_err = (ours_v[key] - exact_v[key]).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-7, f"{key}: error {ours_err:.3g} vs torch's {torch_err:.3g}"


@pytest.mark.parametrize("dim", [16, 13])
def test_gpu_and_cpu_updates_give_the_same_bits(dim):
    # Same gradients (GPU backward), same arithmetic in the same order.
    gen = torch.Generator().manual_seed(5)
    batches = [zipf_ids(1000, 4096, generator=gen) for _ in range(8)]
    grads = [torch.randn(4096, dim, generator=gen) for _ in range(8)]
    results = []
    for update in ("gpu", "cpu"):
        _, ours = gpu_pair(1000, dim)
        opt = hostembed.SparseAdam(ours.parameters(), lr=0.05, betas=(0.8, 0.99), update=update)
        train(ours, opt, batches, grads, "cuda")
        assert opt._last_update == update
        state = opt.state[ours.weight]
        results.append([ours.weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_next_forward_sees_the_gpu_update():
    _, ours = gpu_pair(100, 16)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.5, update="gpu")
    ids = torch.tensor([5, 6, 5, 99], device="cuda")
    for _ in range(3):
        before = ours.weight.detach().clone()
        out = ours(ids)
        assert torch.equal(out, F.embedding(ids, before.cuda()))
        out.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(ours.weight[5], before[5])


def test_gradient_changed_after_backward_goes_to_the_cpu_core():
    # Clipping scales weight.grad in place: the GPU copy is stale, so the
    # update must come from weight.grad itself.
    _, ours = gpu_pair(50, 8)
    _, twin = gpu_pair(50, 8)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1, update="gpu")
    twin_opt = hostembed.SparseAdam(twin.parameters(), lr=0.1, update="cpu")
    ids = torch.tensor([1, 2, 2, 40], device="cuda")
    for emb, o in ((ours, opt), (twin, twin_opt)):
        emb(ids).sum().backward()
        emb.weight.grad.mul_(0.25)
        o.step()
    assert opt._last_update == "cpu"
    assert torch.equal(ours.weight, twin.weight)
    assert ours.weight.grad._values().eq(0.25).any()


def test_torch_sparse_adam_steps_on_the_cpu_gradient():
    ref, ours = gpu_pair(64, 8, sparse=True)
    opt = torch.optim.SparseAdam(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    ids = torch.tensor([3, 3, 9], device="cuda")
    for emb, o in ((ours, opt), (ref, ref_opt)):
        emb(ids).sum().backward()
        o.step()
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=1e-6, atol=1e-7)


def test_work_on_a_side_stream():
    ref, ours = gpu_pair(300, 32, sparse=True)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    side = torch.cuda.Stream()
    ids = torch.randint(0, 300, (1000,), device="cuda")
    g = torch.randn(1000, 32, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(3):
            for emb, o in ((ours, opt), (ref, ref_opt)):
                o.zero_grad()
                emb(ids).backward(g)
                o.step()
        out = ours(ids)
        expected = ref(ids)
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_cpu_outputs_after_gpu_lookups_see_the_same_table():
    _, ours = gpu_pair(30, 4)
    ids = torch.arange(30)
    gpu_out = ours(ids.cuda())
    ours.cpu()
    assert torch.equal(ours(ids), gpu_out.cpu())
