"""torch's own optimizers after a plain swap (torch.nn.Embedding =
hostembed.Embedding, the script unchanged): each trains a model with a host
table to what it gives the same model with nn.Embedding(sparse=False).
Optimizers that take a row-sparse gradient get one; torch's Adam and AdamW
are stepped by the core over every row without a dense gradient (bounded
against a float64 run: torch's CPU sqrt is not correctly rounded, the
core's is); every other optimizer gets a dense gradient, so the same bits."""
import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import hostembed
from conftest import assert_adam_bound
from hostembed._core.table import table_of

N, D = 300, 16
O = torch.optim

# name: (constructor, route)
SETUPS = {
    "Adam": (lambda p: O.Adam(p, lr=1e-2), "adam"),
    "Adam weight_decay": (lambda p: O.Adam(p, lr=1e-2, weight_decay=1e-2), "adam"),
    "Adam amsgrad": (lambda p: O.Adam(p, lr=1e-2, amsgrad=True), "adam"),
    "Adam maximize": (lambda p: O.Adam(p, lr=1e-2, maximize=True), "adam"),
    "Adam foreach": (lambda p: O.Adam(p, lr=1e-2, foreach=True), "adam"),
    "AdamW": (lambda p: O.AdamW(p, lr=1e-2), "adam"),
    "RMSprop": (lambda p: O.RMSprop(p, lr=1e-2), "dense"),
    "RMSprop momentum centered": (lambda p: O.RMSprop(p, lr=1e-2, momentum=0.5, centered=True), "dense"),
    "NAdam": (lambda p: O.NAdam(p, lr=1e-2), "dense"),
    "RAdam": (lambda p: O.RAdam(p, lr=1e-2), "dense"),
    "Adamax": (lambda p: O.Adamax(p, lr=1e-2), "dense"),
    "Adadelta": (lambda p: O.Adadelta(p), "dense"),
    "Rprop": (lambda p: O.Rprop(p, lr=1e-2), "dense"),
    "ASGD": (lambda p: O.ASGD(p, lr=1e-2), "dense"),
    "Adafactor": (lambda p: O.Adafactor(p, lr=1e-2), "dense"),
    "SGD momentum weight_decay": (lambda p: O.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2), "dense"),
    "SGD momentum": (lambda p: O.SGD(p, lr=0.1, momentum=0.9), "dense"),
    "SGD fused": (lambda p: O.SGD(p, lr=0.1, fused=True), "dense"),
    "Adagrad weight_decay": (lambda p: O.Adagrad(p, lr=0.1, weight_decay=1e-2), "dense"),
    "Adagrad fused": (lambda p: O.Adagrad(p, lr=0.1, fused=True), "dense"),
    "SGD": (lambda p: O.SGD(p, lr=0.1), "sparse"),
    "Adagrad": (lambda p: O.Adagrad(p, lr=0.1), "host"),
    "SparseAdam": (lambda p: O.SparseAdam(p, lr=1e-2), "host"),
    "LBFGS": (lambda p: O.LBFGS(p, lr=0.1, max_iter=3), "sparse"),
}


class Model(nn.Module):
    def __init__(self, embedding, sparse=False):
        super().__init__()
        self.emb = embedding(N, D, sparse=sparse) if sparse else embedding(N, D)
        self.head = nn.Linear(D, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1)).squeeze(1)


