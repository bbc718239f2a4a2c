"""hostembed.SGD and hostembed.Adagrad against torch's, and RowWiseAdagrad
against a float64 reference of its formula."""
import numpy as np
import pytest
import torch
from torch import nn

import hostembed
from conftest import pair, zipf_ids

OPTIMIZERS = {
    "sgd": (hostembed.SGD, torch.optim.SGD, dict(lr=0.05)),
    "sgd-maximize": (hostembed.SGD, torch.optim.SGD, dict(lr=0.05, maximize=True)),
    "adagrad": (hostembed.Adagrad, torch.optim.Adagrad, dict(lr=0.05)),
    "adagrad-options": (hostembed.Adagrad, torch.optim.Adagrad,
                        dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-6, maximize=True)),
}


def batches(num_rows, dim, steps, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(zipf_ids(num_rows, batch, generator=gen), torch.randn(batch, dim, generator=gen))
            for _ in range(steps)]


def train(emb, opt, data, dtype=torch.float32):
    for ids, g in data:
        opt.zero_grad()
        emb(ids).backward(g.to(dtype))
        opt.step()


def state_of(opt, p):
    return {k: v.double() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fifty_zipf_steps_match_torch(name, threads):
    # Ours differs from torch only in the order a duplicate row's gradients
    # are added (torch's SGD adds each occurrence to the weight; both sum
    # them for Adagrad, possibly in another order) and in torch's vectorised
    # sqrt (not always correctly rounded). Against float64 training, our
    # float32 error must stay within a small multiple of torch's own.
    ours_cls, torch_cls, hyper = OPTIMIZERS[name]
    num_rows, dim = 3000, 16
    ref, ours = pair(num_rows, dim, sparse=True)
    exact = nn.Embedding(num_rows, dim, sparse=True, _weight=ref.weight.detach().double().clone())
    data = batches(num_rows, dim, steps=50, batch=2048)
    opts = {"exact": torch_cls(exact.parameters(), **hyper), "torch": torch_cls(ref.parameters(), **hyper),
            "ours": ours_cls(ours.parameters(), **hyper)}
    train(exact, opts["exact"], data, torch.float64)
    train(ref, opts["torch"], data)
    train(ours, opts["ours"], data)
    assert set(opts["ours"].state[ours.weight]) == set(opts["torch"].state[ref.weight])
    values = {
        "exact": {"weight": exact.weight.detach(), **state_of(opts["exact"], exact.weight)},
        "torch": {"weight": ref.weight.detach().double(), **state_of(opts["torch"], ref.weight)},
        "ours": {"weight": ours.weight.detach().double(), **state_of(opts["ours"], ours.weight)},
    }
    assert set(values["ours"]) == set(values["exact"])
    for key, exact_v in values["exact"].items():
        torch_err = (values["torch"][key] - exact_v).abs().max().item()
        ours_err = (values["ours"][key] - exact_v).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-7, f"{key}: error {ours_err:.3g} vs torch's {torch_err:.3g}"
    if "adagrad" in name:
        assert torch.equal(opts["ours"].state[ours.weight]["step"], opts["torch"].state[ref.weight]["step"])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_distinct_rows_give_torch_bits_or_an_ulp(name):
    # With one occurrence per row there is no summation order to differ:
    # SGD is torch's fused multiply-add, bit for bit; Adagrad's sum is bit
    # for bit, its weights within an ulp or two (torch's vectorised sqrt).
    ours_cls, torch_cls, hyper = OPTIMIZERS[name]
    ref, ours = pair(400, 24, sparse=True)
    ref_opt, opt = torch_cls(ref.parameters(), **hyper), ours_cls(ours.parameters(), **hyper)
    fused = ours.weight.detach().double()
    alpha = torch.tensor(-hyper["lr"] * (-1 if hyper.get("maximize") else 1), dtype=torch.float32).double()
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.randperm(400, generator=gen)[:250]
        g = torch.randn(250, 24, generator=gen)
        train(ours, opt, [(ids, g)])
        train(ref, ref_opt, [(ids, g)])
        # w + alpha * g rounded once, as a fused multiply-add does: the
        # float32 product is exact in float64, and these sums round to the
        # same float32 as the exact one.
        fused[ids] = (fused[ids] + alpha * g.double()).float().double()
    if "sgd" in name:
        # The core's bits on any CPU; torch's own kernel fuses them too
        # where it is vectorised (AVX2, AVX-512), not in its scalar build
        # (ATEN_CPU_CAPABILITY=default), which rounds the product first.
        assert torch.equal(ours.weight.double(), fused)
        if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
            assert torch.equal(ours.weight, ref.weight)
        else:
            assert ours.weight.abs().max() < 8
            torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=4.8e-7)  # an ulp below 8
    else:
        assert torch.equal(opt.state[ours.weight]["sum"], ref_opt.state[ref.weight]["sum"])
        torch.testing.assert_close(ours.weight, ref.weight, rtol=5e-7, atol=1e-7)


