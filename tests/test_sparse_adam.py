"""hostembed.SparseAdam against torch.optim.SparseAdam."""
import copy
import math

import numpy as np

import pytest
import torch

import hostembed
from conftest import pair, zipf_ids


def train(emb, opt, batches, grads):
    for ids, g in zip(batches, grads):
        opt.zero_grad()
        emb(ids).backward(g)
        opt.step()


def zipf_batches(num_rows, dim, steps, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batches = [zipf_ids(num_rows, batch, alpha=1.15, generator=gen) for _ in range(steps)]
    grads = [torch.randn(batch, dim, generator=gen) for _ in range(steps)]
    return batches, grads


def adam_reference_float32(w, m, v, rows, grad_values, step, lr, betas, eps, maximize):
    """torch.optim.SparseAdam's float32 operations in torch's order, in numpy
    (IEEE float32, correctly rounded sqrt) on the rows of a coalesced grad."""
    f = np.float32
    w, m, v = w.numpy().copy(), m.numpy().copy(), v.numpy().copy()
    g = grad_values.numpy() * f(-1 if maximize else 1)
    beta1, beta2 = betas
    m0, v0 = m[rows], v[rows]
    u1 = (g - m0) * f(1 - beta1)
    u2 = (g * g - v0) * f(1 - beta2)
    m[rows] = m0 + u1
    v[rows] = v0 + u2
    denom = np.sqrt(u2 + v0) + f(eps)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    w[rows] = w[rows] + ((u1 + m0) / denom) * f(-step_size)
    return torch.from_numpy(w), torch.from_numpy(m), torch.from_numpy(v)


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("hyper", [dict(lr=1e-3), dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6)], ids=["default", "custom"])
def test_steps_on_the_same_gradient_exact_and_within_an_ulp_of_torch(maximize, hyper, threads):
    # Same gradient in, so only the update arithmetic is compared: bit for
    # bit against IEEE float32 in torch's order, and against torch itself to
    # ~2 ulps (torch's vectorised CPU sqrt is sometimes 1 ulp off).
    lr, betas, eps = hyper["lr"], hyper.get("betas", (0.9, 0.999)), hyper.get("eps", 1e-8)
    ref, ours = pair(200, 24, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), maximize=maximize, **hyper)
    opt = hostembed.SparseAdam(ours.parameters(), maximize=maximize, **hyper)
    m = torch.zeros(200, 24)
    v = torch.zeros(200, 24)
    for step in range(1, 4):
        ids = torch.randint(0, 200, (150,))
        ours(ids).backward(torch.randn(150, 24))
        grad = ours.weight.grad = ours.weight.grad.coalesce()  # the same rows in for both (torch's sums)
        expected = adam_reference_float32(ours.weight.detach(), m, v, grad._indices()[0], grad._values(), step, lr,
                                          betas, eps, maximize)
        ref.weight.grad = grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        state = opt.state[ours.weight]
        assert state["step"] == step
        assert torch.equal(ours.weight.detach(), expected[0]), f"weights differ from IEEE float32 at step {step}"
        assert torch.equal(state["exp_avg"], expected[1]) and torch.equal(state["exp_avg_sq"], expected[2])
        m, v = expected[1], expected[2]
        torch.testing.assert_close(ours.weight, ref.weight, rtol=2.4e-7, atol=4e-7 * lr)
        torch.testing.assert_close(state["exp_avg"], ref_opt.state[ref.weight]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"], ref_opt.state[ref.weight]["exp_avg_sq"], rtol=0, atol=0)


def test_fifty_zipf_steps_match_torch(threads):
    # Our gradients differ from torch's only in the order duplicate rows are
    # summed. Rather than a magic tolerance, run the same training in float64
    # as the exact reference and require our float32 error to stay within a
    # small multiple of torch's own float32 error, for weights and moments.
    num_rows, dim = 3000, 16
    ref, ours = pair(num_rows, dim, sparse=True)
    exact = torch.nn.Embedding(num_rows, dim, sparse=True, _weight=ref.weight.detach().double().clone())
    batches, grads = zipf_batches(num_rows, dim, steps=50, batch=2048)
    optimizers = {
        "exact": torch.optim.SparseAdam(exact.parameters(), lr=0.01),
        "torch": torch.optim.SparseAdam(ref.parameters(), lr=0.01),
        "ours": hostembed.SparseAdam(ours.parameters(), lr=0.01),
    }
    train(exact, optimizers["exact"], batches, [g.double() for g in grads])
    train(ref, optimizers["torch"], batches, grads)
    train(ours, optimizers["ours"], batches, grads)

    def values(name, emb):
        state = optimizers[name].state[emb.weight]
        assert state["step"] == 50
        return {"weight": emb.weight.detach().double(), "exp_avg": state["exp_avg"].double(),
                "exp_avg_sq": state["exp_avg_sq"].double()}

    exact_v, torch_v, ours_v = values("exact", exact), values("torch", ref), values("ours", ours)
    for key in exact_v:
        torch_err = (torch_v[key] - exact_v[key]).abs().max().item()
        ours_err = (ours_v[key] - exact_v[key]).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-7, f"{key}: error {ours_err:.3g} vs torch's {torch_err:.3g}"


def test_training_identical_for_any_thread_count():
    batches, grads = zipf_batches(2000, 20, steps=10, batch=4096, seed=3)
    weights = []
    for n in (1, 2, 4):
        hostembed.set_num_threads(n)
        _, ours = pair(2000, 20)
        opt = hostembed.SparseAdam(ours.parameters(), lr=0.02)
        train(ours, opt, batches, grads)
        weights.append(ours.weight.detach().clone())
    assert all(torch.equal(w, weights[0]) for w in weights[1:])


def test_accumulated_gradient_of_two_backwards(threads):
    ref, ours = pair(100, 8, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1)
    for ids in (torch.tensor([3, 5, 5, 99]), torch.tensor([5, 0, 3])):
        g = torch.randn(ids.numel(), 8)
        ours(ids).backward(g)
        ref(ids).backward(g)
    assert not ours.weight.grad.is_coalesced()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-7)


