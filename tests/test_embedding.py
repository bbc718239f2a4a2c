"""hostembed.Embedding against torch.nn.Embedding as the reference."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import hostembed
from hostembed._core.ops import cpu as cpu_ops
from conftest import pair, zipf_ids

SHAPES = [(), (0,), (7,), (0, 3), (4, 5), (2, 3, 4)]
ID_DTYPES = [torch.int64, torch.int32]


def dense_grad_error(grad, ids, grad_out, num_rows):
    """Max |grad - exact| against a float64 reference gradient."""
    exact = torch.zeros(num_rows, grad_out.shape[-1], dtype=torch.float64)
    exact.index_add_(0, ids.reshape(-1).long(), grad_out.reshape(-1, grad_out.shape[-1]).double())
    return (grad.double() - exact).abs().max().item() if grad.numel() else 0.0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
def test_forward_bitwise_equal_to_torch(shape, dtype, threads):
    ref, ours = pair(50, 12)
    ids = torch.randint(0, 50, shape, dtype=dtype)
    out = ours(ids)
    expected = F.embedding(ids, ref.weight)
    assert out.shape == expected.shape == shape + (12,)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_forward_non_contiguous_ids():
    ref, ours = pair(40, 8)
    ids = torch.randint(0, 40, (6, 9)).t()
    assert not ids.is_contiguous()
    assert torch.equal(ours(ids), F.embedding(ids, ref.weight))


@pytest.mark.parametrize("shape", [(0,), (300,), (3, 7, 20)], ids=str)
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
def test_backward_matches_torch_gradient(shape, dtype, threads):
    num_rows, dim = 64, 10
    ref, ours = pair(num_rows, dim, sparse=True)
    ids = torch.randint(0, num_rows, shape, dtype=dtype)
    grad_out = torch.randn(shape + (dim,))
    ours(ids).backward(grad_out)
    ref(ids).backward(grad_out)
    grad = ours.weight.grad
    assert grad.is_sparse and grad.shape == (num_rows, dim)
    assert grad.dtype == torch.float32
    # Both sum the same float32 rows in different orders: bound our error
    # against the exact (float64) gradient by a small multiple of torch's.
    ours_err = dense_grad_error(grad.to_dense(), ids, grad_out, num_rows)
    torch_err = dense_grad_error(ref.weight.grad.to_dense(), ids, grad_out, num_rows)
    assert ours_err <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_backward_leaves_a_row_a_position_as_torch_but_sums_a_half_tables(monkeypatch, dtype):
    # A float table's gradient is torch's (a row a position, the optimizer
    # sums them), through either path; a half table's is summed in float32
    # and rounded once, so it comes coalesced.
    monkeypatch.setattr(cpu_ops, "TORCH_OP_MAX_IDS", -1)
    ours = hostembed.Embedding(30, 4, dtype=dtype)
    ids = torch.tensor([5, 3, 5, 29, 0, 3, 3])
    grad = torch.autograd.grad(ours(ids).sum(), ours.weight)[0]
    if dtype == torch.float32:
        assert not grad.is_coalesced()
        assert grad._indices()[0].tolist() == ids.tolist()
        grad = grad.coalesce()
    else:
        assert grad.is_coalesced()
    assert grad._indices()[0].tolist() == [0, 3, 5, 29]
    assert grad._values()[:, 0].tolist() == [1.0, 3.0, 2.0, 1.0]


def test_repeated_backward_accumulates(threads):
    ref, ours = pair(20, 6, sparse=True)
    for _ in range(3):
        ids = torch.randint(0, 20, (25,))
        g = torch.randn(25, 6)
        ours(ids).backward(g)
        ref(ids).backward(g)
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad.to_dense())


@pytest.mark.parametrize("padding_idx", [0, 7, -1, -20])
def test_padding_idx_zero_at_init_and_gets_no_gradient(padding_idx):
    ref, ours = pair(20, 5, padding_idx=padding_idx, sparse=True)
    pad = padding_idx % 20
    assert ours.padding_idx == pad
    assert torch.count_nonzero(ours.weight[pad]) == 0
    ids = torch.tensor([pad, 1, pad, 19, 3, pad])
    g = torch.randn(6, 5)
    ours(ids).backward(g)
    ref(ids).backward(g)
    grad = ours.weight.grad
    assert pad not in grad._indices()[0].tolist()
    torch.testing.assert_close(grad.to_dense(), ref.weight.grad.to_dense())


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_scale_grad_by_freq_with_sparse_gradient(padding_idx, threads):
    # torch refuses scale_grad_by_freq with sparse gradients: its dense
    # gradient is the reference.
    ref, ours = pair(16, 4, padding_idx=padding_idx, scale_grad_by_freq=True, sparse=True)
    ref.sparse = False
    ids = torch.tensor([[2, 3, 3, 9], [3, 2, 15, 9]])
    g = torch.randn(2, 4, 4)
    ours(ids).backward(g)
    ref(ids).backward(g)
    assert ours.weight.grad.is_sparse
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad)


def test_sparse_false_gives_torch_dense_gradient_and_warns():
    with pytest.warns(UserWarning, match="dense gradient"):
        ours = hostembed.Embedding(12, 3, sparse=False)
    ref = torch.nn.Embedding(12, 3, _weight=ours.weight.detach().clone())
    ids = torch.tensor([1, 1, 4, 11])
    g = torch.randn(4, 3)
    ours(ids).backward(g)
    ref(ids).backward(g)
    assert not ours.weight.grad.is_sparse
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=str)
def test_max_norm_renorms_referenced_rows_in_place(norm_type, dtype, threads):
    ref, ours = pair(30, 8, max_norm=1.5, norm_type=norm_type)
    ids = torch.tensor([[0, 4, 4, 29], [7, 0, 12, 13]], dtype=dtype)
    out = ours(ids)
    expected = ref(ids)
    # torch sums the norm in float32 in its own order, we round the exact
    # norm once: the scales may differ by an ulp, so allow ~2 ulps (2.4e-7).
    torch.testing.assert_close(ours.weight, ref.weight, rtol=3e-7, atol=0)
    torch.testing.assert_close(out, expected, rtol=3e-7, atol=0)
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[ids.long().flatten()] = False
    assert torch.equal(ours.weight[untouched], ref.weight[untouched])


def test_weight_is_a_cpu_parameter_aliasing_the_table():
    ours = hostembed.Embedding(10, 4)
    assert isinstance(ours.weight, torch.nn.Parameter)
    assert ours.weight.device.type == "cpu" and ours.weight.dtype == torch.float32
    assert ours.weight.shape == (10, 4) and ours.weight.is_contiguous()
    assert list(ours.state_dict()) == ["weight"]
    assert ours.state_dict()["weight"].data_ptr() == ours.weight.data_ptr()


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_from_torch_copies_in_place(assign):
    ref = torch.nn.Embedding(10, 4)
    ours = hostembed.Embedding(10, 4)
    ptr = ours.weight.data_ptr()
    ours.load_state_dict(ref.state_dict(), assign=assign)
    assert ours.weight.data_ptr() == ptr
    assert torch.equal(ours.weight, ref.weight)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ours.load_state_dict(torch.nn.Embedding(11, 4).state_dict())


def test_device_moves_never_move_the_table_and_casts_convert_it_in_host_memory():
    model = torch.nn.Sequential(hostembed.Embedding(10, 4))
    emb = model[0]
    ptr = emb.weight.data_ptr()
    model.to("cpu")
    model.cpu()
    assert emb.weight.data_ptr() == ptr and emb.weight.dtype == torch.float32
    before = emb.weight.detach().clone()
    model.double()
    assert emb.weight.dtype == torch.float64 and emb.weight.device.type == "cpu"
    assert torch.equal(emb.weight.detach(), before.double())
    assert emb.output_device == torch.device("cpu")
    out = emb(torch.tensor([1]))
    assert out.device.type == "cpu" and out.dtype == torch.float64


def test_device_argument_sets_output_device():
    emb = hostembed.Embedding(10, 4, device="cpu")
    assert emb.output_device == torch.device("cpu")
    assert emb.weight.device.type == "cpu"


def test_from_pretrained_copies_and_freezes():
    src = torch.randn(9, 3, dtype=torch.float64)
    emb = hostembed.Embedding.from_pretrained(src)
    assert not emb.weight.requires_grad and emb.sparse
    assert emb.weight.dtype == torch.float64 and torch.equal(emb.weight, src)
    src.zero_()
    assert torch.count_nonzero(emb.weight) > 0, "the module owns a copy"
    ids = torch.tensor([0, 8])
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    trainable = hostembed.Embedding.from_pretrained(torch.randn(9, 3), freeze=False, padding_idx=2)
    assert trainable.weight.requires_grad and trainable.padding_idx == 2


def test_weight_argument_is_copied():
    w = torch.randn(5, 2)
    emb = hostembed.Embedding(5, 2, _weight=w, _freeze=True)
    assert torch.equal(emb.weight, w) and emb.weight.data_ptr() != w.data_ptr()
    assert not emb.weight.requires_grad


def test_repr_has_torch_options_then_where_table_and_outputs_are():
    options = "10, 3, padding_idx=1, max_norm=2.0, sparse=True"
    assert repr(torch.nn.Embedding(10, 3, padding_idx=1, max_norm=2.0, sparse=True)) == f"Embedding({options})"
    assert repr(hostembed.Embedding(10, 3, padding_idx=1, max_norm=2.0)) == (
        f"hostembed.Embedding({options}, table in host memory, outputs on cpu)"
    )


def test_thread_count_setting():
    before = hostembed.get_num_threads()
    assert before >= 1
    hostembed.set_num_threads(3)
    assert hostembed.get_num_threads() == 3
    hostembed.set_num_threads(before)
    with pytest.raises(ValueError, match="got 0"):
        hostembed.set_num_threads(0)
    with pytest.raises(TypeError):
        hostembed.set_num_threads(2.0)
    assert hostembed.get_num_threads() == before


def test_zipf_batches_forward_backward_identical_for_any_thread_count():
    _, ours = pair(5000, 32)
    ids = zipf_ids(5000, 20000, generator=torch.Generator().manual_seed(1))
    g = torch.randn(20000, 32)
    results = []
    for n in (1, 2, 3, 5):
        hostembed.set_num_threads(n)
        out = ours(ids)
        grad = torch.autograd.grad(out, ours.weight, g)[0]
        results.append((out, grad._indices(), grad._values()))
    for out, idx, val in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(idx, results[0][1]) and torch.equal(val, results[0][2])
    hostembed.set_num_threads(hostembed.get_num_threads())


def test_no_dense_warning_for_default_sparse():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hostembed.Embedding(4, 2)


def test_outputs_stay_valid_while_referenced_even_as_views():
    # Outputs live in recycled scratch buffers: a buffer may only be reused
    # once no tensor, view included, refers to it.
    ref, ours = pair(100, 16)
    kept = []
    for step in range(12):
        ids = torch.randint(0, 100, (64, 3), generator=torch.Generator().manual_seed(step))
        out = ours(ids)
        kept.append((ids, out[5:] if step % 2 else out.view(-1)))
        del out
    for ids, view in kept:
        full = F.embedding(ids, ref.weight)
        expected = full.view(-1) if view.dim() == 1 else full[5:]
        assert torch.equal(view, expected)
    hostembed.empty_cache()
    assert torch.equal(kept[0][1], F.embedding(kept[0][0], ref.weight).view(-1))


def test_concurrent_python_threads_get_correct_results():
    # The core releases the GIL; a second caller while the pool is busy runs
    # on its own thread instead of waiting or corrupting the first job.
    import threading

    ref, ours = pair(3000, 32)
    failures = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(20):
            ids = torch.randint(0, 3000, (5000,), generator=gen)
            if not torch.equal(ours(ids), F.embedding(ids, ref.weight)):
                failures.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_dropped_module_leaves_no_table_behind():
    # The parameter -> table registry is weak on the parameter: dropping
    # the module frees its table, and a new tensor that gets a dead
    # parameter's id() is no table's weight.
    import gc
    import weakref

    from hostembed._core import table as tables

    gc.collect()  # earlier tests' modules left in reference cycles
    before = len(tables._tables)
    emb = hostembed.Embedding(100, 4)
    table = weakref.ref(emb._table)
    assert len(tables._tables) == before + 1 and tables.table_of(emb.weight) is emb._table
    dead_id = id(emb.weight)
    del emb
    gc.collect()
    assert table() is None and len(tables._tables) == before
    fresh = [torch.nn.Parameter(torch.zeros(100, 4)) for _ in range(200)]
    assert all(tables.table_of(p) is None for p in fresh)
    assert dead_id not in tables._tables._entries


def test_a_functorch_transform_gets_torchs_own_refusal():
    """Lookups call their autograd Function without torch's Python wrapper
    only when no functorch transform is active; under one they go through
    torch's apply, which names what such a Function needs."""
    emb = hostembed.Embedding(10, 4)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(emb)(torch.tensor([[1, 2], [3, 4]]))
    assert emb(torch.tensor([1, 2])).shape == (2, 4)  # and the fast path after it
