"""The GPU path against torch on the GPU: lookups, gradients, SparseAdam.

Skipped with the reason where the GPU path cannot run (no CUDA compiled in,
or no GPU visible). Run only these with `pytest -m gpu`.

Every test here must be able to fail. When CUDA refuses to pin a table, a
lookup falls back to the CPU core plus a copy to the GPU, with the same
values: a test that compared values only would pass without one GPU kernel
having run. So each GPU lookup is followed by assert_kernel_path (the
forward took the GPU path, on a pinned table), every update test asks for
update="gpu" and checks it ran there, and the RuntimeWarning of a refused
pin is an error in this module.
"""
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F

import hostembed
from hostembed._core import cuda as _cuda
from conftest import compile_matches_eager, zipf_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
    # "could not pin ... GPU lookups and updates on it go through the CPU core and a copy"
    pytest.mark.filterwarnings("error::RuntimeWarning"),
]

SHAPES = [(), (0,), (7,), (4, 5), (2, 3, 4)]
ID_DTYPES = [torch.int64, torch.int32]
ID_DEVICES = ["cpu", "cuda"]
UNIT = 2.0 ** -24  # float32 unit roundoff


def assert_kernel_path(emb, opt=None):
    """emb's last forward ran the GPU kernels on its pinned table, not the
    CPU core plus a copy (which gives the same values); with opt, its last
    step updated the table with the GPU kernel, and the Adam state it
    updated is pinned too."""
    path = emb._last_lookup_path
    assert path == "gpu", f"the last lookup took the {path!r} path, not the GPU kernels"
    assert emb.weight.is_pinned(), "a GPU lookup ran, yet the table is not pinned (registered with CUDA)"
    if opt is not None:
        assert opt._last_update == "gpu", f"the last step updated on the {opt._last_update!r} side, not the GPU"
        state = opt.state[emb.weight]
        assert state["exp_avg"].is_pinned() and state["exp_avg_sq"].is_pinned(), \
            "the GPU updated the Adam state, yet it is not pinned"


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


def assert_row_grads_within_rounding(grad, ids, grad_out):
    """assert_grad_within_rounding on the looked-up rows only, for tables
    too big for a dense float64 copy. Returns the gradient's rows and values."""
    dim = grad_out.shape[-1]
    terms = grad_out.reshape(-1, dim).double().cpu()
    rows, inverse, counts = torch.unique(ids.reshape(-1).long().cpu(), return_inverse=True, return_counts=True)
    exact = torch.zeros(rows.numel(), dim, dtype=torch.float64).index_add_(0, inverse, terms)
    abs_sum = torch.zeros(rows.numel(), dim, dtype=torch.float64).index_add_(0, inverse, terms.abs())
    grad = grad.coalesce()
    assert torch.equal(grad.indices()[0], rows), "the gradient's rows are not the looked-up ones"
    bound = (counts.unsqueeze(1).double() + 2) * UNIT * abs_sum
    worst = ((grad.values().double() - exact).abs() - bound).max().item()
    assert worst <= 0.0, f"gradient off by more than float32 rounding allows (excess {worst:.3g})"
    return grad.indices()[0], grad.values()


@pytest.mark.parametrize("ids_device", ID_DEVICES)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_bitwise_equal_to_torch(shape, dtype, ids_device):
    ref, ours = gpu_pair(50, 12)
    ids = torch.randint(0, 50, shape, dtype=dtype, device=ids_device)
    out = ours(ids)
    assert_kernel_path(ours)
    expected = F.embedding(ids.cuda(), ref.weight)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    assert out.shape == expected.shape == shape + (12,)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dim", [1, 13, 16, 128, 512])
def test_forward_all_row_widths_and_zipf(dim):
    # dim % 4 == 0: 16-byte loads; otherwise the scalar kernel.
    ref, ours = gpu_pair(5000, dim)
    ids = zipf_ids(5000, 20_000, generator=torch.Generator().manual_seed(dim)).cuda()
    out = ours(ids)
    assert_kernel_path(ours)
    assert torch.equal(out, F.embedding(ids, ref.weight))


