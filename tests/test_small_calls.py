"""Small CPU lookups through torch's own embedding op on the table's weight
(_core/ops/cpu.py, TORCH_OP_MAX_IDS): the same outputs bit for bit as the
core's lookup, gradients equal to the core's once summed per row (torch's
are not coalesced, as nn.Embedding's are not), the same training bits with
hostembed's optimizers, hostembed's IndexError for a bad id; the lookups
that need the core keep it. Which path ran shows in the gradient: the
core's has one row per distinct id, torch's one per position.

hostembed's optimizers sum a gradient's repeated rows in position order,
as the core's backward does; torch's coalesce() sums them in an order of
its own, so against it the results agree to float32 rounding."""
import pytest
import torch

import hostembed
from hostembed._core.ops import cpu as cpu_ops

ROWS, DIM = 300, 8
LIMIT = cpu_ops.TORCH_OP_MAX_IDS


def _ids(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (ROWS * torch.rand(n, generator=gen) ** 3).long()  # skewed: rows repeat


def _grad_of(module, ids, seed=1):
    out = module(ids)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * g).sum().backward()
    grad, module.weight.grad = module.weight.grad, None
    return out.detach(), grad


@pytest.fixture
def core_only(monkeypatch):
    """Every lookup through the core (the reference)."""
    monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)


