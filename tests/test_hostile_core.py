"""Hostile inputs at the Python/C boundary: the reproducers of the
2026-11-22 report (R1, R1b, R2, R4, R5, in ../shared/repro-2026-11-22/) as
regression tests, and the binding's own checks (tables are HostBuffer
objects whose size the core checks every shape against; gradients are
validated before the core runs).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import hostembed
from hostembed._core import _C
from hostembed._core.ops import common as _common_ops, update as _ops


def _snapshot(emb, opt=None):
    state = opt.state.get(emb.weight, {}) if opt is not None else {}
    return [emb._table.tensor.clone()] + [state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state]


def _unchanged(before, emb, opt=None):
    return all(torch.equal(a, b) for a, b in zip(before, _snapshot(emb, opt), strict=True))


# ---- R1, R1b: the weight replaced by an expanded (stride-0) view


def test_R1_expanded_weight_step_raises_and_writes_nothing():
    num, dim = 100, 3
    emb = hostembed.Embedding(num, dim)
    table_rows = emb._table.tensor.clone()
    emb.weight.data = torch.randn(1, dim).expand(num, dim)  # storage holds 3 floats
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.01)
    emb.weight.grad = torch.sparse_coo_tensor(torch.randint(0, num, (1, 2000)), torch.randn(2000, dim), (num, dim))
    with pytest.raises(RuntimeError, match=r"no longer views the table's memory .*not contiguous"):
        opt.step()
    assert torch.equal(emb._table.tensor, table_rows)
    assert not opt.state.get(emb.weight)


def test_R1b_expanded_weight_lookup_reads_the_values_torch_reads():
    num, dim = 100_000, 4
    emb = hostembed.Embedding(num, dim)
    src = torch.randn(1, dim)
    emb.weight.data = src.expand(num, dim)
    ids = torch.tensor([0, 1, 99_999])
    ref = F.embedding(ids, src.expand(num, dim))
    assert torch.equal(emb(ids), ref)
    # The lookup copied the values into the table and pointed the weight back at it.
    assert emb._table.views(emb.weight)


# ---- R2: renorm must not use num_embeddings (a plain attribute) or trust a smaller weight


def test_R2_num_embeddings_edited_refuses_before_renorm_writes():
    emb = hostembed.Embedding(8, 4, max_norm=1.0)
    before = _snapshot(emb)
    emb.num_embeddings = 1 << 26  # a plain attribute, as on nn.Embedding
    with pytest.raises(IndexError, match=r"id 67108863 at position 0 is not in \[0, 8\) for a table of 8 rows"):
        emb(torch.tensor([(1 << 26) - 1]))
    assert _unchanged(before, emb)


def test_R2_smaller_weight_data_is_a_smaller_table_whose_range_is_checked_before_renorm_writes():
    # As with torch's module, the weight's new data is the table (a resize,
    # as transformers' resize_token_embeddings makes): ids past its 6 rows
    # are refused before max_norm's renorm writes anything.
    emb = hostembed.Embedding(8, 4, max_norm=1.0)
    rows = torch.randn(6, 4) * 10
    emb.weight.data = rows.clone()
    with pytest.raises(IndexError, match=r"not in \[0, 6\) for a table of 6 rows"):
        emb(torch.tensor([6, 7]))
    assert emb._table.num_rows == 6 and torch.equal(emb.weight.detach(), rows)
    emb(torch.tensor([5]))  # renorms row 5 alone, in the new table
    assert torch.equal(emb.weight.detach()[:5], rows[:5]) and emb.weight.detach()[5].norm() <= 1.0 + 1e-6


# ---- R4: max_norm with any finite norm_type


NORM_TYPES = [0.5, 1.0, 2.0, 3.0, 300.0, 1e9, math.inf]


def _norm64(rows, p):
    """||row||_p in float64, scaled by max|x| so no p over- or underflows."""
    a = rows.double().abs()
    m = a.amax(dim=1)
    if math.isinf(p):
        return m
    safe = torch.where(m > 0, m, torch.ones_like(m))
    return torch.where(m > 0, safe * ((a / safe[:, None]) ** p).sum(dim=1) ** (1.0 / p), torch.zeros_like(m))


def _renorm64(rows, max_norm, p):
    """torch's embedding_renorm_ in float64: rows with a norm over max_norm
    times max_norm / (norm + 1e-7)."""
    norm = _norm64(rows, p)
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-7), torch.ones_like(norm))
    return rows.double() * scale[:, None], norm


def _ours(rows, max_norm, p):
    emb = hostembed.Embedding(*rows.shape, max_norm=max_norm, norm_type=p)
    with torch.no_grad():
        emb.weight.copy_(rows)
    emb(torch.arange(rows.shape[0]))
    return emb.weight.detach().clone()


@pytest.mark.parametrize("p", [300.0, 1e9])
def test_R4_large_norm_type_scales_rows_to_max_norm_like_torch(p):
    rows = torch.tensor([[1.5], [12.0], [-40.0]])
    ours = _ours(rows, 2.0, p)
    ref = rows.clone()
    torch.embedding_renorm_(ref, torch.arange(3), 2.0, p)
    assert ours.view(-1).tolist() == [1.5, 2.0, -2.0]
    assert torch.equal(ours, ref)


def _rows(kind, dim, gen):
    base = torch.rand(8, dim, generator=gen, dtype=torch.float64) * 0.75 + 0.25
    sign = torch.where(torch.rand(8, dim, generator=gen) < 0.5, -1.0, 1.0)
    scale = {"normal": 1.0, "large": 40.0, "huge": 1e30, "tiny": 1e-30, "subnormal": 1e-41}[kind]
    return (base * sign * scale).float()


@pytest.mark.parametrize("p", NORM_TYPES, ids=lambda p: f"p={p:g}")
@pytest.mark.parametrize("kind", ["normal", "large", "huge", "tiny", "subnormal"])
@pytest.mark.parametrize("dim", [1, 5, 64])
def test_R4_renorm_against_float64_and_torch(p, kind, dim):
    """Every row ends within float rounding of the float64 renorm (max_norm
    between the rows' norms, so some rows are scaled and some are not), and
    within twice torch's own error of it wherever torch's float norm is
    meaningful. Where torch's norm over- or underflows (|x|^p past float's
    range: p = 300 of 40s, p = 2 of 1e-30s) torch scales such a row to 0 or
    leaves it over max_norm; the core does not."""
    gen = torch.Generator().manual_seed(dim * 1000 + NORM_TYPES.index(p) * 10 + len(kind))
    rows = _rows(kind, dim, gen)
    norms = _norm64(rows, p)
    if not torch.isfinite(norms.float()).all():
        pytest.skip("norms past float's range (rounded to inf by torch and the core alike)")
    # Between the two middle norms furthest apart (relatively): no row sits
    # where rounding its norm to float would decide.
    ordered = norms.sort().values
    gaps = ordered[3:6] / ordered[2:5]
    i = 2 + int(gaps.argmax())
    assert gaps.max() > 1 + 1e-4
    max_norm = float((ordered[i] * ordered[i + 1]).sqrt())
    want, _ = _renorm64(rows, max_norm, p)
    ours = _ours(rows, max_norm, p).double()
    ulp = 2.0**-23
    # Each element: the scale (from a norm rounded to float) and the product
    # rounded: a few float ulps of the value, plus subnormal spacing.
    tol = 4 * ulp * want.abs() + 2 * 2.0**-149
    err = (ours - want).abs()
    assert (err <= tol).all(), f"off the float64 renorm by {(err - tol).max().item():.3g} beyond rounding"
    assert (_norm64(ours.float(), p) <= max_norm * (1 + 4 * ulp) + 2.0**-149 * dim).all()

    theirs = rows.clone()
    torch.embedding_renorm_(theirs, torch.arange(rows.shape[0]), max_norm, p)
    torch_norms = torch.stack([rows[i].norm(p) for i in range(rows.shape[0])]).double()
    meaningful = torch.isfinite(torch_norms) & ((torch_norms - norms).abs() <= 1e-3 * norms)
    torch_err = (theirs.double() - want).abs()
    bound = 2 * torch_err + tol
    assert (err[meaningful] <= bound[meaningful]).all()
    if dim == 1:
        # torch's norm of one element is |x|: the same bits.
        assert torch.equal(ours.float(), theirs)


def test_R4_tiny_norms_are_compared_with_max_norm_without_underflow():
    # ||(1e-30, 1e-30)||_2 = 1.41e-30 > max_norm, but torch's float sum of
    # squares underflows to 0, so torch leaves the row over max_norm. The
    # core's norm does not underflow: the row is renormed by the formula,
    # max_norm / (norm + 1e-7), which for such rows is ~1e-23 (0 after
    # rounding, as the float64 formula rounds).
    rows = torch.full((1, 2), 1e-30)
    want, norm = _renorm64(rows, 1e-30, 2.0)
    assert math.isclose(float(norm), math.sqrt(2) * 1e-30, rel_tol=1e-6)
    assert torch.equal(_ours(rows, 1e-30, 2.0), want.float())
    theirs = rows.clone()
    torch.embedding_renorm_(theirs, torch.tensor([0]), 1e-30, 2.0)
    assert torch.equal(theirs, rows)  # torch's norm underflowed: not renormed


# ---- R5: a hand-built fully sparse gradient


def test_R5_sparse_dim_2_gradient_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    emb = hostembed.Embedding(3, 2)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([0])).sum().backward()
    opt.step()  # state exists
    opt.zero_grad()
    before = _snapshot(emb, opt)
    step = opt.state[emb.weight]["step"]
    emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (3, 2))
    assert emb.weight.grad.sparse_dim() == 2
    with pytest.raises(RuntimeError, match=r"sparse_dim=1.*got a sparse COO gradient with sparse_dim=2"):
        opt.step()
    assert _unchanged(before, emb, opt)
    assert opt.state[emb.weight]["step"] == step


def test_R5_row_sparse_conversion_named_in_the_message_works():
    emb = hostembed.Embedding(3, 2)
    ref = torch.nn.Embedding(3, 2, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    o, r = hostembed.SparseAdam(emb.parameters(), lr=0.1), torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    g = torch.sparse_coo_tensor(torch.tensor([[0, 0], [0, 1]]), torch.tensor([1.0, 2.0]), (3, 2))
    emb.weight.grad = g.coalesce().to_dense().to_sparse(1)
    ref.weight.grad = g.coalesce().to_dense().to_sparse(1)
    o.step()
    r.step()
    torch.testing.assert_close(emb.weight, ref.weight, rtol=2.4e-7, atol=1e-7)


# ---- the op validates the gradient before the core


@pytest.mark.parametrize("indices, values, match", [
    (torch.tensor([[0, 1]]), torch.ones(2, 4), r"1-D int64"),
    (torch.tensor([0.0, 1.0]), torch.ones(2, 4), r"1-D int64"),
    (torch.tensor([0, 1]), torch.ones(4, 2), r"\[2, 4\] tensor .* got a \[4, 2\]"),
    (torch.tensor([0, 1]), torch.ones(8), r"got a \[8\]"),
    (torch.tensor([0, 1, 2]), torch.ones(2, 4), r"\[3, 4\]"),
    (torch.tensor([0, 1]), torch.ones(2, 4, dtype=torch.int64), r"floating-point"),
])
def test_sparse_adam_op_refuses_malformed_gradients(indices, values, match):
    emb = hostembed.Embedding(5, 4)
    exp_avg, exp_avg_sq = emb._table.zeros(), emb._table.zeros()
    before = emb._table.tensor.clone()
    with pytest.raises(RuntimeError, match=match):
        _ops.sparse_adam_(emb.weight, exp_avg, exp_avg_sq, indices, values, lr=0.1, beta1=0.9, beta2=0.999,
                          eps=1e-8, step=1, maximize=False)
    assert torch.equal(emb._table.tensor, before)
    assert not exp_avg.any() and not exp_avg_sq.any()


def test_state_replaced_by_plain_tensors_is_copied_into_the_table():
    emb = hostembed.Embedding(6, 3)
    ref = torch.nn.Embedding(6, 3, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    opt, ropt = hostembed.SparseAdam(emb.parameters()), torch.optim.SparseAdam(ref.parameters())
    for model, o in ((emb, opt), (ref, ropt)):
        model(torch.tensor([1, 4])).sum().backward()
        o.step()
        o.zero_grad()
    state = opt.state[emb.weight]
    state["exp_avg"] = state["exp_avg"].clone()  # an ordinary tensor now
    for model, o in ((emb, opt), (ref, ropt)):
        model(torch.tensor([4, 5])).sum().backward()
        o.step()
    assert emb._table.owns(opt.state[emb.weight]["exp_avg"])
    torch.testing.assert_close(opt.state[emb.weight]["exp_avg"], ropt.state[ref.weight]["exp_avg"], rtol=0, atol=0)
    torch.testing.assert_close(emb.weight, ref.weight, rtol=2.4e-7, atol=1e-7)


def test_state_aliasing_the_weight_is_refused():
    emb = hostembed.Embedding(6, 3)
    opt = hostembed.SparseAdam(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    opt.state[emb.weight]["exp_avg"] = emb.weight.detach()
    before = emb._table.tensor.clone()
    emb(torch.tensor([2])).sum().backward()
    with pytest.raises(ValueError, match="exp_avg overlaps the weight"):
        opt.step()
    assert torch.equal(emb._table.tensor, before)


def test_state_that_is_not_the_tables_memory_is_refused_by_the_op():
    emb = hostembed.Embedding(6, 3)
    bigger = emb._table.zeros().new_zeros(7, 3)
    with pytest.raises(RuntimeError, match=r"exp_avg of a \[6, 3\] float32 host table .* in the table's own host memory"):
        _ops.sparse_adam_(emb.weight, bigger[1:], emb._table.zeros(), torch.tensor([0]), torch.ones(1, 3), lr=0.1,
                          beta1=0.9, beta2=0.999, eps=1e-8, step=1, maximize=False)


# ---- the binding: tables are HostBuffers, checked against their size


def _ids(*values):
    t = torch.tensor(values, dtype=torch.int64)
    return t, {"ids": t.data_ptr(), "count": t.numel(), "ids_int64": True}


def test_the_rows_buffer_is_held_by_the_table():
    emb = hostembed.Embedding(10, 4)
    table = emb._table
    assert isinstance(table.buffer, _C.HostBuffer)
    assert table.buffer.address == emb.weight.data_ptr() and table.buffer.nbytes >= 10 * 4 * 4
    assert table.buffer_of(emb.weight, "the weight") is table.buffer


def test_gather_takes_a_buffer_not_an_address():
    buf = _C.HostBuffer(16 * 4)
    ids, ids_args = _ids(0)
    out = torch.empty(1, 4)
    with pytest.raises(TypeError, match=r"table must be a hostembed._core._C.HostBuffer .*got int"):
        _C.gather(table=buf.address, num_rows=4, dim=4, dtype=0, **ids_args, out=out.data_ptr())


@pytest.mark.parametrize("num_rows, dim", [(5, 4), (4, 5), (1 << 40, 4), (2, 1 << 62)])
def test_shapes_larger_than_the_buffer_are_refused_before_any_work(num_rows, dim):
    buf = _C.HostBuffer(16 * 4)  # 4 x 4 floats (one page mapped)
    assert buf.nbytes == 64
    ids, ids_args = _ids(0)
    out = torch.full((1, 4), -7.0)
    with pytest.raises(ValueError, match=r"table: a \[\d+, \d+\] float32 table .* needs .* bytes, but its buffer "
                                         r"has 64"):
        _C.gather(table=buf, num_rows=num_rows, dim=dim, dtype=0, **ids_args, out=out.data_ptr())
    assert (out == -7.0).all()
    dedup = _C.Dedup(**ids_args, num_rows=num_rows)
    with pytest.raises(ValueError, match="needs"):
        _C.renorm(table=buf, num_rows=num_rows, dim=dim, dtype=0, dedup=dedup, max_norm=0.0, norm_type=2.0)
    state = [_C.HostBuffer(16 * 4), _C.HostBuffer(16 * 4)]
    grad = torch.ones(1, 4)
    with pytest.raises(ValueError, match="weight: .*needs"):
        _sparse_update(kind=0, weight=buf, state=tuple(state), num_rows=num_rows, dim=dim,
                         indices=ids.data_ptr(), values=grad.data_ptr(), nnz=1, lr=1.0, beta1=0.9, beta2=0.999,
                         eps=1e-8, lr_decay=0.0, step=1, maximize=False, weight_decay=0.0, dtype=0, values_dtype=0,
                         stochastic_rounding=False, seed=0)
    assert not any(bytes(memoryview(b)) != bytes(64) for b in [buf, *state])


def _sparse_update(**update):
    """One table's update through the core's many-table entry."""
    _C.sparse_update_many(updates=[update])


def test_optimizer_state_buffers_too_small_shared_or_miscounted():
    w, small, v = _C.HostBuffer(64), _C.HostBuffer(60), _C.HostBuffer(64)
    memoryview(w)[:] = bytes(range(64))
    ids, _ = _ids(3)
    grad = torch.ones(1, 4)
    hyper = dict(num_rows=4, dim=4, indices=ids.data_ptr(), values=grad.data_ptr(), nnz=1, lr=1.0, beta1=0.9,
                 beta2=0.999, eps=1e-8, lr_decay=0.0, step=1, maximize=False, weight_decay=0.0, dtype=0, values_dtype=0,
                         stochastic_rounding=False, seed=0)
    with pytest.raises(ValueError, match=r"exp_avg: a \[4, 4\] float32 table .* needs 64 bytes, but its buffer has 60"):
        _sparse_update(kind=0, weight=w, state=(small, v), **hyper)
    with pytest.raises(ValueError, match="exp_avg_sq overlaps the weight"):
        _sparse_update(kind=0, weight=w, state=(v, w), **hyper)
    with pytest.raises(ValueError, match="SparseAdam keeps 2 state buffers, got a tuple of 1"):
        _sparse_update(kind=0, weight=w, state=(v,), **hyper)
    with pytest.raises(ValueError, match="unknown optimizer kind 9"):
        _sparse_update(kind=9, weight=w, state=(), **hyper)
    with pytest.raises(TypeError, match="exp_avg must be a hostembed._core._C.HostBuffer"):
        _sparse_update(kind=0, weight=w, state=(1, v), **hyper)
    # Row-wise Adagrad keeps one value per row: 4 rows need 16 bytes.
    with pytest.raises(ValueError, match=r"sum: a \[4, 1\] float32 table .* needs 16 bytes, but its buffer has 12"):
        _sparse_update(kind=3, weight=w, state=(_C.HostBuffer(12),), **hyper)
    with pytest.raises(ValueError, match="RowWiseAdagrad's row_sum overlaps the weight"):
        _sparse_update(kind=3, weight=w, state=(w,), **hyper)
    assert bytes(memoryview(w)) == bytes(range(64))


def test_renorm_refuses_a_dedup_built_for_another_table():
    buf = _C.HostBuffer(64)
    ids, ids_args = _ids(1)
    dedup = _C.Dedup(**ids_args, num_rows=2)
    with pytest.raises(ValueError, match="checked against a table of 2 rows, the table has 4"):
        _C.renorm(table=buf, num_rows=4, dim=4, dtype=0, dedup=dedup, max_norm=0.0, norm_type=2.0)


@pytest.mark.skipif(not _common_ops.CUDA_COMPILED, reason="the CUDA bindings are not compiled in")
def test_cuda_bindings_check_the_buffer_before_any_cuda_call():
    # These raise before anything reaches CUDA, so they run without a GPU.
    buf = _C.HostBuffer(64)
    common = dict(rows=0, count=1, device=0, stream=0)
    with pytest.raises(TypeError, match="table must be a hostembed._core._C.HostBuffer"):
        _C.cuda_gather(table=buf.address, num_rows=4, dim=4, out=0, **common)
    with pytest.raises(ValueError, match="needs 80 bytes, but its buffer has 64"):
        _C.cuda_gather(table=buf, num_rows=5, dim=4, out=0, **common)
    with pytest.raises(ValueError, match="table: the HostBuffer is not registered with CUDA"):
        _C.cuda_gather(table=buf, num_rows=4, dim=4, out=0, **common)
    with pytest.raises(ValueError, match="table: the HostBuffer is not registered with CUDA"):
        _C.cuda_renorm(table=buf, num_rows=4, dim=4, max_norm=1.0, norm_type=2.0, **common)
    with pytest.raises(ValueError, match="weight: the HostBuffer is not registered with CUDA"):
        _C.cuda_sparse_adam(weight=buf, exp_avg=_C.HostBuffer(64), exp_avg_sq=_C.HostBuffer(64), num_rows=4, dim=4,
                            indices=0, values=0, nnz=1, lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, step=1,
                            maximize=False, weight_decay=0.0, device=0, stream=0)
    # An empty table needs no registration (nothing is read): dim 0 returns
    # before any CUDA call.
    _C.cuda_gather(table=buf, num_rows=4, dim=0, out=0, **common)
