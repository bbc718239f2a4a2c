"""Bad input gets a clear error and changes nothing."""
import pytest
import torch

import hostembed


def trained_pair():
    emb = hostembed.Embedding(20, 4, max_norm=1.0)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    opt.zero_grad()
    return emb, opt


def snapshot(emb, opt):
    state = opt.state[emb.weight]
    return [emb.weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["step"]]


def assert_unchanged(before, emb, opt):
    after = snapshot(emb, opt)
    for b, a in zip(before[:3], after[:3]):
        assert torch.equal(b, a)
    assert before[3] == after[3]


@pytest.mark.parametrize("bad", [20, 1000, -1], ids=["N", "big", "negative"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_out_of_range_id_raises_index_error_and_changes_nothing(bad, dtype):
    emb, opt = trained_pair()  # max_norm set: renorm would write if it ran
    before = snapshot(emb, opt)
    ids = torch.tensor([[0, 5], [bad, 7]], dtype=dtype)
    with pytest.raises(IndexError, match=rf"id {bad} .*\[0, 20\).*20 rows"):
        emb(ids)
    assert_unchanged(before, emb, opt)


def test_index_error_names_first_bad_position():
    emb = hostembed.Embedding(10, 2)
    ids = torch.zeros(100000, dtype=torch.long)
    ids[70000] = 11
    ids[90000] = -3
    with pytest.raises(IndexError, match=r"id 11 at position 70000"):
        emb(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8], ids=str)
def test_wrong_id_dtype_names_dtype_and_accepted_ones(dtype):
    emb = hostembed.Embedding(10, 2)
    with pytest.raises(hostembed.IdDtypeError, match=rf"torch.int64 or torch.int32, got {dtype}") as info:
        emb(torch.zeros(3, dtype=dtype))
    # torch raises RuntimeError for this; ours is both that and a TypeError.
    assert isinstance(info.value, TypeError) and isinstance(info.value, RuntimeError)


def test_non_tensor_ids():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        hostembed.Embedding(10, 2)([1, 2])


def test_optimizer_refuses_gradient_with_bad_row_and_changes_nothing():
    emb, opt = trained_pair()
    before = snapshot(emb, opt)
    emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[4, 25]]), torch.ones(2, 4), (20, 4), check_invariants=False)
    with pytest.raises(IndexError, match="id 25 .*20 rows"):
        opt.step()
    assert_unchanged(before, emb, opt)


def test_optimizer_refuses_bad_gradient_before_creating_state():
    emb = hostembed.Embedding(20, 4)
    opt = hostembed.SparseAdam(emb.parameters())
    emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[-1]]), torch.ones(1, 4), (20, 4), check_invariants=False)
    before = emb.weight.detach().clone()
    with pytest.raises(IndexError):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(emb.weight, before)


def test_dense_gradient_refused_like_torch():
    emb = hostembed.Embedding(5, 2)
    opt = hostembed.SparseAdam(emb.parameters())
    emb.weight.grad = torch.zeros(5, 2)
    with pytest.raises(RuntimeError, match="does not support dense gradients"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=0.0), "Invalid learning rate"),
        (dict(lr=-1.0), "Invalid learning rate"),
        (dict(eps=0.0), "Invalid epsilon"),
        (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
        (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    ],
)
def test_bad_hyperparameters_like_torch(kwargs, match):
    params = hostembed.Embedding(4, 2).parameters()
    with pytest.raises(ValueError, match=match):
        hostembed.SparseAdam(params, **kwargs)
    with pytest.raises(ValueError, match=match):
        torch.optim.SparseAdam(torch.nn.Embedding(4, 2).parameters(), **kwargs)


@pytest.mark.parametrize("padding_idx", [10, 25, -11])
def test_bad_padding_idx_like_torch(padding_idx):
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        torch.nn.Embedding(10, 2, padding_idx=padding_idx)
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        hostembed.Embedding(10, 2, padding_idx=padding_idx)


def test_bad_weight_shapes_like_torch():
    with pytest.raises(AssertionError, match="Shape of weight does not match"):
        hostembed.Embedding(10, 2, _weight=torch.zeros(10, 3))
    with pytest.raises(AssertionError, match="expected to be 2-dimensional"):
        hostembed.Embedding.from_pretrained(torch.zeros(10))


def test_unsupported_table_dtype():
    # Integer and complex tables have no gradient to train; refused clearly.
    for dtype in (torch.int32, torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=f"float32, float16, bfloat16 or float64; dtype={dtype} is not"):
            hostembed.Embedding(10, 2, dtype=dtype)
    with pytest.raises(TypeError, match="from_pretrained: a host table is float32, .*dtype=torch.int64"):
        hostembed.Embedding.from_pretrained(torch.arange(6).reshape(3, 2))


def test_table_too_big_raises_memory_error_with_bytes():
    rows = 1 << 50
    with pytest.raises(MemoryError, match=rf"{rows * 64 * 4} bytes"):
        hostembed.Embedding(rows, 64)


def test_optimizer_state_of_wrong_shape_refused_before_loading():
    emb, opt = trained_pair()
    saved = opt.state_dict()
    other = hostembed.Embedding(30, 4)
    other_opt = hostembed.SparseAdam(other.parameters(), lr=0.1)
    other(torch.tensor([1])).sum().backward()
    other_opt.step()
    before = [other_opt.state[other.weight][k].clone() for k in ("exp_avg", "exp_avg_sq")]
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape \[20, 4\], expected \[30, 4\]"):
        other_opt.load_state_dict(saved)
    state = other_opt.state[other.weight]
    assert state["step"] == 1
    assert all(torch.equal(b, state[k]) for b, k in zip(before, ("exp_avg", "exp_avg_sq")))
