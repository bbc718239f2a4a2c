"""Property tests over id patterns: duplicates, all-same, empty, max id."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hostembed

NUM_ROWS, DIM = 37, 5
_TABLE = hostembed.Embedding(NUM_ROWS, DIM, padding_idx=3)
_TABLE.requires_grad_(True)

id_lists = st.one_of(
    st.lists(st.integers(0, NUM_ROWS - 1), max_size=200),                        # anything, duplicates included
    st.integers(0, NUM_ROWS - 1).flatmap(lambda i: st.lists(st.just(i), max_size=100)),  # all the same id
    st.lists(st.sampled_from([0, NUM_ROWS - 1, 3]), max_size=60),                 # edges and padding
)


@settings(max_examples=150, deadline=None)
@given(ids=id_lists, int32=st.booleans(), scale=st.booleans())
def test_lookup_and_gradient_agree_with_exact_reference(ids, int32, scale):
    ids_t = torch.tensor(ids, dtype=torch.int32 if int32 else torch.int64)
    out = _TABLE(ids_t)
    assert torch.equal(out, F.embedding(ids_t, _TABLE.weight))

    _TABLE.scale_grad_by_freq = scale
    grad_out = torch.randn(len(ids), DIM)
    grad = torch.autograd.grad(_TABLE(ids_t), _TABLE.weight, grad_out)[0].coalesce()
    indices = grad._indices()[0].tolist()
    assert indices == sorted(set(ids) - {3}), "one row per distinct id once summed, padding left out"

    exact = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64)
    counts = torch.bincount(ids_t.long(), minlength=NUM_ROWS).double()
    for i, row in zip(ids, grad_out.double()):
        exact[i] += row / counts[i] if scale else row
    exact[3] = 0
    # Each sum has at most 200 float32 terms of size ~1: a few ulps each.
    torch.testing.assert_close(grad.to_dense().double(), exact, rtol=0, atol=len(ids) * 2e-7 + 1e-7)


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.integers(0, NUM_ROWS - 1), max_size=30),
    bad=st.one_of(st.integers(-(10**12), -1), st.integers(NUM_ROWS, 10**12)),
    rest=st.lists(st.integers(-3, NUM_ROWS + 3), max_size=30),
)
def test_any_bad_id_raises_index_error_naming_the_first_one(prefix, bad, rest):
    ids = prefix + [bad] + rest
    before = _TABLE.weight.detach().clone()
    try:
        _TABLE(torch.tensor(ids))
    except IndexError as exc:
        assert f"id {bad} at position {len(prefix)} " in str(exc)
    else:
        raise AssertionError("no IndexError for an out-of-range id")
    assert torch.equal(_TABLE.weight, before)
