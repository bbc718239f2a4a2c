"""One hostembed optimizer for a whole model: SparseAdam, SGD, Adagrad and
RowWiseAdagrad take the dense layers' parameters too and update them as the
matching torch optimizer would (Adam, SGD, Adagrad, Adagrad), so training
with model.parameters() gives the bits of the split pair (the tables to
the hostembed optimizer, the rest to torch's), and the state_dict holds
both parts."""
import copy

import pytest
import torch
from torch import nn

import hostembed
from conftest import assert_adam_bound

N, D = 200, 8

# name: (whole-model optimizer, (table optimizer, dense optimizer) of the split pair)
PAIRS = {
    "SparseAdam": (lambda p: hostembed.SparseAdam(p, lr=1e-2),
                   (lambda p: hostembed.SparseAdam(p, lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2))),
    "SparseAdam fused": (lambda p: hostembed.SparseAdam(p, lr=1e-2, fused=True),
                         (lambda p: hostembed.SparseAdam(p, lr=1e-2, fused=True),
                          lambda p: torch.optim.Adam(p, lr=1e-2))),
    "SparseAdam maximize": (lambda p: hostembed.SparseAdam(p, lr=1e-2, betas=(0.8, 0.99), maximize=True),
                            (lambda p: hostembed.SparseAdam(p, lr=1e-2, betas=(0.8, 0.99), maximize=True),
                             lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), maximize=True))),
    "SGD": (lambda p: hostembed.SGD(p, lr=0.1),
            (lambda p: hostembed.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1))),
    "Adagrad": (lambda p: hostembed.Adagrad(p, lr=0.1),
                (lambda p: hostembed.Adagrad(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1))),
    "RowWiseAdagrad": (lambda p: hostembed.RowWiseAdagrad(p, lr=0.1, initial_accumulator_value=0.1),
                       (lambda p: hostembed.RowWiseAdagrad(p, lr=0.1, initial_accumulator_value=0.1),
                        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1))),
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = hostembed.Embedding(N, D)
        self.bag = hostembed.EmbeddingBag(N, D, mode="sum")
        self.head = nn.Sequential(nn.Linear(2 * D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids):
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(ids)], 1)).squeeze(1)


def tables(model):
    return [model.emb.weight, model.bag.weight]


def dense(model):
    return list(model.head.parameters())


def models():
    torch.manual_seed(0)
    whole = Model()
    split = copy.deepcopy(whole)
    return whole, split


def train(model, opts, steps=15, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, N, (16, 4), generator=g)
        target = torch.randn(16, generator=g)
        for opt in opts:
            opt.zero_grad()
        (model(ids) - target).pow(2).mean().backward()
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("name", list(PAIRS))
def test_one_optimizer_for_the_whole_model_gives_the_split_pairs_bits(name):
    make_whole, (make_tables, make_dense) = PAIRS[name]
    whole, split = models()
    opt_whole = make_whole(whole.parameters())
    opt_tables, opt_dense = make_tables(tables(split)), make_dense(dense(split))
    train(whole, [opt_whole])
    train(split, [opt_tables, opt_dense])
    for key, value in split.state_dict().items():
        assert torch.equal(whole.state_dict()[key], value), key
    # Both parts in the state_dict, each in its optimizer's layout.
    state = opt_whole.state_dict()["state"]
    for index, p in enumerate(dense(split)):
        assert sorted(state.get(2 + index, {})) == sorted(opt_dense.state[p])
        for key, value in opt_dense.state[p].items():
            assert torch.equal(torch.as_tensor(state[2 + index][key]), torch.as_tensor(value)), key


def test_the_dense_part_of_a_sparse_adam_state_loads_into_torchs_adam():
    whole, split = models()
    opt_whole = hostembed.SparseAdam(whole.parameters(), lr=1e-2)
    train(whole, [opt_whole], steps=5)
    saved = copy.deepcopy(opt_whole.state_dict())
    # The head's part, loaded into torch's Adam, continues as the whole optimizer does.
    split.load_state_dict(whole.state_dict())
    opt_tables = hostembed.SparseAdam(tables(split), lr=1e-2)
    opt_dense = torch.optim.Adam(dense(split), lr=1e-2)
    opt_tables.load_state_dict({"state": {0: saved["state"][0], 1: saved["state"][1]},
                                "param_groups": [dict(saved["param_groups"][0], params=[0, 1])]})
    opt_dense.load_state_dict({"state": {i: saved["state"][i + 2] for i in range(4)},
                               "param_groups": [dict(torch.optim.Adam(dense(split)).state_dict()["param_groups"][0],
                                                     lr=1e-2, params=[0, 1, 2, 3])]})
    train(whole, [opt_whole], steps=5, seed=1)
    train(split, [opt_tables, opt_dense], steps=5, seed=1)
    for key, value in split.state_dict().items():
        assert torch.equal(whole.state_dict()[key], value), key


