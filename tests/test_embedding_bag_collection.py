"""hostembed.EmbeddingBagCollection: one call pools many tables (the core's
pooled path) with the outputs and gradients each table gives alone, which
are torch's; every optimizer, fused or not, trains the collection as it
trains the tables one by one, bit for bit; bad ids and offsets are refused
before anything is written; the module protocol (state_dict, save/load,
casts) is the tables'."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hostembed
from conftest import zipf_ids

ROWS = (300, 80, 41, 17)
DIM = (16, 8, 37, 4)
MODES = ("sum", "mean", "sum", "mean")
PADDING = (None, 3, None, None)


def tables(cls=hostembed.EmbeddingBag, seed=0, dtype=torch.float32, modes=MODES, **kwargs):
    torch.manual_seed(seed)
    weights = [torch.randn(r, d, dtype=dtype) for r, d in zip(ROWS, DIM)]
    extra = {} if cls is hostembed.EmbeddingBag else {"sparse": True}
    return [cls.from_pretrained(w, freeze=False, mode=m, padding_idx=p, include_last_offset=k == 3, **extra, **kwargs)
            for k, (w, m, p) in enumerate(zip(weights, modes, PADDING))]


def for_torch(values):
    """A batch's inputs or weights as torch gets them: without the ids past
    table 3's last offset (torch's CPU kernel pools them in some modes;
    hostembed: in no bag, test_embedding_bag.py), one of which is no row."""
    return values[:3] + [None if values[3] is None else values[3][:45]]


def batch(seed, dtype=torch.float32):
    """One input a table, in every form: 2-D, 1-D with offsets (empty bags),
    include_last_offset (ids past the last offset), and per-sample weights
    for the sum tables."""
    gen = torch.Generator().manual_seed(seed)
    inputs, offsets, weights = [], [], []
    for k, rows in enumerate(ROWS):
        if k == 2:
            inputs.append(zipf_ids(rows, 40, generator=gen).view(10, 4))
            offsets.append(None)
        else:
            ids = zipf_ids(rows, 50, generator=gen)
            if PADDING[k] is not None:
                ids[::5] = PADDING[k]
            inputs.append(ids)
            offs = torch.tensor([0, 4, 4, 11, 30, 31])
            if k == 3:  # include_last_offset, the last 5 ids in no bag (one of them no row at all)
                offs = torch.tensor([0, 4, 4, 11, 30, 45])
                ids[47] = rows + 3
            offsets.append(offs)
        weights.append(torch.rand(inputs[-1].shape, generator=gen, dtype=dtype) if MODES[k] == "sum" else None)
    return inputs, offsets, weights


def test_outputs_and_gradients_are_each_tables_and_torchs():
    ours, ref, alone = tables(), tables(nn.EmbeddingBag), tables()
    collection = hostembed.EmbeddingBagCollection(ours)
    inputs, offsets, weights = batch(0)
    weights = [None if w is None else w.requires_grad_() for w in weights]
    outs = collection(inputs, offsets, weights)
    assert [t._last_lookup_path for t in ours] == ["pooled"] * 4
    ref_weights = for_torch([None if w is None else w.detach().clone().requires_grad_() for w in weights])
    refs = [t(x, o, w) for t, x, o, w in zip(ref, for_torch(inputs), offsets, ref_weights)]
    one_by_one = [t(x, o, None if w is None else w.detach()) for t, x, o, w in zip(alone, inputs, offsets, weights)]
    for out, want, single in zip(outs, refs, one_by_one):
        assert torch.equal(out, want)  # torch's kernels' operations, in their order
        assert torch.equal(out, single)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for t, r in zip(ours, ref):
        assert t.weight.grad.is_sparse
        torch.testing.assert_close(t.weight.grad.to_dense(), r.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)
    for w, r in zip(weights, ref_weights):
        if w is not None:
            torch.testing.assert_close(w.grad, r.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes_pool_as_torch(dtype):
    ours = tables(dtype=dtype)
    ref = tables(nn.EmbeddingBag, dtype=dtype)
    inputs, offsets, weights = batch(1, dtype)
    outs = hostembed.EmbeddingBagCollection(ours)(inputs, offsets, weights)
    for out, t, x, o, w in zip(outs, ref, for_torch(inputs), offsets, for_torch(weights)):
        assert torch.equal(out, t(x, o, w))


OPTIMIZERS = [
    ("SGD", {"lr": 0.1}),
    ("Adagrad", {"lr": 0.1}),
    ("RowWiseAdagrad", {"lr": 0.1}),
    ("SparseAdam", {"lr": 0.01}),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS)
def test_trains_as_the_tables_one_by_one(name, kwargs, fused):
    """Ten steps: the collection and the same tables called one by one
    with the unfused optimizer (both hostembed, the latter checked against
    torch in test_embedding_bag.py) end bitwise equal, weights and state:
    the fused updates of a pass's tables run in one core call, side by side,
    with the bits of each table's own backward and step."""
    runs = []
    for together in (True, False):
        ts = tables(seed=3)
        opt = getattr(hostembed, name)([t.weight for t in ts], fused=fused and together, **kwargs)
        collection = hostembed.EmbeddingBagCollection(ts)
        for step in range(10):
            inputs, offsets, weights = batch(100 + step)
            outs = collection(inputs, offsets, weights) if together else [
                t(x, o, w) for t, x, o, w in zip(ts, inputs, offsets, weights)]
            loss = sum((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() for out in outs)
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append((ts, opt))
    (a, opt_a), (b, opt_b) = runs
    for x, y in zip(a, b):
        assert torch.equal(x.weight, y.weight)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        for key, value in state_a[k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[k][key])), (k, key)