def test_rows_outside_the_batch_do_not_change():
    _, ours = pair(50, 4)
    opt = hostembed.SparseAdam(ours.parameters(), lr=0.1)
    before = ours.weight.detach().clone()
    ours(torch.tensor([1, 7])).sum().backward()
    opt.step()
    changed = (ours.weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1, 7]


def test_state_keys_and_lazy_host_state():
    _, ours = pair(40, 4)
    opt = hostembed.SparseAdam(ours.parameters())
    assert len(opt.state) == 0
    ours(torch.tensor([2])).sum().backward()
    opt.step()
    state = opt.state[ours.weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"] == 1
    assert state["exp_avg"].shape == (40, 4) and state["exp_avg"].dtype == torch.float32


def test_empty_gradient_counts_a_step_like_torch():
    ref, ours = pair(10, 3, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters())
    opt = hostembed.SparseAdam(ours.parameters())
    empty = torch.empty(0, dtype=torch.long)
    ours(empty).sum().backward()
    ref(empty).sum().backward()
    opt.step()
    ref_opt.step()
    assert opt.state[ours.weight]["step"] == ref_opt.state[ref.weight]["step"] == 1
    assert torch.equal(ours.weight, ref.weight)


def test_other_sparse_parameters_get_torch_result():
    # A plain nn.Embedding(sparse=True) in the same optimizer goes through
    # torch's own implementation: identical results.
    torch.manual_seed(0)
    plain = torch.nn.Embedding(30, 5, sparse=True)
    twin = copy.deepcopy(plain)
    opt = hostembed.SparseAdam(plain.parameters(), lr=0.05)
    ref_opt = torch.optim.SparseAdam(twin.parameters(), lr=0.05)
    for _ in range(4):
        ids = torch.randint(0, 30, (12,))
        for emb, o in ((plain, opt), (twin, ref_opt)):
            o.zero_grad()
            emb(ids).pow(2).sum().backward()
            o.step()
    assert torch.equal(plain.weight, twin.weight)


def test_state_dict_round_trip_resumes_bit_identically():
    batches, grads = zipf_batches(500, 8, steps=8, batch=256, seed=5)
    _, straight = pair(500, 8)
    opt = hostembed.SparseAdam(straight.parameters(), lr=0.01)
    train(straight, opt, batches, grads)

    _, first = pair(500, 8)
    opt1 = hostembed.SparseAdam(first.parameters(), lr=0.01)
    train(first, opt1, batches[:4], grads[:4])
    emb_sd = {k: v.clone() for k, v in first.state_dict().items()}
    opt_sd = copy.deepcopy(opt1.state_dict())

    resumed = hostembed.Embedding(500, 8)
    resumed.load_state_dict(emb_sd)
    opt2 = hostembed.SparseAdam(resumed.parameters(), lr=0.01)
    opt2.load_state_dict(opt_sd)
    state = opt2.state[resumed.weight]
    assert state["step"] == 4
    assert state["exp_avg"].data_ptr() != opt_sd["state"][0]["exp_avg"].data_ptr(), "state copied into host memory"
    train(resumed, opt2, batches[4:], grads[4:])
    assert torch.equal(resumed.weight, straight.weight)
    assert torch.equal(opt2.state[resumed.weight]["exp_avg_sq"], opt.state[straight.weight]["exp_avg_sq"])


# ---- weight_decay: AdamW's decoupled decay, on the rows each step updates

def _train_with_lazy_decay(emb, opt, batches, grads, lr, weight_decay):
    """torch's SparseAdam after AdamW's decay (w *= 1 - lr * wd, first) of
    the rows of each step's gradient: the reference of the semantics."""
    for ids, g in zip(batches, grads):
        opt.zero_grad()
        emb(ids).backward(g)
        rows = emb.weight.grad.coalesce().indices()[0]
        with torch.no_grad():
            emb.weight[rows] *= 1 - lr * weight_decay
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_weight_decay_is_adamw_on_the_updated_rows(fused):
    num_rows, dim, lr, wd = 2000, 16, 0.01, 0.1
    ref, ours = pair(num_rows, dim, sparse=True)
    exact = torch.nn.Embedding(num_rows, dim, sparse=True, _weight=ref.weight.detach().double().clone())
    start = ours.weight.detach().clone()
    batches, grads = zipf_batches(num_rows, dim, steps=30, batch=1024)
    _train_with_lazy_decay(exact, torch.optim.SparseAdam(exact.parameters(), lr=lr), batches,
                           [g.double() for g in grads], lr, wd)
    _train_with_lazy_decay(ref, torch.optim.SparseAdam(ref.parameters(), lr=lr), batches, grads, lr, wd)
    opt = hostembed.SparseAdam(ours.parameters(), lr=lr, weight_decay=wd, fused=fused)
    train(ours, opt, batches, grads)
    torch_err = (ref.weight.double() - exact.weight).abs().max().item()
    ours_err = (ours.weight.double() - exact.weight).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-7, f"error {ours_err:.3g} vs torch's {torch_err:.3g}"
    touched = torch.unique(torch.cat(batches))
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[touched] = False
    assert untouched.any() and torch.equal(ours.weight[untouched], start[untouched]), "untouched rows never decay"
    # Without the decay the same training ends elsewhere: the decay ran.
    _, plain = pair(num_rows, dim, sparse=True)
    train(plain, hostembed.SparseAdam(plain.parameters(), lr=lr), batches, grads)
    assert (plain.weight - ours.weight).abs().max() > 1e-4
    assert opt.state_dict()["param_groups"][0]["weight_decay"] == wd


def test_weight_decay_refusals():
    emb, lin = hostembed.Embedding(10, 3), torch.nn.Embedding(10, 3, sparse=True)
    with pytest.raises(ValueError, match="Invalid weight_decay value: -0.1"):
        hostembed.SparseAdam(emb.parameters(), weight_decay=-0.1)
    with pytest.raises(ValueError, match="applies to hostembed tables only"):
        hostembed.SparseAdam([emb.weight, lin.weight], weight_decay=0.1)
    opt = hostembed.SparseAdam([{"params": [emb.weight], "weight_decay": 0.1},
                                {"params": [lin.weight]}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    state = opt.state_dict()
    state["param_groups"][1]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"param_groups\[1\]: weight_decay=0.5 applies to hostembed tables only"):
        opt.load_state_dict(state)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    # Edited by hand after construction: refused at the step, nothing changed.
    opt.param_groups[0]["weight_decay"] = float("nan")
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="Invalid weight_decay value: nan"):
        opt.step()
    assert torch.equal(emb.weight, before)
