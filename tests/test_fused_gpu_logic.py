"""The GPU path's fused update, its logic run on the CPU: the real GPU
lookup backward (_core/ops/gpu.py's _gpu_lookup_backward), _core/fused.py and
SparseAdam._fused_update, with the CUDA pieces (dedup, reduce, events,
the Adam kernel) replaced by CPU stand-ins. What the kernels compute is
tested in test_gpu.py on a GPU; this checks, in CI, which branch runs and
that the fused update gets the same bits as the unfused one."""
import pytest
import torch

import hostembed
from hostembed import optim
from hostembed._core import fused as _fused, table as _table
from hostembed._core.ops import common as common_ops, gpu as gpu_ops, update as update_ops
from hostembed.nn.lookup import gpu as _lookup_gpu

N, D = 100, 8


def reduce_on_cpu(table, grad, unique, offsets, order, inverse, info, scale_grad_by_freq):
    """What cuda_grad_reduce computes: (indices, sums) per unique id in
    position order, padding_idx's slot left out."""
    rows = grad.reshape(-1, table.dim)
    num_unique, padding_slot = info.tolist()
    sums = torch.zeros(num_unique, table.dim)
    counts = torch.bincount(inverse, minlength=num_unique)
    seen = set()
    for pos in range(rows.shape[0]):
        k = int(inverse[pos])
        term = rows[pos] * (1.0 / float(counts[k])) if scale_grad_by_freq else rows[pos]
        sums[k] = sums[k] + term if k in seen else term  # the first row copied, as the kernel does
        seen.add(k)
    keep = torch.arange(num_unique) != padding_slot
    return unique[keep].clone(), sums[keep].clone()


class FakeEvent:
    def record(self, stream=None):
        pass


@pytest.fixture
def gpu_on_cpu(monkeypatch):
    calls = []

    def lookup_on_cpu(weight, table_handle, ids, device, padding_idx, max_norm, norm_type, scale, sparse):
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        hit = (unique == padding_idx).nonzero()
        padding_slot = int(hit[0]) if padding_idx >= 0 and hit.numel() else -1
        out = weight.detach()[flat].reshape(*ids.shape, weight.shape[1]).clone()
        unused = torch.zeros(0)
        return out, unique, unused, unused, inverse, torch.tensor([unique.numel(), padding_slot])

    def reduce(*args):
        calls.append("reduce")
        return reduce_on_cpu(*args)

    def grad_reduce(handle, grad, *rest):
        return reduce(_table.table_by_handle(handle, "a test"), grad, *rest)

    def gpu_adam(*args, **hyper):
        calls.append("gpu_adam")
        return update_ops.adam_update(*args, **hyper)

    eager = common_ops.eager_autograd(lookup_on_cpu, gpu_ops._gpu_lookup_setup,
                                     gpu_ops._gpu_lookup_backward(grad_reduce, True))

    def lookup(module, ids, scale_grad_by_freq=None):
        padding = -1 if module.padding_idx is None else module.padding_idx
        scale = module.scale_grad_by_freq if scale_grad_by_freq is None else scale_grad_by_freq
        return eager.apply(module.weight, module._table.handle, ids, None, padding, None, 2.0, scale,
                           module.sparse)[0]

    monkeypatch.setattr(gpu_ops, "gpu_reduce", reduce)
    monkeypatch.setattr(gpu_ops, "gpu_adam_update", gpu_adam)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(_fused.GpuGradient, "wait", lambda self: (self.indices, self.values))
    monkeypatch.setattr(optim.SparseAdam, "_gpu_ready", staticmethod(lambda *args: True))
    monkeypatch.setattr(_lookup_gpu, "lookup", lookup)
    return lookup, calls


def run(lookup, fused, update, twice, scale):
    torch.manual_seed(0)
    emb = hostembed.Embedding(N, D, scale_grad_by_freq=scale, padding_idx=3)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1, update=update, fused=fused)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        opt.zero_grad()
        ids = torch.randint(0, N, (64,), generator=gen)
        ids[:5] = 3
        if twice:
            loss = lookup(emb, ids).pow(2).sum() + lookup(emb, ids[:20]).sum()
        else:
            loss = (lookup(emb, ids) * torch.randn(64, D, generator=gen)).sum()
        loss.backward()
        assert (emb.weight.grad is None) == fused
        opt.step()
    state = opt.state[emb.weight]
    assert state["step"] == 5
    return torch.stack([emb.weight.detach(), state["exp_avg"], state["exp_avg_sq"]]), opt._last_update


@pytest.mark.parametrize("scale", [False, True], ids=["plain", "scale_grad_by_freq"])
@pytest.mark.parametrize("twice", [False, True], ids=["one_lookup", "two_lookups"])
@pytest.mark.parametrize("update", ["gpu", "auto", "cpu"])
def test_fused_gpu_branches_give_the_unfused_bits(gpu_on_cpu, update, twice, scale):
    lookup, calls = gpu_on_cpu
    unfused, _ = run(lookup, False, "cpu", twice, scale)
    calls.clear()
    fused, last = run(lookup, True, update, twice, scale)
    assert torch.equal(unfused, fused)
    # One lookup: reduced in backward, then the GPU kernel ("gpu", "auto")
    # or the CPU core from a host copy ("cpu"). Two: one CPU update of the
    # concatenated sums, as unfused.
    want = "cpu" if twice or update == "cpu" else "gpu"
    assert last == want
    assert ("gpu_adam" in calls) == (want == "gpu") and "reduce" in calls