def batches(steps, seed=0):
    """Batches with repeated ids and, over a few steps, rows never touched."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, N // 2, (32, 5), generator=g), torch.randn(32, generator=g)) for _ in range(steps)]


def twins(dtype=torch.float32, sparse_torch=False):
    """A torch model with nn.Embedding(sparse=False) (or sparse=True) and
    the same model with the plain swap, the same initial weights."""
    torch.manual_seed(0)
    ref = Model(nn.Embedding, sparse=sparse_torch).to(dtype)
    ours = Model(hostembed.Embedding).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def train(model, opt, data, closure_style=False):
    for ids, target in data:
        def closure():
            opt.zero_grad()
            loss = (model(ids) - target).pow(2).mean()
            loss.backward()
            return loss
        if closure_style:
            opt.step(closure)
        else:
            closure()
            opt.step()


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_torch_optimizer_trains_a_swapped_table_to_torchs_results(name):
    make, way = SETUPS[name]
    ref, ours = twins(sparse_torch=name == "SparseAdam")
    if name == "SparseAdam":  # sparse only: the table alone
        opt_ref, opt_ours = make(ref.emb.parameters()), make(ours.emb.parameters())
    else:
        opt_ref, opt_ours = make(ref.parameters()), make(ours.parameters())
    data = batches(20)
    train(ref, opt_ref, data, closure_style=name == "LBFGS")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ours, opt_ours, data, closure_style=name == "LBFGS")
    ours_warned = [w for w in caught if "takes no row-sparse gradient" in str(w.message)]
    table = table_of(ours.emb.weight)
    assert hostembed.optim.torch_optimizer_route(opt_ours, opt_ours.param_groups[0], table) == way
    assert len(ours_warned) == (1 if way == "dense" else 0), [str(w.message) for w in caught]
    assert table.dense_gradient == (way == "dense")
    assert ours.emb.weight.grad is None or ours.emb.weight.grad.is_sparse == (way != "dense")
    if way == "adam":
        # Against a float64 run of the same optimizer and data.
        ref64 = twins(torch.float64)[0]
        opt64 = make(ref64.parameters())
        train(ref64, opt64, data)
        assert_adam_bound(ours.emb.weight.detach(), ref.emb.weight.detach(), ref64.emb.weight.detach(), "weight")
        for key, value in opt_ref.state[ref.emb.weight].items():
            if key != "step":
                assert_adam_bound(opt_ours.state[ours.emb.weight][key], value, opt64.state[ref64.emb.weight][key], key)
        assert torch.equal(opt_ours.state[ours.emb.weight]["step"], opt_ref.state[ref.emb.weight]["step"])
        return
    # The same gradients into torch's own code: the same bits (the sparse
    # route as torch's sparse-gradient step, whose sums and updates round a
    # little differently from the dense step's).
    exact = way == "dense" or name == "LBFGS"
    for key, value in ref.state_dict().items():
        if exact:
            assert torch.equal(ours.state_dict()[key], value), key
        else:
            torch.testing.assert_close(ours.state_dict()[key], value, rtol=2e-6, atol=1e-7)
    for p_ref, p_ours in zip(ref.parameters(), ours.parameters()):
        assert sorted(opt_ours.state[p_ours]) == sorted(opt_ref.state[p_ref])
        for key, value in opt_ref.state[p_ref].items():
            assert_same_state(opt_ours.state[p_ours][key], value, exact, key)


def assert_same_state(mine, value, exact, key):
    """Optimizer state values (tensors, numbers, lists of them, None) equal,
    or close where not exact."""
    if isinstance(value, (list, tuple)):
        assert len(mine) == len(value), key
        for a, b in zip(mine, value):
            assert_same_state(a, b, exact, key)
    elif isinstance(value, torch.Tensor) or isinstance(mine, torch.Tensor):
        mine, value = torch.as_tensor(mine), torch.as_tensor(value)
        if value.is_sparse:
            mine, value = mine.to_dense(), value.to_dense()
        if exact:
            assert torch.equal(mine, value), key
        else:
            torch.testing.assert_close(mine, value, rtol=2e-6, atol=1e-7)
    else:
        assert mine == value, key


ADAM_FLAGS = list(itertools.product([torch.float32, torch.float64], ["Adam", "AdamW"], [0.0, 0.05], [False, True],
                                    [False, True], [(0.9, 0.999), (0.3, 0.9)]))


@pytest.mark.parametrize("dtype, kind, weight_decay, amsgrad, maximize, betas", ADAM_FLAGS)
def test_adam_over_a_host_table_matches_torch_for_every_flag(dtype, kind, weight_decay, amsgrad, maximize, betas):
    """100 steps, repeated ids, rows never touched (the upper half of the
    table), each flag; weights and every state tensor."""
    torch.manual_seed(1)
    w0 = torch.randn(N, D, dtype=dtype)
    ours = hostembed.Embedding.from_pretrained(w0.clone(), freeze=False)
    ref = nn.Embedding.from_pretrained(w0.clone(), freeze=False)
    ref64 = nn.Embedding.from_pretrained(w0.double().clone(), freeze=False)
    cls = getattr(torch.optim, kind)
    opts = [cls(m.parameters(), lr=1e-2, betas=betas, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
            for m in (ours, ref, ref64)]
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        ids = torch.randint(0, N // 2, (64,), generator=g)
        out_grad = torch.randn(64, D, dtype=torch.float64, generator=g)
        for m, opt in zip((ours, ref, ref64), opts):
            opt.zero_grad()
            m(ids).backward(out_grad.to(m.weight.dtype))
            opt.step()
    assert ours.weight.grad.is_sparse and not table_of(ours.weight).dense_gradient
    if dtype == torch.float64:  # every op but sqrt rounds as torch's
        torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-12, atol=1e-14)
    else:
        assert_adam_bound(ours.weight.detach(), ref.weight.detach(), ref64.weight.detach(), "weight")
    for key, value in opts[1].state[ref.weight].items():
        mine = opts[0].state[ours.weight][key]
        if key == "step":
            assert torch.equal(mine, value)
        elif dtype == torch.float64:
            torch.testing.assert_close(mine, value, rtol=1e-12, atol=1e-14)
        else:
            assert_adam_bound(mine, value, opts[2].state[ref64.weight][key], key)
    # Rows no batch touched move with weight decay (dense semantics), as torch's do.
    assert torch.equal(ours.weight[N // 2:], w0[N // 2:]) == (weight_decay == 0)


def test_adam_fused_and_foreach_are_taken_with_the_same_results():
    results = []
    for options in ({}, {"foreach": True}, {"fused": True}):
        torch.manual_seed(0)
        emb = hostembed.Embedding(N, D)
        opt = torch.optim.Adam(emb.parameters(), lr=1e-2, **options)
        for ids, _ in batches(10):
            opt.zero_grad()
            emb(ids).pow(2).sum().backward()
            opt.step()
        assert emb.weight.grad.is_sparse
        results.append(emb.weight.detach().clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_closure_makes_adam_take_the_dense_route_with_torchs_bits():
    ref, ours = twins()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    data = batches(5)
    train(ref, opts[0], data, closure_style=True)
    with pytest.warns(UserWarning, match="takes no row-sparse gradient"):
        train(ours, opts[1], data, closure_style=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_adam_state_dict_goes_to_torchs_adam_and_back():
    """A swapped model's Adam state_dict loads into torch.optim.Adam over
    nn.Embedding(sparse=False) and the other way; training goes on as
    if it had not moved."""
    data = batches(12)
    ref, ours = twins()
    opt_ref, opt_ours = (torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True) for m in (ref, ours))
    train(ref, opt_ref, data[:6])
    train(ours, opt_ours, data[:6])
    # hostembed -> torch, then torch -> hostembed.
    moved_ref, moved_ours = twins()
    moved_ref.load_state_dict(ours.state_dict())
    opt_moved_ref = torch.optim.Adam(moved_ref.parameters(), lr=1e-2, amsgrad=True)
    # Copies, as from a file: torch's load would share a live optimizer's tensors.
    opt_moved_ref.load_state_dict(copy.deepcopy(opt_ours.state_dict()))
    moved_ours.load_state_dict(ref.state_dict())
    opt_moved_ours = torch.optim.Adam(moved_ours.parameters(), lr=1e-2, amsgrad=True)
    opt_moved_ours.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    for model, opt in ((ref, opt_ref), (ours, opt_ours), (moved_ref, opt_moved_ref), (moved_ours, opt_moved_ours)):
        train(model, opt, data[6:])
    ref64 = twins(torch.float64)[0]
    opt64 = torch.optim.Adam(ref64.parameters(), lr=1e-2, amsgrad=True)
    train(ref64, opt64, data)
    for model in (ours, moved_ours, moved_ref):
        assert_adam_bound(model.emb.weight.detach(), ref.emb.weight.detach(), ref64.emb.weight.detach(), "weight")
    assert table_of(moved_ours.emb.weight).owns(opt_moved_ours.state[moved_ours.emb.weight]["exp_avg"])


def test_adam_checkpoints_through_hostembed_save_and_load(tmp_path):
    data = batches(10)
    _, ours = twins()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    train(ours, opt, data[:5])
    hostembed.save(tmp_path / "ckpt.pt", ours, opt)
    train(ours, opt, data[5:])
    _, resumed = twins()
    opt_resumed = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    hostembed.load(tmp_path / "ckpt.pt", resumed, opt_resumed)
    train(resumed, opt_resumed, data[5:])
    for key, value in ours.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_a_frozen_table_and_a_group_without_gradients_change_nothing():
    _, ours = twins()
    opt = torch.optim.Adam([{"params": ours.emb.parameters()}, {"params": ours.head.parameters()}], lr=1e-2)
    train(ours, opt, batches(2))
    ours.emb.weight.requires_grad_(False)
    before = ours.emb.weight.detach().clone()
    state = {k: v.clone() for k, v in opt.state[ours.emb.weight].items()}
    opt.zero_grad()
    (ours(batches(1)[0][0]) ** 2).mean().backward()
    opt.step()
    assert torch.equal(ours.emb.weight, before)
    assert all(torch.equal(opt.state[ours.emb.weight][k], v) for k, v in state.items())


def test_an_out_of_range_id_raises_and_changes_nothing():
    _, ours = twins()
    opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    train(ours, opt, batches(2))
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(IndexError, match=str(N + 5)):
        ours(torch.tensor([[1, N + 5]]))
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())


def test_half_tables_take_the_dense_route_with_torchs_results():
    """bfloat16 tables step through torch's Adam on a dense gradient. Its
    rows are the core's float32 sums rounded once, where torch's bfloat16
    backward rounds as it adds: within two bfloat16 roundings."""
    ref, ours = twins(torch.bfloat16)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    data = batches(5)
    train(ref, opts[0], data)
    with pytest.warns(UserWarning, match="takes no row-sparse gradient"):
        train(ours, opts[1], data)
    assert table_of(ours.emb.weight).dense_gradient and not ours.emb.weight.grad.is_sparse
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=2 * 2 ** -8, atol=1e-3)


def test_the_ctr_benchmark_checks_and_reports_every_route(tmp_path, monkeypatch):
    import json
    import pathlib
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "clients"))
    import ctr_adam
    out = tmp_path / "ctr.json"
    names = "torch_adam,torch_adam_fused,swap_adam,swap_adam_fused,sparse_adam"
    ctr_adam.main(["--rows", "3900", "--batch", "64", "--rounds", "2", "--epoch-batches", "4", "--contenders", names,
                   "--json", str(out)])
    report = json.loads(out.read_text())
    assert sorted(report["results"]) == sorted(names.split(","))
    for name, result in report["results"].items():
        assert result["median_ms"] > 0 and 0 < result["auc"] < 1, name
    # The exact routes were checked against the float64 run before timing.
    assert report["checks"]["swap_adam_error_vs_float64"] <= 2 * report["checks"]["torch_adam_error_vs_float64"] + 1e-9


def test_a_step_that_raised_neither_loses_nor_replays_the_hidden_gradient(monkeypatch):
    """torch's step raising after the pre-hook hid a table's gradient: a
    retried step (no new backward) applies it once; after a new backward,
    the new gradient is the one applied."""
    data = batches(3)
    ref, ours = twins()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    train(ref, opts[0], data[:1])
    train(ref, opts[0], data[2:3])
    import torch.optim.adam as adam_module
    real = adam_module.adam

    def fails(*args, **kwargs):
        raise RuntimeError("a failing step")
    monkeypatch.setattr(adam_module, "adam", fails)
    ids, target = data[0]
    opts[1].zero_grad()
    (ours(ids) - target).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="a failing step"):
        opts[1].step()
    monkeypatch.setattr(adam_module, "adam", real)
    opts[1].step()  # the retry: the hidden gradient is back, and applied once
    ids, target = data[2]
    opts[1].zero_grad()
    (ours(ids) - target).pow(2).mean().backward()
    opts[1].step()
    ref64 = twins(torch.float64)[0]
    opt64 = torch.optim.Adam(ref64.parameters(), lr=1e-2)
    train(ref64, opt64, data[:1])
    train(ref64, opt64, data[2:3])
    assert_adam_bound(ours.emb.weight.detach(), ref.emb.weight.detach(), ref64.emb.weight.detach(), "weight")
    assert opts[1].state[ours.emb.weight]["step"].item() == 2


def test_a_bad_table_gradient_is_refused_before_torch_steps_anything():
    _, ours = twins()
    opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    train(ours, opt, batches(1))
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    steps = {id(p): opt.state[p]["step"].clone() for p in ours.parameters()}
    opt.zero_grad()
    (ours(batches(1)[0][0]) ** 2).mean().backward()
    # A hand-made COO gradient listing elements (sparse_dim=2), as torch would update element-wise.
    ours.emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.ones(1), (N, D))
    with pytest.raises(RuntimeError, match="row-sparse"):
        opt.step()
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(opt.state[p]["step"], steps[id(p)]) for p in ours.parameters())


def test_grad_scaler_with_fused_adam_unscales_the_table_and_skips_inf_steps():
    """torch's GradScaler hands a fused Adam the scale and the inf flag as
    attributes: the table's step divides by the one and skips on the other,
    as torch's fused kernel does with a dense gradient."""
    ref, ours = twins()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, fused=True) for m in (ref, ours)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) for _ in range(2)]
    for step, (ids, target) in enumerate(batches(4)):
        for model, opt, scaler in zip((ref, ours), opts, scalers):
            opt.zero_grad()
            loss = (model(ids) - target).pow(2).mean() * (1e38 if step == 1 else 1.0)  # step 1 overflows
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert torch.isfinite(ours.emb.weight).all()
    assert opts[1].state[ours.emb.weight]["step"].item() == opts[0].state[ref.emb.weight]["step"].item() == 3
    ref64 = twins(torch.float64)[0]
    opt64 = torch.optim.Adam(ref64.parameters(), lr=1e-2)
    train(ref64, opt64, [b for i, b in enumerate(batches(4)) if i != 1])
    assert_adam_bound(ours.emb.weight.detach(), ref.emb.weight.detach(), ref64.emb.weight.detach(), "weight")