def test_torch_sgd_after_the_swap_matches_torch():
    ours, ref = tables(), tables(nn.EmbeddingBag)
    opt = torch.optim.SGD([t.weight for t in ours], lr=0.5)
    opt_ref = torch.optim.SGD([t.weight for t in ref], lr=0.5)
    collection = hostembed.EmbeddingBagCollection(ours)
    for step in range(5):
        inputs, offsets, weights = batch(step)
        for outs, o in ((collection(inputs, offsets, weights), opt),
                        ([t(x, f, w) for t, x, f, w in zip(ref, for_torch(inputs), offsets, for_torch(weights))],
                         opt_ref)):
            sum(out.square().sum() for out in outs).backward()
            o.step()
            o.zero_grad()
    for t, r in zip(ours, ref):
        torch.testing.assert_close(t.weight, r.weight, rtol=1e-5, atol=1e-5)


def test_a_bad_id_in_any_table_raises_before_anything_is_written():
    ts = tables()
    opt = hostembed.SGD([t.weight for t in ts], lr=0.1, fused=True)
    collection = hostembed.EmbeddingBagCollection(ts)
    before = [t.weight.detach().clone() for t in ts]
    inputs, offsets, weights = batch(0)
    inputs[1] = inputs[1].clone()
    inputs[1][7] = ROWS[1]
    with pytest.raises(IndexError, match=rf"table 1 of 4: index out of range: id {ROWS[1]} at position 7"):
        collection(inputs, offsets, weights)
    inputs[1][7] = -1
    with pytest.raises(IndexError, match="id -1"):
        collection(inputs, offsets, weights)
    opt.step()
    for t, b in zip(ts, before):
        assert torch.equal(t.weight, b)
        assert t.weight.grad is None


@pytest.mark.parametrize("offsets,match", [
    (torch.tensor([1, 4, 9]), "offsets\\[0\\] has to be 0"),
    (torch.tensor([0, 9, 4]), "must not decrease"),
    (torch.tensor([0, 4, 99]), "can not be greater than input's length"),
])
def test_bad_offsets_raise_torchs_error(offsets, match):
    collection = hostembed.EmbeddingBagCollection(tables())
    inputs, offs, weights = batch(0)
    offs[0] = offsets
    with pytest.raises(RuntimeError, match=match):
        collection(inputs, offs, weights)
    with pytest.raises(RuntimeError, match=match):
        F.embedding_bag(inputs[0], torch.zeros(ROWS[0], DIM[0]), offsets) if "decrease" not in match else \
            collection[0](inputs[0], offsets)