def test_forward_non_contiguous_gpu_ids():
    ref, ours = gpu_pair(40, 8)
    ids = torch.randint(0, 40, (6, 9), device="cuda").t()
    assert not ids.is_contiguous()
    out = ours(ids)
    assert_kernel_path(ours)
    assert torch.equal(out, F.embedding(ids, ref.weight))


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
    assert_kernel_path(ours)
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
    assert_kernel_path(ours)
    assert out.dtype == torch.float32 and torch.equal(out, F.embedding(ids, ref.weight))
    assert ours.weight.grad.dtype == torch.float32
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_current_device_left_as_it_was():
    # The kernels' runtime shares the thread's current device with torch:
    # work on cuda:1, and freeing a table registered from cuda:1, must not
    # move later torch allocations to another GPU.
    from hostembed._core.table import table_of

    torch.cuda.set_device(0)
    try:
        emb = hostembed.Embedding(100, 8, device="cuda:1")
        opt = hostembed.SparseAdam(emb.parameters(), update="gpu")
        emb(torch.tensor([1, 2, 2], device="cuda:1")).sum().backward()
        opt.step()
        assert_kernel_path(emb, opt)
        assert torch.cuda.current_device() == 0
        torch.cuda.set_device(1)
        table = weakref.ref(table_of(emb.weight))
        del emb, opt
        gc.collect()
        assert table() is None, "the table was not freed: nothing was tested"
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
    assert_kernel_path(ours)
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
    assert_kernel_path(ours)
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
        assert_kernel_path(ours)
    assert all(torch.equal(g._values(), grads[0]._values()) for g in grads[1:])


@pytest.mark.parametrize("padding_idx", [0, 7, -1])
def test_padding_idx_gets_no_gradient(padding_idx):
    ref, ours = gpu_pair(20, 6, sparse=True, padding_idx=padding_idx)
    ids = torch.tensor([7, 0, 19, 7, 3, 0, 19]).cuda()
    grad_out = torch.randn(7, 6).cuda()
    out = ours(ids)
    assert_kernel_path(ours)
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
    assert_kernel_path(ours)
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
    assert_kernel_path(ours)
    assert not ours.weight.grad.is_sparse
    assert_grad_within_rounding(ours.weight.grad, ids, grad_out, 40)


def renorm_reference(weight, ids, max_norm, norm_type):
    """torch's CPU embedding_renorm_ in float64: each row in ids, once,
    scaled by max_norm / (norm + 1e-7) where its p-norm exceeds max_norm.
    Returns the table and the norms of the rows in ids (sorted, unique)."""
    table = weight.detach().double().clone()
    rows = ids.unique()
    values = table[rows]
    if math.isinf(norm_type):
        norms = values.abs().amax(dim=1)
    else:
        norms = values.abs().pow(norm_type).sum(dim=1).pow(1.0 / norm_type)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    table[rows] = values * scale.unsqueeze(1)
    return table, norms


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0, 0.5])
def test_max_norm_matches_cpu_path_and_torch(norm_type):
    # The references are torch's CPU embedding_renorm_ (row.norm(p): a true
    # p-norm) and the same in float64, not torch's CUDA embedding_renorm_:
    # its renorm_kernel (aten/src/ATen/native/cuda/Embedding.cu) sums
    # std::pow(x, norm_type) without abs() for any norm_type but 1 and 2.
    # For odd p the negative entries subtract (a negative sum then has no
    # real root), and for p = inf each term is 0 or inf and the root
    # pow(sum, 1/inf) = pow(sum, 0) is 1 whatever the sum: not a p-norm.
    # Measured on an H100 (2026-11-22): at p = 3 and inf it is up to 2.6
    # away from the CPU result, which hostembed's GPU and CPU paths match.
    max_norm, num_rows, dim = 1.5, 60, 16
    torch.manual_seed(3)
    ids = torch.randint(0, num_rows, (200,))
    torch.manual_seed(0)
    ours = hostembed.Embedding(num_rows, dim, max_norm=max_norm, norm_type=norm_type, device="cuda")
    torch.manual_seed(0)
    cpu_path = hostembed.Embedding(num_rows, dim, max_norm=max_norm, norm_type=norm_type)
    initial = ours.weight.detach().clone()
    assert torch.equal(initial, cpu_path.weight)
    exact, norms = renorm_reference(initial, ids, max_norm, norm_type)
    # No row within rounding of max_norm (float32 and float64 norms could
    # disagree on renorming it), and some rows to renorm.
    assert ((norms - max_norm).abs() > 1e-4 * max_norm).all()
    assert (norms > max_norm).any(), "no row needed a renorm: nothing was tested"
    torch_cpu = initial.clone()
    torch.embedding_renorm_(torch_cpu, ids, max_norm, norm_type)

    out = ours(ids.cuda())
    assert_kernel_path(ours)
    # The renorm kernel writes the table after the lookup returns: wait for
    # it before reading the table on the CPU.
    torch.cuda.synchronize()
    cpu_out = cpu_path(ids)
    assert cpu_path._last_lookup_path == "cpu"

    # hostembed: the norm in double rounded to float, the scale rounded to
    # float, one float multiply: three roundings of u each (+1 of slack).
    # torch's CPU renorm accumulates the norm in float: dim terms more.
    ours_bound = 4 * UNIT * exact.abs()
    torch_bound = (dim + 4) * UNIT * exact.abs()
    for name, table, bound in (("GPU path", ours.weight, ours_bound), ("CPU path", cpu_path.weight, ours_bound),
                               ("torch's CPU embedding_renorm_", torch_cpu, torch_bound)):
        excess = ((table.detach().double() - exact).abs() - bound).max().item()
        assert excess <= 0.0, f"{name}: off the float64 renorm by more than float32 rounding allows ({excess:.3g})"
    torch.testing.assert_close(ours.weight.detach(), torch_cpu, rtol=(dim + 8) * UNIT, atol=0)
    # Same arithmetic as the CPU core: equal but for the order of the double sum.
    torch.testing.assert_close(ours.weight.detach(), cpu_path.weight.detach(), rtol=5e-7, atol=0)
    # The output is the renormed rows.
    assert torch.equal(out, F.embedding(ids.cuda(), ours.weight.detach().cuda()))
    torch.testing.assert_close(out.cpu(), cpu_out, rtol=5e-7, atol=0)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[ids] = False
    assert untouched.any()
    assert torch.equal(ours.weight.detach()[untouched], initial[untouched])