def test_a_whole_model_optimizer_checkpoints_and_resumes(tmp_path):
    whole, _ = models()
    opt = hostembed.SparseAdam(whole.parameters(), lr=1e-2)
    train(whole, [opt], steps=4)
    hostembed.save(tmp_path / "ckpt.pt", whole, opt)
    train(whole, [opt], steps=4, seed=1)
    resumed, _ = models()
    opt_resumed = hostembed.SparseAdam(resumed.parameters(), lr=1e-2)
    hostembed.load(tmp_path / "ckpt.pt", resumed, opt_resumed)
    train(resumed, [opt_resumed], steps=4, seed=1)
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_rowwise_adagrad_loads_the_state_of_both_parts():
    whole, other = models()
    opt = hostembed.RowWiseAdagrad(whole.parameters(), lr=0.1)
    train(whole, [opt], steps=3)
    other.load_state_dict(whole.state_dict())
    opt_other = hostembed.RowWiseAdagrad(other.parameters(), lr=0.1)
    opt_other.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(whole, [opt], steps=3, seed=1)
    train(other, [opt_other], steps=3, seed=1)
    for key, value in whole.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][2] = {"step": 1, "row_sum": torch.zeros(16)}
    with pytest.raises(ValueError, match="expected the keys \\['step', 'sum'\\]"):
        opt_other.load_state_dict(bad)


def _adam_pair(cls, **options):
    """A model trained by hostembed's Adam/AdamW (options) and the same
    model with nn.Embedding(sparse=False) / nn.EmbeddingBag trained by
    torch's, with fused=True for both (hostembed's default for the dense
    part), and a float64 run of torch's."""
    torch.manual_seed(0)
    ours = Model()
    ref = nn.Module()
    ref.emb, ref.bag, ref.head = nn.Embedding(N, D), nn.EmbeddingBag(N, D, mode="sum"), copy.deepcopy(ours.head)
    ref.load_state_dict(ours.state_dict())
    ref.forward = lambda ids: ref.head(torch.cat([ref.emb(ids).mean(1), ref.bag(ids)], 1)).squeeze(1)
    ref64 = copy.deepcopy(ref).double()
    ref64.forward = lambda ids: ref64.head(torch.cat([ref64.emb(ids).mean(1), ref64.bag(ids)], 1)).squeeze(1)
    torch_cls = getattr(torch.optim, cls)
    opts = (getattr(hostembed, cls)(ours.parameters(), lr=1e-2, **options),
            torch_cls(ref.parameters(), lr=1e-2, fused=True, **options),
            torch_cls(ref64.parameters(), lr=1e-2, **options))
    return (ours, ref, ref64), opts


@pytest.mark.parametrize("cls, options", [("Adam", {}), ("Adam", {"weight_decay": 1e-2, "amsgrad": True}),
                                          ("AdamW", {}), ("AdamW", {"maximize": True})])
