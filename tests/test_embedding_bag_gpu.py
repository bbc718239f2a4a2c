"""hostembed.EmbeddingBag with GPU outputs against torch.nn.EmbeddingBag on
the GPU. Skipped with the reason where the GPU path cannot run; each test
asserts the lookup ran the GPU kernels (test_gpu.assert_kernel_path), so a
CPU fallback cannot pass it."""
import pytest
import torch
from torch import nn

import hostembed
from hostembed._core import cuda as _cuda
from conftest import zipf_ids
from test_gpu import assert_kernel_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
    pytest.mark.filterwarnings("error::RuntimeWarning"),
]

NUM_ROWS, DIM = 500, 24


def gpu_bag_pair(mode, **kwargs):
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(NUM_ROWS, DIM, mode=mode, **kwargs).cuda()
    torch.manual_seed(0)
    ours = hostembed.EmbeddingBag(NUM_ROWS, DIM, mode=mode, device="cuda", **kwargs)
    return ref, ours


def batch(ids_device, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = zipf_ids(NUM_ROWS, 300, generator=gen)
    ids[::11] = 3  # the padding id
    offsets = torch.tensor([0, 0, 40, 41, 41, 200, 300])
    weights = torch.randn(300, generator=gen).cuda() if weighted else None
    return ids.to(ids_device), offsets.to(ids_device), weights


@pytest.mark.parametrize("ids_device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
def test_matches_torch_on_the_gpu(mode, weighted, ids_device):
    ref, ours = gpu_bag_pair(mode, padding_idx=3, include_last_offset=True)
    ids, offsets, weights = batch(ids_device, weighted)
    out_ref = ref(ids.cuda(), offsets.cuda(), per_sample_weights=weights)
    out = ours(ids, offsets, per_sample_weights=weights)
    assert_kernel_path(ours)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    grad_out = torch.linspace(-1, 1, out.numel(), device="cuda").view(out.shape)
    out_ref.backward(grad_out)
    out.backward(grad_out)
    assert ours.weight.grad.is_sparse
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,options", [("sum", {"update": "gpu"}), ("sum", {"update": "cpu"}),
                                          ("mean", {"fused": True})], ids=["gpu-update", "cpu-update", "fused"])
def test_trains_like_torch_with_sparse_adam(mode, options):
    ref, ours = gpu_bag_pair(mode, sparse=True)
    opt_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.05, **options)
    for step in range(10):
        ids, offsets, weights = batch("cuda", mode == "sum", seed=step)
        for module, optimizer in ((ref, opt_ref), (ours, opt)):
            optimizer.zero_grad()
            module(ids, offsets, per_sample_weights=weights).sin().sum().backward()
            optimizer.step()
        assert_kernel_path(ours, opt if options.get("update") == "gpu" else None)
        # Fused with GPU outputs, the update runs on the GPU too (no copy of
        # the gradient to the host).
        assert opt._last_update == ("cpu" if options.get("update") == "cpu" else "gpu")
    if options.get("fused"):
        assert ours.weight.grad is None
    torch.testing.assert_close(ours.weight, ref.weight.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_int32_2d_input_scale_grad_by_freq_and_max_norm_on_the_gpu(mode):
    # 2-D CUDA int32 input (int32 unique ids and offsets), the frequency
    # hook on the GPU, and max_norm renorming the rows in place.
    ref, ours = gpu_bag_pair(mode, scale_grad_by_freq=True, max_norm=1.0, padding_idx=3)
    gen = torch.Generator().manual_seed(2)
    ids = zipf_ids(NUM_ROWS, 240, generator=gen).view(30, 8).to(torch.int32)
    ids[::4, 0] = 3
    out_ref = ref(ids.cuda())
    out = ours(ids.cuda())
    assert_kernel_path(ours)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=0, atol=1e-6)
    grad_out = torch.linspace(-1, 1, out.numel(), device="cuda").view(out.shape)
    out_ref.backward(grad_out)
    out.backward(grad_out)
    # torch's CUDA kernel divides by each id's own count, as hostembed does.
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_through_a_gpu_row_cache_give_the_uncached_bits(mode):
    torch.manual_seed(0)
    plain = hostembed.EmbeddingBag(NUM_ROWS, DIM, mode=mode, device="cuda", padding_idx=3)
    torch.manual_seed(0)
    cached = hostembed.EmbeddingBag(NUM_ROWS, DIM, mode=mode, device="cuda", padding_idx=3, cache_rows=64)
    assert type(cached._table.cache).__name__ == "GpuRowCache"
    opts = [hostembed.SparseAdam(m.parameters(), lr=0.01) for m in (plain, cached)]
    for step in range(6):
        ids, offsets, _ = batch("cuda", False, seed=step)
        for emb, opt in zip((plain, cached), opts):
            out = emb(ids, offsets)
            opt.zero_grad()
            (out - 0.25).pow(2).sum().backward()
            opt.step()
    assert cached._last_lookup_path == "cache" and cached.cache_stats["fetches"] > 0
    assert torch.equal(cached.weight, plain.weight)