def test_a_traced_lookup_under_no_grad_reads_the_table():
    _, ours = twins()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        traced = torch.jit.trace(ours.emb, ids)
        other = torch.tensor([[7, 8, 9, 10, 11]])
        assert torch.equal(traced(other), ours.emb(other))


def test_the_dlrm_benchmark_checks_and_reports_every_contender(tmp_path, monkeypatch):
    import json
    import pathlib
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "clients"))
    import dlrm_step
    out = tmp_path / "dlrm.json"
    dlrm_step.main(["--rows-scale", "0.001", "--bags", "32", "--rounds", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {(r["optimizer"], r["ids"]) for r in report["results"]} == {
        (o, i) for o in ("SGD", "Adagrad", "RowWiseAdagrad") for i in ("uniform", "zipf")}
    assert all(r[k] > 0 for r in report["results"] for k in ("torch", "hostembed", "collection", "fused"))
    assert all((r["swap"] is None) == (r["optimizer"] == "RowWiseAdagrad") for r in report["results"])
    assert max(report["max_abs_diff_vs_torch"].values()) <= 1e-4


@pytest.mark.parametrize("name", ["SparseAdam", "Adagrad"])
def test_torchs_sparse_optimizers_step_a_host_table_by_the_core(name):
    # The table's rows: hostembed's own optimizer's bits (the core's update,
    # repeated rows summed in position order), with torch's state layout;
    # the dense head: torch's step.
    make = {"SparseAdam": (O.SparseAdam, hostembed.SparseAdam), "Adagrad": (O.Adagrad, hostembed.Adagrad)}[name]
    _, ours = twins()
    _, mine = twins()
    if name == "SparseAdam":
        opts = [make[0](ours.emb.parameters(), lr=1e-2), make[1](mine.emb.parameters(), lr=1e-2)]
    else:
        opts = [make[0](ours.parameters(), lr=0.1, lr_decay=0.01), make[1](mine.parameters(), lr=0.1, lr_decay=0.01)]
    data = batches(12)
    for model, opt in zip((ours, mine), opts):
        train(model, opt, data)
    assert torch.equal(ours.emb.weight, mine.emb.weight)
    state, mine_state = opts[0].state[ours.emb.weight], opts[1].state[mine.emb.weight]
    assert sorted(state) == sorted(mine_state)
    for key, value in mine_state.items():
        assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(value)), key
    table = table_of(ours.emb.weight)
    if name == "SparseAdam":
        assert state["step"] == 12 and isinstance(state["step"], int)  # torch's SparseAdam counts in an int
        assert table.owns(state["exp_avg"]) and table.owns(state["exp_avg_sq"])
    else:
        assert torch.equal(state["step"], torch.tensor(12.0)) and table.owns(state["sum"])
        assert torch.equal(ours.head.weight, mine.head.weight)  # torch's Adagrad on both heads
