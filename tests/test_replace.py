"""replace_embeddings: swapping nn.Embedding modules of a model for host tables."""
import pytest
import torch
from torch import nn

import hostembed
from hostembed._core.table import table_of


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Embedding(300, 6, padding_idx=4, max_norm=2.5, norm_type=3.0, scale_grad_by_freq=True)
        self.small = nn.Embedding(10, 6)
        self.inner = nn.Sequential(nn.Embedding(200, 6, sparse=True), nn.Linear(6, 1))

    def forward(self, ids):
        return self.inner[1](self.big(ids) + self.small(ids % 10) + self.inner[0](ids % 200))


def test_replaces_big_tables_with_same_options_and_weights():
    torch.manual_seed(0)
    model = Tower()
    reference = Tower()
    reference.load_state_dict(model.state_dict())
    model.small.weight.requires_grad_(False)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    out = hostembed.replace_embeddings(model, min_rows=100)
    assert out is model
    assert type(model.small) is nn.Embedding  # under min_rows
    for name, old in (("big", reference.big), ("inner.0", reference.inner[0])):
        new = model.get_submodule(name)
        assert isinstance(new, hostembed.Embedding) and table_of(new.weight) is not None
        for option in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                       "scale_grad_by_freq"):
            assert getattr(new, option) == getattr(old, option), (name, option)
        assert new.sparse  # as after the plain swap, whatever the torch module's flag
        assert torch.equal(new.weight.detach(), weights[name + ".weight"])
        assert new.weight.requires_grad
    ids = torch.tensor([[1, 4, 299], [4, 4, 17]])
    assert torch.equal(model(ids), reference(ids))  # max_norm renorms rows in both


def test_sparse_by_default_as_the_plain_swap_and_frozen_weights():
    model = nn.Sequential(nn.Embedding(50, 4), nn.Embedding(60, 4, _freeze=True))
    with pytest.warns(UserWarning, match="sparse=False"):
        kept = hostembed.replace_embeddings(nn.Sequential(nn.Embedding(50, 4)), sparse=None)  # keeps torch's False
    assert not kept[0].sparse
    hostembed.replace_embeddings(model)
    assert model[0].sparse and model[1].sparse
    assert model[0].weight.requires_grad and not model[1].weight.requires_grad


def test_shared_module_stays_shared_and_a_lone_embedding_is_returned():
    shared = nn.Embedding(40, 3)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    hostembed.replace_embeddings(model, sparse=True)
    assert model["a"] is model["b"][0]
    lone = nn.Embedding(40, 3)
    expected = lone.weight.detach().clone()
    new = hostembed.replace_embeddings(lone, sparse=True)
    assert isinstance(new, hostembed.Embedding) and torch.equal(new.weight.detach(), expected)


def test_half_precision_source_keeps_its_dtype():
    model = nn.Sequential(nn.Embedding(30, 5).half())
    expected = model[0].weight.detach().clone()
    hostembed.replace_embeddings(model, sparse=True)
    assert model[0].weight.dtype == torch.float16 and torch.equal(model[0].weight.detach(), expected)


def test_unshared_cpu_source_is_released_a_viewed_one_is_kept():
    owned = nn.Embedding(5000, 16)
    rows = owned.weight.detach().clone()
    holder = nn.Sequential(owned)
    hostembed.replace_embeddings(holder, sparse=True)
    assert torch.equal(holder[0].weight.detach(), rows)
    assert owned.weight.numel() == 0  # moved out, not left as a second copy

    viewed = nn.Embedding(5000, 16)
    view = viewed.weight[10:20]
    before = view.detach().clone()
    hostembed.replace_embeddings(nn.Sequential(viewed), sparse=True)
    assert viewed.weight.shape == (5000, 16) and torch.equal(view.detach(), before)


def test_meta_model_is_filled_from_a_checkpoint_without_a_second_copy(tmp_path):
    torch.manual_seed(1)
    trained = Tower()
    hostembed.replace_embeddings(trained, min_rows=100, sparse=True)
    hostembed.save(tmp_path / "c.pt", trained)

    with torch.device("meta"):
        model = Tower()
    hostembed.replace_embeddings(model, min_rows=100, sparse=True)
    assert torch.count_nonzero(model.big.weight) == 0  # a zero table, not N(0, 1) draws
    model.to_empty(device="cpu")  # the rest of the model; host tables only note the device
    assert table_of(model.big.weight) is not None
    hostembed.load(tmp_path / "c.pt", model)
    ids = torch.tensor([3, 4, 150])
    assert torch.equal(model(ids), trained(ids))