def test_empty_batch():
    ref, ours = gpu_pair(10, 3, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters())
    opt = hostembed.SparseAdam(ours.parameters(), update="gpu")  # an update kernel over 0 rows
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    out = ours(empty)
    assert_kernel_path(ours)
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
    out = ours(ok)
    assert_kernel_path(ours)
    assert torch.equal(out, F.embedding(ok.cuda(), ours.weight.detach().cuda()))


def test_table_and_state_are_pinned_in_place_when_the_gpu_first_needs_them():
    # Registration is lazy: the first GPU lookup pins the table where it
    # is (registered, never copied), the first update="gpu" step pins the
    # Adam state.
    _, ours = gpu_pair(100, 8)
    address = ours.weight.data_ptr()
    assert not ours.weight.is_pinned(), "pinned at construction, not at the first GPU lookup"
    opt = hostembed.SparseAdam(ours.parameters(), update="gpu")
    out = ours(torch.tensor([1, 2], device="cuda"))
    assert_kernel_path(ours)
    assert ours.weight.data_ptr() == address
    out.sum().backward()
    opt.step()
    assert_kernel_path(ours, opt)
    state = opt.state[ours.weight]
    addresses = [ours.weight.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()]
    assert addresses[0] == address
    opt.zero_grad()
    ours(torch.tensor([2, 3], device="cuda")).sum().backward()
    opt.step()
    assert_kernel_path(ours, opt)
    state = opt.state[ours.weight]
    assert [ours.weight.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()] == addresses


def test_cpu_update_leaves_the_state_unpinned():
    _, ours = gpu_pair(100, 8)
    opt = hostembed.SparseAdam(ours.parameters(), update="cpu")
    out = ours(torch.tensor([1, 2, 2], device="cuda"))
    assert_kernel_path(ours)
    out.sum().backward()
    opt.step()
    assert opt._last_update == "cpu"
    state = opt.state[ours.weight]
    assert not state["exp_avg"].is_pinned() and not state["exp_avg_sq"].is_pinned()