def rowwise_reference(w, row_sum, steps, lr, eps, maximize):
    """Row-wise Adagrad in float64 on coalesced gradients."""
    w, row_sum = w.double().clone(), row_sum.double().clone()
    for rows, g in steps:
        g = g.double() * (-1.0 if maximize else 1.0)
        row_sum[rows] += (g * g).mean(dim=1)
        w[rows] -= (lr / (row_sum[rows].sqrt() + eps))[:, None] * g
    return w, row_sum


@pytest.mark.parametrize("hyper", [dict(lr=0.05), dict(lr=0.1, eps=1e-3, initial_accumulator_value=0.5,
                                                        maximize=True)], ids=["default", "options"])
@pytest.mark.parametrize("dim", [16, 300])
def test_rowwise_adagrad_fifty_steps_against_float64(hyper, dim, threads):
    num_rows = 2000
    torch.manual_seed(0)
    emb = hostembed.Embedding(num_rows, dim)
    start = emb.weight.detach().clone()
    opt = hostembed.RowWiseAdagrad(emb.parameters(), **hyper)
    seen = []
    for ids, g in batches(num_rows, dim, steps=50, batch=1024):
        opt.zero_grad()
        emb(ids).backward(g)
        grad = emb.weight.grad.coalesce()
        seen.append((grad._indices()[0], grad._values()))
        opt.step()
    state = opt.state[emb.weight]
    assert state["step"] == 50 and state["row_sum"].shape == (num_rows,) and state["row_sum"].dtype == torch.float32
    init = torch.full((num_rows,), float(hyper.get("initial_accumulator_value", 0.0)))
    w64, s64 = rowwise_reference(start, init, seen, hyper["lr"], hyper.get("eps", 1e-10), hyper.get("maximize", False))
    # float32 against float64: each step's rounding, a few ulps of the
    # values over 50 steps (no summation-order freedom: the reference sums
    # the same coalesced gradient).
    assert (state["row_sum"].double() - s64).abs().max() <= 1e-5 * s64.abs().max()
    assert (emb.weight.detach().double() - w64).abs().max() <= 2e-5 * w64.abs().max()
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[torch.cat([rows for rows, _ in seen])] = False
    assert torch.equal(emb.weight.detach()[untouched], start[untouched])


@pytest.mark.parametrize("dim", [8, 21, 300])
def test_rowwise_adagrad_update_is_the_float32_formula(dim):
    # One step, compared bit for bit with the documented float32 order: the
    # squares in 8 lanes (column j in lane j mod 8), lanes added pairwise.
    emb = hostembed.Embedding(50, dim)
    start = emb.weight.detach().clone()
    opt = hostembed.RowWiseAdagrad(emb.parameters(), lr=0.3, eps=1e-4)
    ids = torch.tensor([3, 7, 3, 40])
    emb(ids).backward(torch.randn(4, dim) * 3)
    grad = emb.weight.grad.coalesce()
    opt.step()
    f = np.float32
    rows, g = grad._indices()[0].numpy(), grad._values().numpy()
    lane = [np.zeros(len(rows), dtype=f) for _ in range(8)]
    for j in range(dim):
        lane[j % 8] = lane[j % 8] + g[:, j] * g[:, j]
    squares = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))
    row_sum = f(0) + squares / f(dim)
    step = -(f(0.3) / (np.sqrt(row_sum) + f(1e-4)))
    expected = start.numpy().copy()
    expected[rows] = expected[rows] + g * step[:, None]
    assert np.array_equal(emb.weight.detach().numpy(), expected)
    assert np.array_equal(opt.state[emb.weight]["row_sum"].numpy()[rows], row_sum)


