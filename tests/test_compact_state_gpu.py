"""Compact optimizer state with GPU outputs: the lookup runs on the GPU
kernels, the update on the CPU core (the GPU update kernel keeps float32
state), and training matches the same form with CPU outputs; a GPU row
cache keeps bfloat16 and 8-bit moments in its records (a row-wise second
moment moves them to host memory)."""
import pytest
import torch

import hostembed
from hostembed._core import cuda as _cuda
from conftest import zipf_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
]

FORMS = {
    "int8": dict(state_dtype=torch.int8),
    "bf16": dict(state_dtype=torch.bfloat16),
    "int8_rowwise": dict(state_dtype=torch.int8, rowwise_exp_avg_sq=True),
}


def _train(device, form, fused, steps=5, **module_kwargs):
    torch.manual_seed(0)
    emb = hostembed.Embedding(500, 64, device=device, **module_kwargs)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-2, fused=fused, **FORMS[form])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = zipf_ids(500, 256, generator=gen).to(device)
        loss = (emb(ids) - 0.5).pow(2).sum() / 256
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device == "cuda" and not module_kwargs:
            assert emb._last_lookup_path == "gpu", "the lookup did not run the GPU kernels"
            assert opt._last_update == "cpu", "a compact state updates on the CPU"
    return emb, opt


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_outputs_train_compact_state_as_cpu_outputs(form, fused):
    gpu, gpu_opt = _train("cuda", form, fused)
    cpu, cpu_opt = _train("cpu", form, fused)
    torch.cuda.synchronize()
    state = gpu_opt.state[gpu.weight]
    assert state["exp_avg"].dtype == cpu_opt.state[cpu.weight]["exp_avg"].dtype
    # The GPU sums a row's gradients in another order than the CPU: a code
    # may round the other way, so the weights agree to a small fraction of
    # the distance they moved, not bit for bit.
    torch.manual_seed(0)  # seed 0's table, as both started
    start = hostembed.Embedding(500, 64).weight.detach()
    path = (cpu.weight.detach() - start).abs().max()
    assert (gpu.weight.detach() - cpu.weight.detach()).abs().max() <= 0.05 * path


def test_a_gpu_row_cache_moves_a_rowwise_second_moment_to_host_records():
    with pytest.warns(UserWarning, match="compact optimizer state"):
        cached, cached_opt = _train("cuda", "int8_rowwise", False, cache_rows=100)
    plain, _ = _train("cuda", "int8_rowwise", False)
    assert type(cached._table.cache).__name__ == "RowCache"
    assert torch.equal(cached.weight.detach(), plain.weight.detach())


@pytest.mark.parametrize("form", ["int8", "bf16"])
def test_a_gpu_row_cache_keeps_compact_moments_in_gpu_records(form):
    cached, cached_opt = _train("cuda", form, True, cache_rows=100)
    plain, plain_opt = _train("cuda", form, True)
    assert cached._table.cache.cached["exp_avg"].is_cuda
    assert torch.equal(cached.weight.detach(), plain.weight.detach())
    for key, value in plain_opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(cached_opt.state_dict()["state"][0][key]), torch.as_tensor(value)), key