def test_trains_with_sparse_adam_after_replacement():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(100, 4, sparse=True))
    reference = nn.Sequential(nn.Embedding(100, 4, sparse=True))
    reference.load_state_dict(model.state_dict())
    hostembed.replace_embeddings(model)
    ours, theirs = hostembed.SparseAdam(model.parameters(), lr=0.1), torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    ids = torch.tensor([1, 2, 2, 7])
    for m, opt in ((model, ours), (reference, theirs)):
        m(ids).pow(2).sum().backward()
        opt.step()
    torch.testing.assert_close(model[0].weight, reference[0].weight, rtol=0, atol=1e-6)


def test_replaced_model_trains_with_torchs_adam_like_the_plain_swap_without_a_dense_gradient():
    """A model built with torch's modules (sparse=False), replaced, trains
    with torch's dense Adam to torch's results, as after the plain swap,
    and the table's gradient stays row-sparse (no table-sized tensor)."""
    def build():
        torch.manual_seed(3)
        return nn.ModuleDict({"emb": nn.Embedding(500, 8), "head": nn.Linear(8, 1)})

    reference, model = build(), build()
    hostembed.replace_embeddings(model)
    plain = hostembed.Embedding
    saved, torch.nn.Embedding = torch.nn.Embedding, plain
    try:
        swapped = build()
    finally:
        torch.nn.Embedding = saved
    assert isinstance(swapped["emb"], hostembed.Embedding)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (reference, model, swapped)]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 500, (64,), generator=g)
        target = torch.randn(64, 1, generator=g)
        for m, opt in zip((reference, model, swapped), opts):
            opt.zero_grad()
            (m["head"](m["emb"](ids)) - target).pow(2).mean().backward()
            if m is not reference:
                assert m["emb"].weight.grad.is_sparse, "a dense table-sized gradient was made"
            opt.step()
    torch.testing.assert_close(model["emb"].weight, reference["emb"].weight, rtol=2e-6, atol=1e-7)
    assert torch.equal(model["emb"].weight, swapped["emb"].weight), "the two ways train alike"
    assert torch.equal(model["head"].weight, swapped["head"].weight)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_min_rows_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="min_rows must be an int >= 0"):
        hostembed.replace_embeddings(nn.Sequential(nn.Embedding(3, 2)), min_rows=bad)


def _tied_lm(seed=0):
    torch.manual_seed(seed)
    model = nn.ModuleDict({"emb": nn.Embedding(300, 16), "head": nn.Linear(16, 300, bias=False)})
    model["head"].weight = model["emb"].weight  # GPT-2's tie
    return model


def test_a_tied_output_projection_keeps_the_tie_and_trains_as_torchs():
    reference, model = _tied_lm(), _tied_lm()
    hostembed.replace_embeddings(model)
    assert model["head"].weight is model["emb"].weight and model["head"].weight.shape == (300, 16)
    assert [id(p) for p in model.parameters()] == [id(model["emb"].weight)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 300, (8, 5), generator=g)
        for m, opt in zip((reference, model), opts):
            opt.zero_grad()
            logits = m["head"](m["emb"](ids))
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
    torch.testing.assert_close(model["emb"].weight, reference["emb"].weight, rtol=1e-5, atol=1e-6)


def test_modules_tied_to_one_weight_become_one_host_table():
    torch.manual_seed(0)
    shared = nn.Embedding(100, 4)
    other = nn.Embedding(100, 4)
    other.weight = shared.weight  # T5's encoder and decoder token tables
    model = nn.ModuleDict({"enc": shared, "dec": other})
    expected = shared.weight.detach().clone()
    hostembed.replace_embeddings(model)
    assert model["enc"] is model["dec"] and torch.equal(model["enc"].weight, expected)
    clash = nn.Embedding(100, 4, padding_idx=0)
    clash.weight = nn.Embedding(100, 4).weight
    with pytest.raises(ValueError, match="share one weight with other options"):
        hostembed.replace_embeddings(nn.ModuleDict({"a": nn.Embedding(100, 4), "b": clash,
                                                    "c": _with_weight(clash.weight)}))


def _with_weight(weight):
    emb = nn.Embedding(*weight.shape)
    emb.weight = weight
    return emb


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a tie on the GPU is refused")
def test_a_tie_on_the_gpu_is_refused_with_what_to_do():
    model = _tied_lm().cuda()
    with pytest.raises(ValueError, match="is tied to head.weight.*Untie them first"):
        hostembed.replace_embeddings(model)