def test_other_parameters_go_through_torch():
    # A host table and dense layers in one optimizer: the dense ones get
    # torch's own step (with momentum, in their own group).
    torch.manual_seed(0)
    emb, lin = hostembed.Embedding(100, 4), nn.Linear(4, 1)
    ref_lin = nn.Linear(4, 1)
    ref_lin.load_state_dict(lin.state_dict())
    opt = hostembed.SGD([{"params": emb.parameters()}, {"params": lin.parameters(), "momentum": 0.9}], lr=0.1)
    ref_opt = torch.optim.SGD(ref_lin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        ids = torch.randint(0, 100, (32,))
        rows = emb(ids).detach()
        opt.zero_grad()
        ref_opt.zero_grad()
        lin(emb(ids)).sum().backward()
        ref_lin(rows).sum().backward()
        opt.step()
        ref_opt.step()
    assert torch.equal(lin.weight, ref_lin.weight) and torch.equal(lin.bias, ref_lin.bias)
    assert emb.weight.grad is not None, "step() leaves the gradients where they were"

    g_emb = hostembed.Embedding(10, 3)
    ada = hostembed.Adagrad([{"params": g_emb.parameters()}, {"params": lin.parameters(), "weight_decay": 0.1}])
    (g_emb(torch.tensor([1, 2])).sum() + lin.weight.sum()).backward()
    ada.step()
    assert ada.state[lin.weight]["step"] == 1 and ada.state[g_emb.weight]["step"] == 1


@pytest.mark.parametrize("make, message", [
    (lambda p: hostembed.SGD(p, lr=0.1, momentum=0.9), "momentum=0.9 with a hostembed table"),
    (lambda p: hostembed.SGD(p, lr=0.1, weight_decay=0.01), "weight_decay=0.01 with a hostembed table"),
    (lambda p: hostembed.Adagrad(p, weight_decay=0.01), "does not take weight decay with sparse gradients"),
    (lambda p: hostembed.Adagrad(p, differentiable=True), "differentiable implementation does not take"),
])
def test_hyperparameters_that_touch_every_row_are_refused(make, message):
    emb = hostembed.Embedding(10, 3)
    with pytest.raises(ValueError, match=message):
        make(emb.parameters())


def test_rowwise_adagrad_refuses_a_negative_learning_rate():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        hostembed.RowWiseAdagrad(hostembed.Embedding(3, 2).parameters(), lr=-1.0)


@pytest.mark.parametrize("make", [lambda p: hostembed.SGD(p, lr=0.1), lambda p: hostembed.Adagrad(p),
                                  lambda p: hostembed.RowWiseAdagrad(p)], ids=["sgd", "adagrad", "rowwise"])
def test_a_bad_gradient_changes_nothing(make):
    emb = hostembed.Embedding(20, 4)
    opt = make(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    before = emb.weight.detach().clone()
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[emb.weight].items()}
    emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[3, 25]]), torch.ones(2, 4), (20, 4),
                                              check_invariants=False)
    with pytest.raises(IndexError, match="25"):
        opt.step()
    assert torch.equal(emb.weight, before)
    for key, value in state.items():
        now = opt.state[emb.weight][key]
        assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value
    emb.weight.grad = torch.ones(20, 4)
    with pytest.raises(RuntimeError, match="takes a sparse gradient"):
        opt.step()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("make", [lambda p: hostembed.SGD(p, lr=0.1), lambda p: hostembed.Adagrad(p, lr=0.1),
                                  lambda p: hostembed.RowWiseAdagrad(p, lr=0.1)], ids=["sgd", "adagrad", "rowwise"])