def test_arguments_are_checked():
    collection = hostembed.EmbeddingBagCollection(tables())
    inputs, offsets, weights = batch(0)
    with pytest.raises(ValueError, match="inputs has 3 entries for 4 tables"):
        collection(inputs[:3], offsets)
    with pytest.raises(TypeError, match="offsets must be a list or tuple"):
        collection(inputs, torch.tensor([0]))
    with pytest.raises(ValueError, match="per_sample_weights has 5 entries"):
        collection(inputs, offsets, weights + [None])


def test_other_modules_are_called_one_by_one():
    """max mode, max_norm and plain torch modules in the same list."""
    torch.manual_seed(0)
    mixed = [hostembed.EmbeddingBag(50, 4, mode="max"), hostembed.EmbeddingBag(50, 4, mode="sum", max_norm=1.0),
             nn.EmbeddingBag(50, 4, mode="sum"), hostembed.EmbeddingBag(50, 4, mode="sum")]
    collection = hostembed.EmbeddingBagCollection(mixed)
    ids = [torch.randint(0, 50, (6, 3)) for _ in mixed]
    want = [m(x) for m, x in zip(mixed, ids)]
    got = collection(ids)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert [mixed[0]._last_lookup_path, mixed[1]._last_lookup_path, mixed[3]._last_lookup_path] == [
        "cpu", "cpu", "pooled"]


def test_module_protocol_is_the_tables(tmp_path):
    ts = tables()
    collection = hostembed.EmbeddingBagCollection(ts)
    plain = nn.ModuleList(tables(nn.EmbeddingBag))
    assert collection.state_dict().keys() == plain.state_dict().keys()
    opt = hostembed.Adagrad(collection.parameters(), lr=0.1)
    inputs, offsets, weights = batch(0)
    sum(o.sum() for o in collection(inputs, offsets, weights)).backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    hostembed.save(path, model=collection, optimizer=opt)
    again = hostembed.EmbeddingBagCollection(tables(seed=9))
    opt_again = hostembed.Adagrad(again.parameters(), lr=0.1)
    hostembed.load(path, model=again, optimizer=opt_again)
    for a, b in zip(collection, again):
        assert torch.equal(a.weight, b.weight)
    outs = [o.detach() for o in collection(inputs, offsets, weights)]
    assert all(torch.equal(a, b) for a, b in zip(outs, again(inputs, offsets, weights)))
    again.double()
    assert all(t.weight.dtype == torch.float64 for t in again)
    doubled = again(inputs, offsets, [None if w is None else w.double() for w in weights])
    assert all(o.dtype == torch.float64 for o in doubled)
    assert [t._last_lookup_path for t in again] == ["pooled"] * 4


def test_compiles_fullgraph_and_matches_eager():
    """Under torch.compile each table takes its traced path (the one-call
    pooling is eager-only): the same outputs and gradients."""
    eager, compiled = tables(seed=5), tables(seed=5)
    inputs, offsets, weights = batch(7)
    inputs[3], offsets[3], weights[3] = inputs[3][:45], offsets[3], None  # the traced path needs offsets[-1] == len
    outs = hostembed.EmbeddingBagCollection(eager)(inputs, offsets, weights)
    fn = torch.compile(hostembed.EmbeddingBagCollection(compiled), fullgraph=True)
    got = fn(inputs, offsets, weights)
    for a, b in zip(outs, got):
        torch.testing.assert_close(a, b)
    sum(o.sum() for o in outs).backward()
    sum(o.sum() for o in got).backward()
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.weight.grad.to_dense(), b.weight.grad.to_dense())


def test_under_no_grad_outputs_are_torchs_with_no_graph():
    ours, ref = tables(), tables(nn.EmbeddingBag)
    inputs, offsets, weights = batch(3)
    with torch.no_grad():
        outs = hostembed.EmbeddingBagCollection(ours)(inputs, offsets, weights)
        expected = [t(i, o, per_sample_weights=w) for t, i, o, w in
                    zip(ref, for_torch(inputs), offsets, for_torch(weights))]
    for got, want in zip(outs, expected):
        assert torch.equal(got, want) and got.grad_fn is None
