"""SparseAdam(fused=True): the update applied in backward, against the
unfused drop-in path (which test_sparse_adam.py checks against torch).
Same operations in the same order, so the weights, moments and steps must
be the same bits (a table looked up more than once in a pass: to float32
rounding). GPU outputs: test_gpu.py."""
import subprocess
import sys

import pytest
import torch

import hostembed
from hostembed._core.ops import cpu as cpu_ops
from conftest import zipf_ids

N, D = 500, 24


def twins(fused_kwargs=None, **emb_kwargs):
    """(unfused emb, opt), (fused emb, opt) from the same table."""
    torch.manual_seed(0)
    a = hostembed.Embedding(N, D, **emb_kwargs)
    torch.manual_seed(0)
    b = hostembed.Embedding(N, D, **emb_kwargs)
    assert torch.equal(a.weight, b.weight)
    return ((a, hostembed.SparseAdam(a.parameters(), lr=0.01)),
            (b, hostembed.SparseAdam(b.parameters(), lr=0.01, fused=True, **(fused_kwargs or {}))))


def step(emb, opt, loss_fn):
    opt.zero_grad()
    loss_fn(emb).backward()
    opt.step()


def assert_same_state(unfused, fused):
    (a, oa), (b, ob) = unfused, fused
    assert torch.equal(a.weight, b.weight)
    sa, sb = oa.state[a.weight], ob.state[b.weight]
    assert sa["step"] == sb["step"]
    assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


@pytest.mark.parametrize("emb_kwargs", [{}, {"padding_idx": 3}, {"scale_grad_by_freq": True},
                                        {"max_norm": 1.0}, {"max_norm": 1.5, "padding_idx": 0,
                                                            "scale_grad_by_freq": True}],
                         ids=["plain", "padding", "scale_freq", "max_norm", "all"])
def test_fifty_zipf_steps_same_bits_as_unfused(emb_kwargs, threads):
    unfused, fused = twins(**emb_kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        ids = zipf_ids(N, 96, generator=gen).view(8, 12)
        ids[0, 0] = 3
        grad = torch.randn(8, 12, D, generator=gen)
        for emb, opt in (unfused, fused):
            step(emb, opt, lambda e: (e(ids) * grad).sum())
    assert fused[0].weight.grad is None, "a fused table must not build weight.grad"
    assert_same_state(unfused, fused)
    assert fused[1].state[fused[0].weight]["step"] == 50


@pytest.mark.parametrize("core_only", [False, True])
def test_table_looked_up_twice_in_one_forward_gets_one_update(monkeypatch, core_only):
    # One update of every lookup's rows. Equal to unfused to float32
    # rounding only: unfused, autograd adds the lookups' row-sparse
    # gradients by torch's sparse add (a merge that sums some repeated
    # rows on the way), fused sums each row's positions in order.
    if core_only:
        monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)
    unfused, fused = twins()
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        first, second = zipf_ids(N, 50, generator=gen), zipf_ids(N, 40, generator=gen)
        for emb, opt in (unfused, fused):
            step(emb, opt, lambda e: (e(first).sum(1) * e(second)[:1].sum()).sum() + e(second).pow(2).sum())
    (a, oa), (b, ob) = unfused, fused
    torch.testing.assert_close(b.weight, a.weight, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ob.state[b.weight][key], oa.state[a.weight][key], rtol=1e-5, atol=1e-7)
    assert ob.state[b.weight]["step"] == 10


def test_gradient_accumulation_is_refused_and_changes_nothing():
    _, (emb, opt) = twins()
    ids = torch.tensor([1, 2, 2, 7])
    emb(ids).sum().backward()
    after_first = emb.weight.detach().clone()
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[emb.weight].items()}
    with pytest.raises(RuntimeError, match="gradient accumulation.*fused"):
        emb(ids).sum().backward()
    assert torch.equal(emb.weight, after_first)
    assert opt.state[emb.weight]["step"] == state["step"] == 1
    assert torch.equal(opt.state[emb.weight]["exp_avg"], state["exp_avg"])
    opt.step()
    emb(ids).sum().backward()  # step() ended the step: the next backward updates
    assert opt.state[emb.weight]["step"] == 2
    assert not torch.equal(emb.weight, after_first)


def test_a_backward_pass_that_fails_applies_nothing_and_blocks_nothing():
    unfused, fused = twins()
    ids = torch.tensor([4, 5, 6])

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    emb, opt = fused
    before = emb.weight.detach().clone()
    # The lookup's backward runs (and hands its gradient over) before Boom's.
    with pytest.raises(ValueError, match="boom"):
        (emb(ids).sum() + Boom.apply(emb(ids)).sum()).backward()
    assert torch.equal(emb.weight, before) and not opt.state
    for emb, opt in (unfused, fused):
        step(emb, opt, lambda e: e(ids).pow(2).sum())
    assert_same_state(unfused, fused)