def test_several_tables_step_as_one_table_each_and_a_bad_one_changes_none(make):
    """One step() updates every table in one call of the core: the bits of
    one optimizer a table; an id out of range in the last table's gradient
    raises naming it, and no table (nor its state) changes."""
    tables = [hostembed.Embedding(n, d) for n, d in ((200, 8), (50, 16), (7, 3))]
    alone = [hostembed.Embedding.from_pretrained(t.weight.detach(), freeze=False) for t in tables]
    opt = make([t.weight for t in tables])
    opts = [make([t.weight]) for t in alone]
    for ids, _ in batches(50, 1, steps=3, batch=64):
        for group, optimizers in ((tables, [opt]), (alone, opts)):
            sum(t(ids % t.num_embeddings).pow(2).sum() for t in group).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    for t, a in zip(tables, alone):
        assert torch.equal(t.weight, a.weight)
    before = [t.weight.detach().clone() for t in tables]
    state = [{k: v.clone() for k, v in opt.state[t.weight].items() if isinstance(v, torch.Tensor)} for t in tables]
    for t in tables[:2]:
        t(torch.tensor([1, 2])).sum().backward()
    tables[2].weight.grad = torch.sparse_coo_tensor(torch.tensor([[3, 9]]), torch.ones(2, 3), (7, 3),
                                                    check_invariants=False)
    with pytest.raises(IndexError, match="table 2 of 3.*9"):
        opt.step()
    for t, b, s in zip(tables, before, state):
        assert torch.equal(t.weight, b)
        assert all(torch.equal(opt.state[t.weight][k], v) for k, v in s.items())


@pytest.mark.parametrize("make", [lambda p: hostembed.SGD(p, lr=0.1), lambda p: hostembed.Adagrad(p, lr=0.1),
                                  lambda p: hostembed.RowWiseAdagrad(p, lr=0.1)], ids=["sgd", "adagrad", "rowwise"])
def test_checkpoint_round_trip_resumes_bit_identically(make, tmp_path):
    data = batches(300, 8, steps=6, batch=128)
    torch.manual_seed(0)
    emb = hostembed.Embedding(300, 8)
    opt = make(emb.parameters())
    train(emb, opt, data[:3])
    hostembed.save(tmp_path / "ck.pt", emb, opt)
    train(emb, opt, data[3:])

    torch.manual_seed(1)
    other = hostembed.Embedding(300, 8)
    other_opt = make(other.parameters())
    hostembed.load(tmp_path / "ck.pt", other, other_opt)
    train(other, other_opt, data[3:])
    assert torch.equal(other.weight, emb.weight)
    for key, value in opt.state[emb.weight].items():
        assert torch.equal(torch.as_tensor(other_opt.state[other.weight][key]), torch.as_tensor(value))