def test_table_with_cpu_outputs_is_never_pinned():
    # On a GPU machine too: CPU outputs pin no page of the table or its
    # state, whatever the lookups and steps.
    emb = hostembed.Embedding(100, 8)
    opt = hostembed.SparseAdam(emb.parameters())  # "auto": there is no GPU gradient to time
    for _ in range(3):
        opt.zero_grad()
        emb(torch.tensor([1, 2, 2, 7])).sum().backward()
        opt.step()
        assert emb._last_lookup_path == "cpu" and opt._last_update == "cpu"
    state = opt.state[emb.weight]
    assert not emb.weight.is_pinned()
    assert not state["exp_avg"].is_pinned() and not state["exp_avg_sq"].is_pinned()


def test_outputs_moved_to_the_gpu_pin_the_table_at_the_first_gpu_lookup():
    # model.cuda() after construction, the usual way: the table is pinned
    # by its first GPU lookup, not by the move.
    torch.manual_seed(0)
    ours = hostembed.Embedding(30, 4)
    ids = torch.tensor([0, 29, 3, 3])
    cpu_out = ours(ids)
    ours.cuda()
    assert not ours.weight.is_pinned()
    gpu_out = ours(ids.cuda())
    assert_kernel_path(ours)
    assert torch.equal(gpu_out.cpu(), cpu_out)


def test_freeing_tables_unregisters_them():
    # Registered buffers are unregistered before munmap: many short-lived
    # 64 MiB tables in a row would fail (or crash) otherwise.
    from hostembed._core.table import table_of

    tables = []
    for _ in range(20):
        emb = hostembed.Embedding(1 << 18, 64, device="cuda")
        emb(torch.tensor([0, (1 << 18) - 1], device="cuda")).sum().backward()
        assert_kernel_path(emb)
        tables.append(weakref.ref(table_of(emb.weight)))
        del emb
    torch.cuda.synchronize()
    gc.collect()
    assert all(t() is None for t in tables), "a table was not freed: its unregistration was not tested"


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
    assert_kernel_path(ours, optimizers["ours"] if update == "gpu" else None)

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


@pytest.mark.parametrize("weight_decay", [0.0, 0.3], ids=["", "weight_decay"])
@pytest.mark.parametrize("dim", [16, 13])
def test_gpu_cpu_and_auto_updates_give_the_same_bits(dim, weight_decay):
    # Same gradients (GPU backward), same arithmetic in the same order; so
    # "auto" may time both modes on its first steps at no cost to the result.
    gen = torch.Generator().manual_seed(5)
    batches = [zipf_ids(1000, 4096, generator=gen) for _ in range(12)]
    grads = [torch.randn(4096, dim, generator=gen) for _ in range(12)]
    results = []
    for update in ("gpu", "cpu", "auto"):
        _, ours = gpu_pair(1000, dim)
        opt = hostembed.SparseAdam(ours.parameters(), lr=0.05, betas=(0.8, 0.99), update=update,
                                   weight_decay=weight_decay)
        modes = []
        for ids, g in zip(batches, grads):
            opt.zero_grad()
            out = ours(ids.cuda())
            assert_kernel_path(ours)
            out.backward(g.cuda())
            opt.step()
            modes.append(opt._last_update)
        if update == "auto":
            assert set(modes) == {"gpu", "cpu"}, f"'auto' did not try both modes: {modes}"
        else:
            assert set(modes) == {update}, modes
        if update == "gpu":
            assert_kernel_path(ours, opt)
        state = opt.state[ours.weight]
        results.append([ours.weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()])
    for gpu, cpu, auto in zip(*results):
        assert torch.equal(gpu, cpu) and torch.equal(auto, cpu)