def test_the_call_size_picks_the_path_and_both_give_the_same_output_and_gradient(monkeypatch):
    torch.manual_seed(0)
    emb = hostembed.Embedding(ROWS, DIM, padding_idx=3)
    for n in (1, LIMIT, LIMIT + 1):
        ids = _ids(n).view(1, n)
        ids[0, 0] = 3  # the padding row: no gradient either way
        out, grad = _grad_of(emb, ids)
        monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)
        core_out, core_grad = _grad_of(emb, ids)
        monkeypatch.undo()
        assert torch.equal(out, core_out) and out.shape == (1, n, DIM)
        distinct = torch.unique(ids[ids != 3])
        assert torch.equal(core_grad._indices()[0], distinct)  # the core's: one row a distinct id, ascending
        assert grad._nnz() == (n - int((ids == 3).sum()) if n <= LIMIT else distinct.numel()), n
        torch.testing.assert_close(grad.to_dense(), core_grad.to_dense(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad", "torch.SparseAdam"])
def test_training_through_torchs_op_gives_the_cores_bits(name, monkeypatch):
    # One lookup a step: the optimizer sums the repeated rows of torch's
    # gradient in position order, as the core's backward sums them.
    optimizers = {"SparseAdam": (hostembed.SparseAdam, dict(lr=0.05)), "SGD": (hostembed.SGD, dict(lr=0.1)),
                  "Adagrad": (hostembed.Adagrad, dict(lr=0.1)), "RowWiseAdagrad": (hostembed.RowWiseAdagrad,
                                                                                     dict(lr=0.1)),
                  "torch.SparseAdam": (torch.optim.SparseAdam, dict(lr=0.05))}
    cls, hyper = optimizers[name]
    torch.manual_seed(0)
    small, core = hostembed.Embedding(ROWS, DIM), hostembed.Embedding(ROWS, DIM)
    with torch.no_grad():
        core.weight.copy_(small.weight)
    opts = [cls(m.parameters(), **hyper) for m in (small, core)]
    for step in range(15):
        ids = _ids(200, seed=step)
        for module, opt, limit in ((small, opts[0], LIMIT), (core, opts[1], -1)):
            monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", limit)
            out = module(ids)
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
            if module is small:
                assert module.weight.grad._nnz() == 200  # torch's op ran
            opt.step()
            opt.zero_grad()
    if name.startswith("torch."):  # torch's optimizer coalesces in its own order
        torch.testing.assert_close(small.weight, core.weight, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(small.weight, core.weight)


@pytest.mark.parametrize("name", ["SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad"])
def test_optimizers_take_an_uncoalesced_gradient_as_its_rows_summed(name):
    # Unsorted, repeated rows (torch's backward, several backward calls):
    # the same bits as the gradient summed per row in position order, and
    # torch's coalesce() of it to float32 rounding.
    cls = getattr(hostembed, name)
    torch.manual_seed(0)
    tables = [hostembed.Embedding(ROWS, DIM) for _ in range(3)]
    with torch.no_grad():
        for t in tables[1:]:
            t.weight.copy_(tables[0].weight)
    opts = [cls(t.parameters(), lr=0.05) for t in tables]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        indices = torch.randint(0, 40, (120,), generator=gen)
        values = torch.randn(120, DIM, generator=gen)
        rows = torch.unique(indices)
        summed = torch.zeros(rows.numel(), DIM)
        for i in range(120):
            summed[torch.searchsorted(rows, indices[i])] += values[i]
        grad = torch.sparse_coo_tensor(indices.unsqueeze(0), values, (ROWS, DIM))
        tables[0].weight.grad = grad
        tables[1].weight.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), summed, (ROWS, DIM))
        tables[2].weight.grad = grad.coalesce()
        for opt in opts:
            opt.step()
    assert torch.equal(tables[0].weight, tables[1].weight)
    torch.testing.assert_close(tables[0].weight, tables[2].weight, rtol=1e-5, atol=1e-6)
    for key, value in opts[1].state[tables[1].weight].items():
        assert torch.equal(torch.as_tensor(opts[0].state[tables[0].weight][key]), torch.as_tensor(value)), key


def test_a_bad_id_raises_hostembeds_error_before_anything_is_read(core_only, monkeypatch):
    emb = hostembed.Embedding(ROWS, DIM)
    ids = torch.tensor([[1, 2], [ROWS + 4, 0]])
    with pytest.raises(IndexError) as core_error:
        emb(ids)
    monkeypatch.undo()
    with pytest.raises(IndexError) as small_error:
        emb(ids)
    assert str(small_error.value) == str(core_error.value) and str(ROWS + 4) in str(small_error.value)
    with pytest.raises(IndexError):
        emb(torch.tensor([-1]))


@pytest.fixture
def torch_op_calls(monkeypatch):
    """How many lookups went through torch's op."""
    calls = []
    real = cpu_ops.torch_op_lookup
    monkeypatch.setattr(cpu_ops, "torch_op_lookup", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("kwargs", [dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=False),
                                    dict(dtype=torch.bfloat16)], ids=lambda k: next(iter(k)))
def test_lookups_the_core_must_do_keep_it(kwargs, torch_op_calls):
    emb = hostembed.Embedding(ROWS, DIM, **kwargs)
    emb(torch.tensor([4, 7, 4])).sum().backward()
    grad = emb.weight.grad
    assert grad[4].abs().sum() > 0
    # torch's op was asked only where it could run (a bfloat16 table: asked, and refused).
    assert len(torch_op_calls) == (1 if "dtype" in kwargs else 0)
    if grad.is_sparse:
        assert grad._nnz() == 2  # the core's backward: one row a distinct id


def test_a_fused_table_and_a_prefetched_batch_keep_the_core(torch_op_calls):
    emb = hostembed.Embedding(ROWS, DIM)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1, fused=True)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()  # updated in backward: the core's fused pass ran
    assert emb.weight.grad is None and not torch.equal(before[1], emb.weight.detach()[1])
    opt.step()
    plain = hostembed.Embedding(ROWS, DIM)
    plain.prefetch(torch.tensor([5, 6]))
    plain(torch.tensor([5, 6]))
    assert plain._table.prefetch_outcome.startswith("taken") and len(torch_op_calls) == 1  # asked, refused
    with torch.no_grad():
        assert torch.equal(plain(torch.tensor([5, 6])), plain.weight[[5, 6]])  # no prefetch: torch's op
    assert len(torch_op_calls) == 2


def test_the_many_tables_benchmark_times_both_kinds_of_module(tmp_path, monkeypatch):
    import json
    import pathlib
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    import many_tables
    out = tmp_path / "many.json"
    many_tables.main(["--scale", "20000", "--batches", "16", "--steps", "2", "--rounds", "1", "--json", str(out)])
    steps = json.loads(out.read_text())["ms_per_step"]
    assert set(steps) == {"embedding 16", "bag 16"}
    assert all(r["torch"] > 0 and r["hostembed"] > 0 for r in steps.values())
