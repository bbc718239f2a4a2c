"""Small CPU lookups through torch's own embedding op on the table's weight
(_core/ops/cpu.py, TORCH_OP_MAX_IDS): the same outputs bit for bit as the
core's lookup, the same gradient (a row a position, not coalesced, as
nn.Embedding's), the same training bits with hostembed's optimizers,
hostembed's IndexError for a bad id; the lookups that need the core keep
it (torch_op_calls counts the calls that went to torch's op).

hostembed's optimizers sum a gradient's repeated rows in position order,
as the core's backward does; torch's coalesce() sums them in an order of
its own, so against it the results agree to float32 rounding."""
import pytest
import torch

import hostembed
from hostembed._core.ops import cpu as cpu_ops
from hostembed.nn.lookup import bag_cpu

ROWS, DIM = 300, 8
LIMIT = cpu_ops.TORCH_OP_MAX_IDS
BAG_LIMIT = bag_cpu.TORCH_OP_MAX_BAG_IDS


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


def test_the_call_size_picks_the_path_and_both_give_the_same_output_and_gradient(monkeypatch, torch_op_calls):
    torch.manual_seed(0)
    emb = hostembed.Embedding(ROWS, DIM, padding_idx=3)
    for n in (1, LIMIT, LIMIT + 1):
        ids = _ids(n).view(1, n)
        ids[0, 0] = 3  # the padding row: no gradient either way
        calls = len(torch_op_calls)
        out, grad = _grad_of(emb, ids)
        assert len(torch_op_calls) == calls + (n <= LIMIT), n
        monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)
        core_out, core_grad = _grad_of(emb, ids)
        monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", LIMIT)
        assert torch.equal(out, core_out) and out.shape == (1, n, DIM)
        # Both torch's form: a row a position, the padding row's left out.
        kept = ids.flatten() != 3
        for g in (grad, core_grad):
            assert torch.equal(g._indices()[0], ids.flatten()[kept])
        assert torch.equal(grad._values(), core_grad._values())


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


def counted(monkeypatch, owner, name):
    """A list that grows by one at each call of owner.name (which still runs)."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.fixture
def torch_op_calls(monkeypatch):
    """How many lookups went through torch's op."""
    return counted(monkeypatch, cpu_ops, "torch_op_lookup")


@pytest.mark.parametrize("kwargs", [dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=False),
                                    dict(dtype=torch.bfloat16)], ids=lambda k: next(iter(k)))
def test_lookups_the_core_must_do_keep_it(kwargs, torch_op_calls):
    emb = hostembed.Embedding(ROWS, DIM, **kwargs)
    emb(torch.tensor([4, 7, 4])).sum().backward()
    grad = emb.weight.grad
    assert grad[4].abs().sum() > 0
    # torch's op was asked only where it could run (a bfloat16 table: asked, and refused).
    assert len(torch_op_calls) == (1 if "dtype" in kwargs else 0)
    if grad.is_sparse:  # a row a position, as torch's, unless the core must sum them (frequencies, half rows)
        assert grad._nnz() == (3 if "max_norm" in kwargs else 2)


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
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "cpu"))
    import many_tables
    out = tmp_path / "many.json"
    many_tables.main(["--scale", "20000", "--batches", "16", "--steps", "2", "--rounds", "1", "--json", str(out)])
    steps = json.loads(out.read_text())["ms_per_step"]
    assert set(steps) == {"embedding 16", "bag 16"}
    assert all(r["torch"] > 0 and r["hostembed"] > 0 for r in steps.values())


@pytest.fixture
def torch_bag_calls(monkeypatch):
    """How many bag lookups went through torch's embedding_bag."""
    from hostembed._core.ops import bags as bag_ops
    return counted(monkeypatch, bag_ops, "torch_op_bags")


def _bag_case(mode, weighted, padding_idx, include_last_offset, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = _ids(40, seed)
    ids[[3, 17]] = 5  # the padding row, where there is one
    offsets = torch.tensor([0, 0, 4, 9, 9, 22, 30, 40 if include_last_offset else 35])  # empty bags too
    weights = torch.randn(40, generator=gen, requires_grad=True) if weighted else None
    emb = hostembed.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=padding_idx,
                                 include_last_offset=include_last_offset)
    return emb, ids, offsets, weights