def test_hostembed_adam_trains_a_whole_model_to_torchs_results(cls, options):
    models, opts = _adam_pair(cls, **options)
    assert opts[0].param_groups[0]["fused"] is True  # torch's fused kernel for the dense part
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        ids = torch.randint(0, N // 2, (16, 4), generator=g)
        target = torch.randn(16, generator=g, dtype=torch.float64)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            (model(ids) - target.to(model.head[0].weight.dtype)).pow(2).mean().backward()
            opt.step()
    ours, ref, ref64 = models
    assert ours.emb.weight.grad.is_sparse and not ours.emb._table.dense_gradient
    for name in ("emb.weight", "bag.weight"):
        assert_adam_bound(ours.state_dict()[name], ref.state_dict()[name], ref64.state_dict()[name], name)
    # The dense layers: the float32 models' gradients differ in the last bits
    # (through the tables), so the same bound.
    for name, value in ref.head.state_dict().items():
        assert_adam_bound(ours.head.state_dict()[name], value, ref64.head.state_dict()[name], name)


def test_hostembed_adam_runs_closures_and_its_state_loads_into_torchs_adam():
    torch.manual_seed(0)
    model = Model()
    opt = hostembed.Adam(model.parameters(), lr=1e-2, fused=False)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, N, (16, 4), generator=g)

        def closure():
            opt.zero_grad()
            loss = model(ids).pow(2).mean()
            loss.backward()
            return loss
        opt.step(closure)
    assert model.emb.weight.grad.is_sparse and len(opt.state[model.emb.weight]) == 3
    plain = torch.optim.Adam(model.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    mirror = copy.deepcopy(model)
    mirror_opt = hostembed.Adam(mirror.parameters(), lr=1e-2, fused=False)
    mirror_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ids = torch.randint(0, N, (16, 4), generator=g)
    for m, o in ((model, plain), (mirror, mirror_opt)):  # torch's Adam through the swap's hooks, and ours
        o.zero_grad()
        m(ids).pow(2).mean().backward()
        o.step()
    for key, value in model.state_dict().items():
        assert torch.equal(mirror.state_dict()[key], value), key


def test_hostembed_adam_takes_param_groups_of_generators_and_named_parameters():
    torch.manual_seed(0)
    model = Model()
    opt = hostembed.Adam([{"params": model.emb.parameters()}, {"params": model.bag.parameters()},
                          {"params": model.head.parameters(), "lr": 1e-3}], lr=1e-2)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1, 4]
    named = hostembed.AdamW(model.named_parameters(), lr=1e-2)
    assert len(named.param_groups[0]["params"]) == 6
    before = copy.deepcopy(model.state_dict())
    train(model, [opt], steps=1)
    assert all(not torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_hostembed_adam_refuses_half_tables_and_runs_hooks_once():
    with pytest.raises(ValueError, match="steps float32 and float64 tables"):
        hostembed.Adam(hostembed.Embedding(10, 4, dtype=torch.bfloat16).parameters())
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    torch.optim.Adam(nn.Linear(2, 2).parameters())  # wraps torch's Adam.step in its hooks
    model = Model()
    opt = hostembed.Adam(model.parameters(), lr=1e-2)
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda *a: calls.append("pre")),
               register_optimizer_step_post_hook(lambda *a: calls.append("post"))]
    try:
        train(model, [opt], steps=1)
    finally:
        for h in handles:
            h.remove()
    assert calls == ["pre", "post"]


def test_adam_steps_only_the_rows_a_process_updates():
    """A table whose rows several processes share (HostTable.update_rows,
    set by hostembed.distributed.SharedEmbedding): Adam steps every row of
    the range as torch steps the whole table, and no row outside it; a
    gradient row outside the range is refused with nothing changed."""
    torch.manual_seed(0)
    start, end = 50, 120
    ref = nn.Embedding(N, D, sparse=False)
    ours = hostembed.Embedding.from_pretrained(ref.weight.detach(), freeze=False)
    ours._table.update_rows = (start, end)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = hostembed.Adam(ours.parameters(), lr=1e-2, weight_decay=0.1)
    before = ours.weight.detach().clone()
    for ids in (torch.tensor([60, 61, 61, 100]), torch.tensor([119, 50])):
        for emb, o in ((ref, ref_opt), (ours, opt)):
            emb(ids).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(ours.weight[start:end], ref.weight[start:end], rtol=2e-6, atol=1e-7)
    outside = torch.cat([torch.arange(0, start), torch.arange(end, N)])
    assert torch.equal(ours.weight.detach()[outside], before[outside])
    trained = ours.weight.detach().clone()
    state = {k: v.clone() for k, v in opt.state[ours.weight].items()}
    ours(torch.tensor([10, 60])).sum().backward()
    with pytest.raises(ValueError, match=r"outside the rows \[50, 120\)"):
        opt.step()
    assert torch.equal(ours.weight.detach(), trained)
    assert all(torch.equal(v, opt.state[ours.weight][k]) for k, v in state.items())
