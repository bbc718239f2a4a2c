"""hostembed.distributed with outputs on the GPU: ranks spawned as in
test_distributed.py, each with its outputs on the GPU, the traffic on a
gloo group (two ranks on one GPU) or an NCCL group (one rank: NCCL takes
one GPU a rank). Training equals one process training a plain table on
the ranks' batches together; a shared table's lookups ran the GPU kernels
on its shared rows. Run with `pytest -m gpu`."""
import pytest
import torch
import torch.distributed as dist

import hostembed
from hostembed._core import cuda as _cuda
from distributed_workers import STEPS, batch, initial_table
from test_distributed import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(not hostembed.cuda_available(), reason=f"GPU path unavailable: {_cuda.unavailable_reason()}"),
]


def reference(world, kind):
    """One process, a plain table on the CPU, SparseAdam, each step on every
    rank's batch together."""
    if kind == "bags":
        emb = hostembed.EmbeddingBag.from_pretrained(initial_table(), freeze=False, mode="sum")
    else:
        emb = hostembed.Embedding.from_pretrained(initial_table(), freeze=False)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.01)
    for step in range(STEPS):
        pairs = [batch(step, rank) for rank in range(world)]
        ids = torch.cat([i for i, _ in pairs])
        target = torch.cat([t.sum(1) if kind == "bags" else t for _, t in pairs])
        (emb(ids) - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb.weight.detach(), opt.state[emb.weight]["exp_avg"]


@pytest.mark.parametrize("world, backend", [
    (2, "gloo"),
    pytest.param(1, "nccl", marks=pytest.mark.skipif(not dist.is_nccl_available(), reason="NCCL is not available"))])
@pytest.mark.parametrize("kind", ["sharded", "shared", "bags"])
def test_outputs_on_the_gpu_train_like_one_table(tmp_path, world, backend, kind):
    results = run_ranks(world, "on_device", tmp_path, kind, backend)
    weight, exp_avg = reference(world, kind)
    for r in results:
        assert r["devices"] == ["cuda:0"], r["devices"]
        if kind == "shared":
            assert r["path"] == "gpu", f"the shared table's lookups took the {r['path']!r} path, not the GPU kernels"
        start, end = r["range"]
        torch.testing.assert_close(r["weight"], weight[start:end], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["exp_avg"], exp_avg[start:end], rtol=1e-5, atol=1e-6)
    assert not torch.equal(weight, initial_table())