def test_other_parameters_step_as_usual_and_state_dicts_match():
    (a, oa), (b, ob) = twins()
    torch.manual_seed(5)
    dense_a = torch.nn.Embedding(20, 4, sparse=True)
    dense_b = torch.nn.Embedding(20, 4, sparse=True)
    dense_b.load_state_dict(dense_a.state_dict())
    oa.add_param_group({"params": dense_a.parameters()})
    ob.add_param_group({"params": dense_b.parameters()})
    ids = torch.tensor([[1, 2], [3, 3]])
    for _ in range(3):
        for emb, dense, opt in ((a, dense_a, oa), (b, dense_b, ob)):
            step(emb, opt, lambda e: (e(ids).sum(-1) * dense(ids).sum(-1)).pow(2).sum())
    assert torch.equal(dense_a.weight, dense_b.weight) and dense_b.weight.grad is not None
    assert_same_state((a, oa), (b, ob))
    sa, sb = oa.state_dict(), ob.state_dict()
    # The same groups but for the keyword that tells them apart.
    assert [dict(g, fused=None) for g in sa["param_groups"]] == [dict(g, fused=None) for g in sb["param_groups"]]
    assert {g["fused"] for g in sa["param_groups"]} != {g["fused"] for g in sb["param_groups"]}
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, value in sa["state"][k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][k][key])), (k, key)

    # The fused run's state dict resumes as an unfused run: the next step
    # is the same bits either way.
    resumed = hostembed.Embedding(N, D)
    resumed.load_state_dict(b.state_dict())
    resumed_dense = torch.nn.Embedding(20, 4, sparse=True)
    resumed_dense.load_state_dict(dense_b.state_dict())
    ro = hostembed.SparseAdam([{"params": resumed.parameters()}, {"params": resumed_dense.parameters()}], lr=0.01)
    ro.load_state_dict(sb)
    for emb, dense, opt in ((b, dense_b, ob), (resumed, resumed_dense, ro)):
        step(emb, opt, lambda e: (e(ids).sum(-1) * dense(ids).sum(-1)).pow(2).sum())
    assert_same_state((resumed, ro), (b, ob))


def test_a_table_has_one_fused_optimizer():
    emb = hostembed.Embedding(10, 4)
    first = hostembed.SparseAdam(emb.parameters(), fused=True)
    with pytest.raises(ValueError, match="already updated in backward"):
        hostembed.SparseAdam(emb.parameters(), fused=True)
    other = hostembed.Embedding(10, 4)
    with pytest.raises(ValueError, match="already updated in backward"):
        hostembed.SparseAdam(other.parameters(), fused=True).add_param_group({"params": emb.parameters()})
    assert len(first.param_groups) == 1
    with pytest.raises(TypeError, match="fused must be a bool"):
        hostembed.SparseAdam(other.parameters(), fused=1)
    # An unfused optimizer of the same table is allowed (it sees no gradient).
    hostembed.SparseAdam(emb.parameters())


def test_a_dropped_fused_optimizer_gives_the_table_its_gradient_back():
    emb = hostembed.Embedding(10, 4)
    opt = hostembed.SparseAdam(emb.parameters(), fused=True)
    del opt
    emb(torch.tensor([1, 1, 2])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse


def test_out_of_range_id_raises_in_forward_and_writes_nothing():
    _, (emb, opt) = twins()
    before = emb.weight.detach().clone()
    with pytest.raises(IndexError, match="not in"):
        emb(torch.tensor([1, N]))
    assert torch.equal(emb.weight, before) and not opt.state and emb._table.fused_pending is None


def test_frozen_table_is_not_updated():
    _, (emb, opt) = twins()
    emb.weight.requires_grad_(False)
    head = torch.nn.Parameter(torch.ones(D))
    before = emb.weight.detach().clone()
    (emb(torch.tensor([1, 2])) * head).sum().backward()
    opt.step()
    assert torch.equal(emb.weight, before) and not opt.state


def test_clip_grad_norm_refuses_a_fused_table():
    _, (emb, opt) = twins()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="no gradient to clip"):
        hostembed.clip_grad_norm_(emb.parameters(), 1.0)


def test_compiled_model_with_a_fused_table_trains_like_eager():
    """A fused table's lookup runs eagerly inside a compiled function (a
    graph break: its backward queues the update with autograd's engine)."""
    torch._dynamo.reset()
    unfused, fused = twins()
    torch.manual_seed(1)
    head = torch.nn.Linear(D, 1).requires_grad_(False)

    def loss_of(emb, ids):
        return head(emb(ids)).pow(2).mean()

    compiled = torch.compile(loss_of)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        ids = zipf_ids(N, 32, generator=gen)
        losses = []
        for (emb, opt), fn in ((unfused, loss_of), (fused, compiled)):
            opt.zero_grad()
            loss = fn(emb, ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        # Inductor may round the head's arithmetic differently from eager.
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    (a, oa), (b, ob) = unfused, fused
    assert b.weight.grad is None and ob.state[b.weight]["step"] == 5
    torch.testing.assert_close(b.weight, a.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ob.state[b.weight]["exp_avg"], oa.state[a.weight]["exp_avg"], rtol=1e-4, atol=1e-9)


def test_fused_under_torch_distributed_warns():
    # In a process of its own: a process group is global state.
    script = (
        "import os, warnings, torch, torch.distributed as dist, hostembed\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29400 + os.getpid() % 500))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "emb = hostembed.Embedding(10, 4)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    hostembed.SparseAdam(emb.parameters(), fused=True)\n"
        "print('replicated', [str(w.message) for w in caught])\n"
        "import hostembed.distributed as hd\n"
        "sharded = hd.ShardedEmbedding(10, 4)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    hostembed.RowWiseAdagrad(sharded.parameters(), fused=True)\n"
        "print('sharded', [str(w.message) for w in caught])\n"
        "dist.destroy_process_group()\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    replicated, sharded = res.stdout.strip().splitlines()[-2:]
    assert "SparseAdam(fused=True) under torch.distributed" in replicated
    # A distributed module's table gets every rank's gradient: no warning.
    assert sharded == "sharded []", sharded