@pytest.mark.parametrize("options", [{}, {"padding_idx": 3, "scale_grad_by_freq": True}], ids=["plain", "options"])
@pytest.mark.parametrize("update", ["gpu", "auto", "cpu"])
def test_fused_update_gives_the_unfused_bits(update, options):
    """SparseAdam(fused=True) with GPU outputs: the sums stay on the GPU
    and the kernel updates from them (update="cpu": copied to the host for
    the core); the same bits as the unfused GPU update, no weight.grad."""
    dim = 13
    gen = torch.Generator().manual_seed(6)
    batches = [zipf_ids(1000, 4096, generator=gen) for _ in range(12)]
    grads = [torch.randn(4096, dim, generator=gen) for _ in range(12)]
    results = []
    for fused in (False, True):
        _, ours = gpu_pair(1000, dim, **options)
        opt = hostembed.SparseAdam(ours.parameters(), lr=0.05, update="gpu" if not fused else update, fused=fused)
        for ids, g in zip(batches, grads):
            opt.zero_grad()
            out = ours(ids.cuda())
            assert_kernel_path(ours)
            out.backward(g.cuda())
            opt.step()
        if fused:
            assert ours.weight.grad is None
            assert opt._last_update == ("cpu" if update == "cpu" else "gpu")
            if update != "cpu":
                assert_kernel_path(ours, opt)
        state = opt.state[ours.weight]
        assert state["step"] == 12
        results.append([ours.weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()])
    for unfused, fused in zip(*results):
        assert torch.equal(unfused, fused)


def test_fused_table_looked_up_twice_on_the_gpu():
    results = []
    ids_a, ids_b = torch.tensor([1, 2, 2, 9], device="cuda"), torch.tensor([2, 3, 9], device="cuda")
    for fused in (False, True):
        _, ours = gpu_pair(50, 8)
        opt = hostembed.SparseAdam(ours.parameters(), lr=0.1, update="gpu", fused=fused)
        for _ in range(3):
            opt.zero_grad()
            (ours(ids_a).pow(2).sum() + ours(ids_b).sum()).backward()
            assert_kernel_path(ours)
            if fused:
                # Two lookups in one pass: one update of the summed gradient, by the CPU core.
                assert ours.weight.grad is None
            opt.step()
            if fused:
                assert opt._last_update == "cpu"
        state = opt.state[ours.weight]
        assert state["step"] == 3
        results.append(torch.stack([ours.weight.detach(), state["exp_avg"], state["exp_avg_sq"]]))
    assert torch.equal(*results)


def test_prefetch_with_gpu_outputs_says_it_is_not_implemented():
    _, ours = gpu_pair(50, 8)
    with pytest.raises(NotImplementedError, match="CPU outputs"):
        ours.prefetch(torch.tensor([1, 2]))


def test_next_forward_sees_the_gpu_update():
    _, ours = gpu_pair(100, 16)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.5, update="gpu")
    ids = torch.tensor([5, 6, 5, 99], device="cuda")
    for _ in range(3):
        before = ours.weight.detach().clone()
        out = ours(ids)
        assert_kernel_path(ours)
        assert torch.equal(out, F.embedding(ids, before.cuda()))
        out.pow(2).sum().backward()
        opt.step()
        assert_kernel_path(ours, opt)
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
        assert_kernel_path(emb)
        emb.weight.grad.mul_(0.25)
        o.step()
    assert opt._last_update == "cpu" and twin_opt._last_update == "cpu"
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
    assert_kernel_path(ours)
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=1e-6, atol=1e-7)