def test_load_state_dict_refuses_a_bad_state_and_changes_nothing():
    emb = hostembed.Embedding(30, 4)
    opt = hostembed.RowWiseAdagrad(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    good = opt.state_dict()
    bad = {"state": {0: {"step": 1, "row_sum": torch.zeros(29)}}, "param_groups": good["param_groups"]}
    with pytest.raises(ValueError, match=r"'row_sum' has shape \[29\], expected \[30\]"):
        opt.load_state_dict(bad)
    assert opt.state[emb.weight]["step"] == 1
    sgd = hostembed.SGD(emb.parameters(), lr=0.1)
    groups = [dict(sgd.state_dict()["param_groups"][0], momentum=0.5)]
    with pytest.raises(ValueError, match="momentum=0.5 with a hostembed table"):
        sgd.load_state_dict({"state": {}, "param_groups": groups})
    assert sgd.param_groups[0]["momentum"] == 0


# ---- fused=True: the update in backward, the same bits as backward + step()

FUSABLE = {
    "SGD": lambda p, fused: hostembed.SGD(p, lr=0.2, fused=fused),
    "Adagrad": lambda p, fused: hostembed.Adagrad(p, lr=0.1, lr_decay=0.01, fused=fused),
    "RowWiseAdagrad": lambda p, fused: hostembed.RowWiseAdagrad(p, lr=0.1, fused=fused),
}


def _fused_model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "bag":
        return hostembed.EmbeddingBag(300, 16, mode="mean", padding_idx=0)
    return hostembed.Embedding(300, 16, padding_idx=0)


@pytest.mark.parametrize("module", ["embedding", "bag"])
@pytest.mark.parametrize("name", FUSABLE)
def test_fused_gives_the_bits_of_backward_then_step(name, module):
    plain, fused = _fused_model(module), _fused_model(module)
    opt_plain, opt_fused = FUSABLE[name](plain.parameters(), False), FUSABLE[name](fused.parameters(), True)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        ids = zipf_ids(300, 120, generator=gen).view(20, 6)
        for emb, opt in ((plain, opt_plain), (fused, opt_fused)):
            opt.zero_grad()
            emb(ids).sin().sum().backward()
            if emb is fused:
                assert emb.weight.grad is None, "a fused table gets no weight.grad"
            opt.step()
    assert torch.equal(fused.weight, plain.weight)
    for key, value in opt_plain.state[plain.weight].items():
        assert torch.equal(torch.as_tensor(opt_fused.state[fused.weight][key]), torch.as_tensor(value)), key
    assert not torch.equal(plain.weight, _fused_model(module).weight)


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_two_lookups_in_one_pass_and_accumulation(name):
    plain, fused = _fused_model("embedding"), _fused_model("embedding")
    opt_plain, opt_fused = FUSABLE[name](plain.parameters(), False), FUSABLE[name](fused.parameters(), True)
    a, b = torch.tensor([1, 2, 2, 7]), torch.tensor([7, 9])
    for emb, opt in ((plain, opt_plain), (fused, opt_fused)):
        (emb(a).sum() + emb(b).pow(2).sum()).backward()
        opt.step()
    assert torch.equal(fused.weight, plain.weight)
    fused(a).sum().backward()
    before = fused.weight.detach().clone()
    with pytest.raises(RuntimeError, match="gradient accumulation over several backward"):
        fused(a).sum().backward()
    assert torch.equal(fused.weight, before)


def test_a_table_has_one_fused_optimizer():
    emb = hostembed.Embedding(10, 3)
    first = hostembed.SGD(emb.parameters(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="already updated in backward by another fused optimizer"):
        hostembed.Adagrad(emb.parameters(), fused=True)
    with pytest.raises(ValueError, match="already updated in backward"):
        hostembed.SparseAdam(emb.parameters(), fused=True)
    del first  # the table is free again once its fused optimizer is gone
    hostembed.RowWiseAdagrad(emb.parameters(), fused=True)


@pytest.mark.parametrize("fused", [False, True])
def test_step_hooks_profiler_and_zero_grad_as_torch_calls_them(fused):
    """step() runs torch's global and per-optimizer hooks in torch's order
    with torch's arguments (a pre-hook may replace them), shows up in a
    profile as torch's steps do, and zero_grad() clears what torch's
    clears, whether or not the tables are fused."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    emb = hostembed.Embedding(50, 4, sparse=True)
    linear = nn.Linear(4, 1)
    opt = hostembed.SGD([emb.weight, linear.weight, linear.bias], lr=0.1, fused=fused)
    calls, closures = [], []

    def closure():
        closures.append(1)
        return torch.tensor(1.0)

    def replace(o, args, kwargs):
        calls.append(("pre", o is opt, len(args), args[0] is opt))
        return (args[0],), {"closure": closure}

    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o is opt))),
               opt.register_step_pre_hook(replace),
               opt.register_step_post_hook(lambda o, a, k: calls.append(("post", "closure" in k))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o is opt)))]
    try:
        linear(emb(torch.tensor([1, 2, 3]))).sum().backward()
        before = linear.weight.detach().clone()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == [("global pre", True), ("pre", True, 1, True), ("post", True), ("global post", True)]
    assert closures == [1]  # the pre-hook's new arguments reached step()
    assert not torch.equal(linear.weight.detach(), before)
    assert (linear.weight.grad is not None) and (emb.weight.grad is None) == fused
    opt.zero_grad()
    assert linear.weight.grad is None and linear.bias.grad is None and emb.weight.grad is None
    linear(emb(torch.tensor([4]))).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(linear.weight.grad, torch.zeros_like(linear.weight))
    with torch.profiler.profile() as prof:
        opt.step()
        opt.zero_grad()
    names = {event.name for event in prof.events()}
    assert "Optimizer.step#SGD.step" in names and "Optimizer.zero_grad#SGD.zero_grad" in names


WIDE = {
    "SparseAdam": (hostembed.SparseAdam, dict(state_dtype=torch.int8, rowwise_exp_avg_sq=True, state_rounding="stochastic",
                                             fused=True, update="cpu")),
    "Adagrad": (hostembed.Adagrad, dict(state_dtype=torch.bfloat16, state_rounding="stochastic")),
}


@pytest.mark.parametrize("name", sorted(WIDE))
def test_every_keyword_is_kept_in_defaults_and_groups_so_a_rebuild_keeps_it(name, tmp_path):
    """torch keeps every constructor keyword in defaults and each param
    group; PyKEEN rebuilds its optimizer as cls(params=..., **group). The
    rebuilt optimizer keeps hostembed's state form (8-bit, row-wise...)."""
    cls, wide = WIDE[name]
    emb = hostembed.Embedding(100, 8)
    opt = cls(emb.parameters(), lr=0.05, **wide)
    group = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    assert {k: group[k] for k in wide} == wide and {k: opt.defaults[k] for k in wide} == wide
    kept = dict(opt._wide)
    del opt  # a table has one fused optimizer
    rebuilt = cls(params=emb.parameters(), **group)
    assert rebuilt._wide == kept
    emb(torch.tensor([1, 2, 3])).sum().backward()
    rebuilt.step()
    state = rebuilt.state[emb.weight]
    first = "exp_avg" if name == "SparseAdam" else "sum"
    assert state[first].dtype == (torch.int8 if name == "SparseAdam" else torch.bfloat16)
    # Saved with torch (weights_only: dtypes are plain data) and loaded back.
    torch.save(rebuilt.state_dict(), tmp_path / "o.pt")
    saved = torch.load(tmp_path / "o.pt", weights_only=True)
    assert saved["param_groups"][0]["state_dtype"] == wide["state_dtype"]


@pytest.mark.parametrize("name", sorted(WIDE))
def test_a_group_cannot_ask_another_whole_optimizer_keyword(name):
    cls, wide = WIDE[name]
    a, b = hostembed.Embedding(10, 4), hostembed.Embedding(10, 4)
    with pytest.raises(ValueError, match="state_dtype holds for the whole optimizer"):
        cls([{"params": a.parameters()}, {"params": b.parameters(), "state_dtype": torch.float32}], **wide)
    opt = cls(a.parameters(), **wide)
    with pytest.raises(ValueError, match="state_rounding holds for the whole optimizer"):
        opt.add_param_group({"params": b.parameters(), "state_rounding": "nearest"})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", sorted(WIDE))
def test_a_state_dict_without_the_keywords_loads_and_keeps_the_optimizers_own(name):
    """A checkpoint of before (its groups without these keys), or of another
    form, loads; the groups then say this optimizer's form, into which the
    state was converted."""
    cls, wide = WIDE[name]
    emb = hostembed.Embedding(50, 4)
    plain = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    plain.step()
    old = plain.state_dict()
    for g in old["param_groups"]:
        for k in wide:
            g.pop(k, None)
    del plain
    other = hostembed.Embedding(50, 4)
    opt = cls(other.parameters(), **wide)
    opt.load_state_dict(old)
    assert {k: opt.param_groups[0][k] for k in wide} == wide