def assert_same_rows(grad, core_grad):
    """torch's bag gradient (a row a position, each its bag's gradient times
    its share, padding left out) against the core's (summed per id in
    position order, ascending): the same rows, the same sums once torch's
    are summed in the core's order."""
    assert core_grad.is_coalesced()
    indices, values = grad._indices()[0], grad._values()
    rows = core_grad._indices()[0]
    assert torch.equal(torch.unique(indices), rows)
    summed = torch.zeros(rows.numel(), DIM)
    for p in range(indices.numel()):  # in position order, as the core sums
        summed[torch.searchsorted(rows, indices[p])] += values[p]
    assert torch.equal(summed, core_grad._values())


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("padding_idx", [None, 5])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_small_bags_through_torchs_op_give_the_cores_bits(mode, weighted, padding_idx, include_last_offset,
                                                          monkeypatch, torch_bag_calls):
    torch.manual_seed(0)
    emb, ids, offsets, weights = _bag_case(mode, weighted, padding_idx, include_last_offset)
    results = []
    for limit in (BAG_LIMIT, -1):
        monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", limit)
        calls = len(torch_bag_calls)
        out = emb(ids, offsets, per_sample_weights=weights)
        assert len(torch_bag_calls) == calls + (limit > 0)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * g).sum(), [emb.weight] + ([weights] if weighted else []))
        results.append((out.detach(), *grads))
    (out, grad, *wgrad), (core_out, core_grad, *core_wgrad) = results
    assert torch.equal(out, core_out)
    assert_same_rows(grad, core_grad)
    if weighted:  # torch sums each dot product in its own order
        torch.testing.assert_close(wgrad[0], core_wgrad[0], rtol=1e-5, atol=1e-6)


def test_small_bags_train_with_the_cores_bits(monkeypatch):
    tables = []
    for limit in (BAG_LIMIT, -1):
        monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", limit)
        torch.manual_seed(0)
        emb = hostembed.EmbeddingBag(ROWS, DIM, mode="sum")
        opt = hostembed.SparseAdam(emb.parameters(), lr=0.05)
        for step in range(10):
            out = emb(_ids(64, seed=step).view(16, 4))
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
            opt.zero_grad()
        tables.append(emb.weight.detach())
    assert torch.equal(*tables)


@pytest.mark.parametrize("bad", ["id", "offsets"])
def test_small_bags_raise_the_cores_errors_before_reading(bad, monkeypatch, torch_bag_calls):
    emb = hostembed.EmbeddingBag(ROWS, DIM, mode="sum")
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    if bad == "id":
        ids[2] = ROWS + 7
    else:
        offsets = torch.tensor([0, 3, 1])
    errors, asked = [], []
    for limit in (BAG_LIMIT, -1):
        monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", limit)
        with pytest.raises((IndexError, RuntimeError)) as error:
            emb(ids, offsets)
        errors.append((type(error.value), str(error.value)))
        asked.append(len(torch_bag_calls))
    assert asked[0] > 0 and asked[1] == asked[0] and errors[0] == errors[1]
    assert (str(ROWS + 7) if bad == "id" else "offsets") in errors[0][1]


def test_the_bag_call_size_and_the_gradient_pick_the_path(monkeypatch, torch_bag_calls):
    monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", 40)
    emb = hostembed.EmbeddingBag(ROWS, DIM, mode="sum")
    for n, through_torch in ((40, True), (44, False)):
        calls = len(torch_bag_calls)
        emb(_ids(n).view(-1, 4)).sum().backward()
        assert len(torch_bag_calls) == calls + through_torch, n
    with torch.no_grad():
        out = emb(_ids(8).view(-1, 4))
    assert len(torch_bag_calls) == 2 and torch.equal(out, emb.weight.detach()[_ids(8).view(-1, 4)].sum(1))
    with pytest.warns(UserWarning):  # a dense gradient: the core's order of sums
        dense = hostembed.EmbeddingBag(ROWS, DIM, mode="sum", sparse=False)
    dense(_ids(8).view(-1, 4)).sum().backward()
    with torch.no_grad():  # no gradient: torch's op again
        dense(_ids(8).view(-1, 4))
    assert len(torch_bag_calls) == 3


@pytest.mark.parametrize("form", ["offsets", "2d"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_of_one_id_are_looked_up_as_rows_with_the_cores_values(form, mode, monkeypatch):
    # DLRM's bags of one id a sample: torch's embedding op on the rows
    # (their values and gradient rows are the bags'), as the core pools them.
    looked_up = counted(monkeypatch, torch.nn.functional, "embedding")
    torch.manual_seed(0)
    emb = hostembed.EmbeddingBag(ROWS, DIM, mode=mode)
    ids = _ids(24)
    args = (ids, torch.arange(24)) if form == "offsets" else (ids.view(24, 1),)
    results = []
    for limit in (BAG_LIMIT, -1):
        monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", limit)
        out = emb(*args)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        results.append((out.detach(), torch.autograd.grad((out * g).sum(), emb.weight)[0]))
    assert len(looked_up) == 1
    (out, grad), (core_out, core_grad) = results
    assert torch.equal(out, core_out) and torch.equal(out, emb.weight.detach()[ids])
    assert_same_rows(grad, core_grad)