def test_torch_adamw_after_a_plain_swap_steps_a_table_with_gpu_outputs_like_torch():
    # A language model moved to the GPU keeps torch's AdamW over every
    # parameter: the host table's part is the core's dense pass, the
    # rest torch's on the GPU (benchmarks/clients/lm_step.py --device cuda).
    ref, ours = gpu_pair(500, 16)
    head = torch.nn.Linear(16, 3).cuda()
    ref_head = torch.nn.Linear(16, 3).cuda()
    ref_head.load_state_dict(head.state_dict())
    opt = torch.optim.AdamW([*ours.parameters(), *head.parameters()], lr=0.05)
    ref_opt = torch.optim.AdamW([*ref.parameters(), *ref_head.parameters()], lr=0.05)
    for _ in range(3):
        ids = torch.randint(0, 500, (64,), device="cuda")
        for emb, lin, o in ((ours, head, opt), (ref, ref_head, ref_opt)):
            o.zero_grad()
            lin(emb(ids)).square().mean().backward()
            # Row-sparse: AdamW's part for the table is the core's pass, not
            # torch's own step on a dense gradient (its fallback).
            assert emb is ref or emb.weight.grad.is_sparse
            o.step()
        assert_kernel_path(ours)
    # torch's dense step on the GPU and the core's on the CPU: float32
    # rounding apart, every row (those no batch touched decay too).
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight, ref_head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("update", ["gpu", "cpu"])
def test_work_on_a_side_stream(update):
    ref, ours = gpu_pair(300, 32, sparse=True)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1, update=update)
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
            assert opt._last_update == update
        out = ours(ids)
        expected = ref(ids)
    side.synchronize()
    assert_kernel_path(ours, opt if update == "gpu" else None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_cpu_outputs_after_gpu_lookups_see_the_same_table():
    _, ours = gpu_pair(30, 4)
    ids = torch.arange(30)
    gpu_out = ours(ids.cuda())
    assert_kernel_path(ours)
    ours.cpu()
    cpu_out = ours(ids)
    assert ours._last_lookup_path == "cpu"
    assert torch.equal(cpu_out, gpu_out.cpu())


# ---- tables of more than 2^31 elements
#
# Where 32-bit arithmetic breaks: an element index past 2^31 - 1 (signed
# int), a byte offset past 2^32. Each needs a table of ~8.7 GB, and an
# update="gpu" step pins both Adam moments, which backs every page of them:
# the table and its state are resident, 3 x 8.7 GB. Nowhere else does the
# suite make tables this size.

def mem_available_bytes():
    """MemAvailable of /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def big_table(num_rows, dim):
    """A (num_rows, dim) case, skipped where host memory has less than twice
    what it needs free (the table and both moments, all resident)."""
    need, available = 3 * num_rows * dim * 4, mem_available_bytes()
    reason = (f"a [{num_rows}, {dim}] table with its Adam state needs {need / 2**30:.1f} GiB of host memory; "
              f"MemAvailable is {available / 2**30:.1f} GiB, less than twice that")
    return pytest.param(num_rows, dim, marks=pytest.mark.skipif(available < 2 * need, reason=reason),
                        id=f"{num_rows}x{dim}")


class ZeroInitEmbedding(hostembed.Embedding):
    """A table left as allocated (zeros): nn.init.normal_ draws 2^31 floats
    on one core (~10 s); the test writes the rows it reads."""

    def reset_parameters(self):
        pass


def big_table_rows(num_rows, dim):
    """Blocks of rows: the first ones, those around element 2^30 (byte
    offset 2^32), those around element 2^31 (where a signed 32-bit element
    index overflows; byte offset 2^33), the last ones. Sorted, disjoint."""

    def around(element):
        row = element // dim  # the row holding that element (for dim | element, the row starting there)
        return torch.arange(row - 1, row + 2)

    return {"first": torch.arange(0, 3), "byte 2^32": around(2**30), "element 2^31": around(2**31),
            "last": torch.arange(num_rows - 3, num_rows)}


LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8


def adam_step_reference(w, m, v, g, step):
    """One SparseAdam step on rows (w, m, v, gradient g) in float64, and for
    each of w, m, v a bound on the error of any float32 evaluation of it:
    the constants and each operation rounded (u each), and the error of m
    carried into w through m / (sqrt(v) + eps)."""
    b1, b2 = BETAS
    w, m, v, g = (t.double() for t in (w, m, v, g))
    m1 = m + (1 - b1) * (g - m)
    v1 = v + (1 - b2) * (g * g - v)
    step_size = LR * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    denom = v1.sqrt() + EPS
    update = step_size * m1 / denom
    w1 = w - update
    bound_m = 4 * UNIT * (m.abs() + g.abs())
    bound_v = 4 * UNIT * (v + g * g)
    bound_w = 2 * UNIT * w1.abs() + 8 * UNIT * update.abs() + step_size * bound_m / denom
    return (w1, m1, v1), (bound_w, bound_m, bound_v)


def torch_sparse_adam_rows(w, m, v, g, step):
    """torch.optim.SparseAdam's float32 step on a copy of the rows, from the
    given state."""
    param = torch.nn.Parameter(w.clone())
    opt = torch.optim.SparseAdam([param], lr=LR, betas=BETAS, eps=EPS)
    if step > 1:
        opt.state[param] = {"step": step - 1, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    param.grad = torch.sparse_coo_tensor(torch.arange(w.shape[0]).unsqueeze(0), g.clone(), w.shape,
                                         check_invariants=True)
    opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("num_rows, dim", [big_table(17_000_000, 128), big_table(127_000_000, 17)])
def test_big_table_rows_past_2_31_elements(num_rows, dim):
    """[17M, 128] (8.7 GB, 16-byte loads) and [127M, 17] (8.6 GB, scalar
    loads, rows not 16-byte aligned): GPU lookups bit for bit against CPU
    reads of the table, then update="gpu" Adam steps against float64 Adam,
    on the rows where 32-bit offsets would overflow."""
    assert num_rows * dim > 2**31
    groups = big_table_rows(num_rows, dim)
    rows = torch.cat(list(groups.values()))
    assert torch.equal(rows, rows.unique()), "the row blocks must be sorted and disjoint"
    edges = torch.cat([torch.stack([block[0] - 1, block[-1] + 1]) for block in groups.values()])
    neighbours = edges[(edges >= 0) & (edges < num_rows) & ~torch.isin(edges, rows)]
    gen = torch.Generator().manual_seed(dim)
    emb = opt = state = None
    try:
        emb = ZeroInitEmbedding(num_rows, dim, device="cuda")
        with torch.no_grad():
            emb.weight[rows] = torch.randn(rows.numel(), dim, generator=gen)

        for name, block in groups.items():
            for dtype in ID_DTYPES:
                out = emb(block.to(dtype).cuda())
                assert_kernel_path(emb)
                assert torch.equal(out.cpu(), emb.weight.detach()[block]), f"the {name} rows, {dtype} ids"

        opt = hostembed.SparseAdam(emb.parameters(), lr=LR, betas=BETAS, eps=EPS, update="gpu")
        # Step 1 creates (and pins) the moments; step 2 reads them back at
        # the far offsets.
        for step, step_rows in enumerate((rows, torch.cat([groups["element 2^31"], groups["last"]])), start=1):
            # Each row 3 times, shuffled: the GPU reduce sums them.
            ids = step_rows.repeat(3)[torch.randperm(3 * step_rows.numel(), generator=gen)]
            grad_out = torch.randn(ids.numel(), dim, generator=gen)
            state = opt.state.get(emb.weight)
            w0 = emb.weight.detach()[step_rows]
            m0 = state["exp_avg"][step_rows] if state else torch.zeros_like(w0)
            v0 = state["exp_avg_sq"][step_rows] if state else torch.zeros_like(w0)
            opt.zero_grad()
            out = emb(ids.cuda())
            assert_kernel_path(emb)
            assert torch.equal(out.cpu(), emb.weight.detach()[ids]), f"step {step}: lookup"
            out.backward(grad_out.cuda())
            grad_rows, g = assert_row_grads_within_rounding(emb.weight.grad, ids, grad_out)
            assert torch.equal(grad_rows, step_rows)
            opt.step()
            assert_kernel_path(emb, opt)
            state = opt.state[emb.weight]
            assert state["step"] == step
            got = (emb.weight.detach()[step_rows], state["exp_avg"][step_rows], state["exp_avg_sq"][step_rows])
            expected, bounds = adam_step_reference(w0, m0, v0, g, step)
            by_torch = torch_sparse_adam_rows(w0, m0, v0, g, step)
            for key, ours_v, torch_v, exact, bound in zip(("weight", "exp_avg", "exp_avg_sq"), got, by_torch,
                                                          expected, bounds):
                for who, value in (("hostembed", ours_v), ("torch's SparseAdam", torch_v)):
                    excess = ((value.double() - exact).abs() - bound).max().item()
                    assert excess <= 0.0, (f"step {step}, {key} of {who}: off float64 Adam by more than float32 "
                                           f"rounding allows (excess {excess:.3g})")

        # Nothing beside the rows was written: the table there is still the
        # zeros it was allocated with, and so is the state.
        for key, values in (("weight", emb.weight.detach()[neighbours]), ("exp_avg", state["exp_avg"][neighbours]),
                            ("exp_avg_sq", state["exp_avg_sq"][neighbours])):
            assert not values.any(), f"{key}: a row next to the ones looked up or updated changed"
        # The next lookup sees the update.
        out = emb(rows.cuda())
        assert_kernel_path(emb)
        assert torch.equal(out.cpu(), emb.weight.detach()[rows])
    finally:
        # A failure's traceback keeps this frame and its locals: free the
        # ~26 GB now, not when pytest lets go of the report.
        emb = opt = state = out = None
        gc.collect()


def test_compile_fullgraph_on_the_gpu_path_matches_eager():
    # torch.compile traces the GPU lookup and its backward as custom ops.
    def kernels_ran(eager, compiled):
        assert_kernel_path(eager)
        assert compiled.weight.is_pinned()

    compile_matches_eager("cuda", kernels_ran)


def test_table_changed_between_forward_and_backward_like_torch():
    # torch's nn.Embedding saves only the ids: a change of the weight in
    # place before backward (another optimizer's step) is allowed.
    ref, ours = gpu_pair(40, 6)
    ids = torch.tensor([3, 5, 3], device="cuda")
    outs = [m(ids) for m in (ref, ours)]
    assert_kernel_path(ours)
    with torch.no_grad():
        ref.weight[7].fill_(1.0)
        ours.weight[7].fill_(1.0)
    for out in outs:
        (out * 2).sum().backward()
    assert torch.equal(ours.weight.grad.to_dense().cuda(), ref.weight.grad.to_dense())


def test_gpu_output_can_be_changed_in_place():
    ref, ours = gpu_pair(40, 6)
    ids = torch.tensor([[1, 2], [2, 39]], device="cuda")
    pos = torch.randn(2, 6, device="cuda")
    outs = []
    for model in (ref, ours):
        x = model(ids)
        x += pos
        x.sum().backward()
        outs.append(x)
    assert_kernel_path(ours)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(ours.weight.grad.to_dense().cuda(), ref.weight.grad.to_dense())


@pytest.mark.parametrize("make", [lambda p, f: hostembed.SGD(p, lr=0.2, fused=f),
                                  lambda p, f: hostembed.Adagrad(p, lr=0.1, fused=f),
                                  lambda p, f: hostembed.RowWiseAdagrad(p, lr=0.1, fused=f)],
                         ids=["SGD", "Adagrad", "RowWiseAdagrad"])
def test_fused_optimizers_with_gpu_outputs_give_the_unfused_bits(make):
    # These optimizers update GPU-output tables on the CPU: fused, the sums
    # reduced on the GPU in backward come to the host for the update.
    torch.manual_seed(0)
    plain = hostembed.Embedding(300, 16, device="cuda")
    fused = hostembed.Embedding.from_pretrained(plain.weight.detach(), freeze=False).cuda()
    opts = {plain: make(plain.parameters(), False), fused: make(fused.parameters(), True)}
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = zipf_ids(300, 200, generator=gen).cuda()
        for emb, opt in opts.items():
            opt.zero_grad()
            emb(ids).sin().sum().backward()
            assert_kernel_path(emb)
            opt.step()
    assert fused.weight.grad is None
    assert torch.equal(fused.weight, plain.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("ids_device", ID_DEVICES)
def test_tables_of_other_dtypes_with_gpu_outputs_go_through_the_cpu_core(dtype, ids_device):
    # The kernels read float32 tables; other dtypes are looked up and
    # updated by the CPU core, their outputs copied to the GPU, and train
    # bit for bit as the same table with CPU outputs.
    torch.manual_seed(0)
    gpu = hostembed.Embedding(1000, 16, dtype=dtype, device="cuda")
    cpu = hostembed.Embedding.from_pretrained(gpu.weight.detach(), freeze=False)
    opt_g, opt_c = hostembed.SparseAdam(gpu.parameters(), lr=0.01), hostembed.SparseAdam(cpu.parameters(), lr=0.01)
    for step in range(3):
        ids = zipf_ids(1000, 500, generator=torch.Generator().manual_seed(step))
        out_g, out_c = gpu(ids.to(ids_device)), cpu(ids)
        assert out_g.device.type == "cuda" and out_g.dtype == dtype and gpu._last_lookup_path == "cpu"
        assert torch.equal(out_g.cpu(), out_c)
        out_g.float().square().sum().backward()
        out_c.float().square().sum().backward()
        opt_g.step()
        opt_c.step()
        opt_g.zero_grad()
        opt_c.zero_grad()
        assert opt_g._last_update == "cpu"
    assert torch.equal(gpu.weight.view(-1), cpu.weight.view(-1))
