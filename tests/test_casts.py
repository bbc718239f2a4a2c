"""Module casts (.half(), .bfloat16(), .double(), .to(dtype)) of a model
with host tables: the table stays float32 in host memory, the outputs take
the cast dtype (what the rest of a cast model expects), and the gradient
comes back to the table in float32, as the same model with the cast
written after a float32 torch embedding gives."""
import copy

import pytest
import torch
from torch import nn

import hostembed

CASTS = {
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "double": (lambda m: m.double(), torch.float64),
    "to(float64)": (lambda m: m.to(torch.float64), torch.float64),
}


def _pair(kind):
    torch.manual_seed(0)
    if kind == "bag":
        ref = nn.EmbeddingBag(50, 8, mode="sum")
        ours = hostembed.EmbeddingBag.from_pretrained(ref.weight.detach(), freeze=False, mode="sum")
    else:
        ref = nn.Embedding(50, 8)
        ours = hostembed.Embedding.from_pretrained(ref.weight.detach(), freeze=False)
    return ref, ours


@pytest.mark.parametrize("kind", ["embedding", "bag"])
@pytest.mark.parametrize("cast", CASTS)
def test_cast_model_outputs_the_cast_dtype_and_trains_the_float32_table(cast, kind):
    apply, dtype = CASTS[cast]
    ref, ours = _pair(kind)
    table = ours.weight.data_ptr()
    model = apply(nn.Sequential(ours, nn.Linear(8, 2)))
    head = nn.Linear(8, 2).to(dtype)
    head.load_state_dict(model[1].state_dict())
    assert ours.weight.dtype == torch.float32 and ours.weight.data_ptr() == table
    assert ours.output_dtype == dtype
    ids = torch.tensor([[1, 2, 2], [7, 1, 49]])
    out = model(ids)
    expected = head(ref(ids).to(dtype))  # torch: a float32 embedding, then the cast
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad, rtol=1e-6, atol=1e-7)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1)
    opt.step()
    assert not torch.equal(ours.weight, ref.weight)  # the float32 table trained


def test_casts_compose_with_moves_and_copies():
    emb = hostembed.Embedding(10, 3)
    emb.bfloat16()
    assert "outputs bfloat16 on cpu" in repr(emb)
    assert copy.deepcopy(emb).output_dtype == torch.bfloat16
    emb.to("cpu")  # a move keeps the dtype
    assert emb.output_dtype == torch.bfloat16
    emb.float()
    assert emb.output_dtype == torch.float32 and emb(torch.tensor([1])).dtype == torch.float32
    assert "outputs on cpu" in repr(emb)


def test_bag_takes_per_sample_weights_in_the_cast_dtype():
    ref, ours = _pair("bag")
    ours.bfloat16()
    ids, offsets = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 2])
    weights = torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    out = ours(ids, offsets, per_sample_weights=weights)
    expected = ref(ids, offsets, per_sample_weights=weights.detach().float()).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert weights.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="per_sample_weights must be float32 or the outputs' dtype"):
        ours(ids, offsets, per_sample_weights=torch.ones(4, dtype=torch.float64))
