"""Hostile and damaged checkpoints: hostembed.load, Embedding.load_state_dict
and SparseAdam.load_state_dict either load, or raise a documented exception
(ValueError / TypeError / RuntimeError naming the entry) and change nothing,
bit for bit: parameters, buffers, optimizer state tensors, steps and
hyperparameters. Reproducers R3, R10, R11 of the 2026-11-22 issue are the
first tests; then failures during the copy itself (a read error, a file
truncated after the checks), which must say "partially loaded" unless
nothing had been overwritten yet."""
import copy
import math
import os
import struct
import subprocess
import sys

import pytest
import torch
from torch import nn

import hostembed
from hostembed.io import checkpoint as checkpoint_module

ROWS, DIM = 6, 4


def build(seed=0, train=True):
    """The R10 model: a host table and a dense layer, SparseAdam + Adam, one step taken."""
    torch.manual_seed(seed)
    emb = hostembed.Embedding(ROWS, DIM)
    lin = nn.Linear(DIM, 1)
    model = nn.Sequential(emb, lin)
    opts = [hostembed.SparseAdam(emb.parameters(), lr=0.01), torch.optim.Adam(lin.parameters(), lr=0.01)]
    if train:
        model(torch.tensor([1, 3])).sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return model, opts


def same(a, b):
    """Bitwise equality of nested values (NaN equals NaN, -0.0 differs from 0.0)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return False
        return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                           b.detach().reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def snapshot(model, opts):
    """Everything a load may change, copied, plus the identity of each state tensor."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "table": [m.weight.data_ptr() for m in model.modules() if isinstance(m, hostembed.Embedding)],
        "groups": [copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
                   for o in opts],
        "state": [{id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in s.items()}
                   for p, s in o.state.items()} for o in opts],
        "objects": [{(id(p), k): id(v) for p, s in o.state.items() for k, v in s.items()} for o in opts],
    }


def assert_unchanged(before, model, opts):
    after = snapshot(model, opts)
    for part in before:
        assert same(before[part], after[part]), f"{part} changed"


@pytest.fixture
def base_checkpoint(tmp_path):
    """A valid checkpoint of build()'s model, and its dict with the table shifted
    by 1 so that a load that copies anything shows."""
    model, opts = build()
    path = tmp_path / "base.pt"
    hostembed.save(path, model, opts)
    ck = torch.load(path, weights_only=True)
    ck["model"]["0.weight"] += 1.0
    return ck


def load_edited(tmp_path, ck, edit):
    ck = copy.deepcopy(ck)
    edit(ck)
    path = tmp_path / "edited.pt"
    torch.save(ck, path)
    return path


# ---- R3: betas[0] == 1.0 accepted, then the next step writes -inf


def test_r3_beta1_one_is_refused_by_load(tmp_path, base_checkpoint):
    def edit(ck):
        ck["optimizer"][0]["param_groups"][0]["betas"] = (1.0, 0.999)

    path = load_edited(tmp_path, base_checkpoint, edit)
    model, opts = build()
    before = snapshot(model, opts)
    with pytest.raises(ValueError, match=r"optimizer \[0\] \(SparseAdam\): param_groups\[0\]: Invalid beta parameter "
                                         r"at index 0: expected 0 <= betas\[0\] < 1, found 1.0; nothing was loaded"):
        hostembed.load(path, model, opts)
    assert_unchanged(before, model, opts)
    # and the model still trains to finite values
    model(torch.tensor([1, 2])).sum().backward()
    opts[0].step()
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize("betas", [(1.0, 0.999), (0.9, 1.0), (-0.1, 0.9), (float("nan"), 0.9)])
def test_r3_sparse_adam_load_state_dict_refuses_betas_out_of_range(betas):
    model, opts = build()
    sd = copy.deepcopy(opts[0].state_dict())
    sd["param_groups"][0]["betas"] = betas
    before = snapshot(model, opts)
    with pytest.raises(ValueError, match=r"SparseAdam.load_state_dict: param_groups\[0\]: Invalid beta parameter"):
        opts[0].load_state_dict(sd)
    assert_unchanged(before, model, opts)


# ---- R10: hostembed.load overwrote the table, then raised


R10_CASES = {
    "sparseadam exp_avg = 0 (int)": (
        lambda ck: ck["optimizer"][0]["state"][0].__setitem__("exp_avg", 0),
        TypeError, r"optimizer \[0\] \(SparseAdam\): state of parameter 0: 'exp_avg' must be a tensor shaped like the "
                   r"parameter \[6, 4\], found int 0"),
    "adam step = None": (
        lambda ck: ck["optimizer"][1]["state"][0].__setitem__("step", None),
        TypeError, r"optimizer \[1\] \(Adam\): state of parameter 0: 'step' must be an int >= 0 or a 0-d tensor "
                   r"holding one, found None"),
    "sparseadam step = '0'": (
        lambda ck: ck["optimizer"][0]["state"][0].__setitem__("step", "0"),
        TypeError, r"'step' must be an int >= 0 or a 0-d tensor holding one, found str '0'"),
    "model 0.weight ok, 1.bias = [1]": (
        lambda ck: ck["model"].__setitem__("1.bias", [1]),
        RuntimeError, r"does not fit the model, nothing was loaded: '1.bias' must be a tensor, found list \[1\]"),
}


@pytest.mark.parametrize("case", list(R10_CASES))
def test_r10_failed_load_changes_nothing(tmp_path, base_checkpoint, case):
    edit, kind, message = R10_CASES[case]
    path = load_edited(tmp_path, base_checkpoint, edit)
    model, opts = build()
    before = snapshot(model, opts)
    with pytest.raises(kind, match=message):
        hostembed.load(path, model, opts)
    assert_unchanged(before, model, opts)


def test_r10_the_unedited_checkpoint_loads(tmp_path, base_checkpoint):
    path = load_edited(tmp_path, base_checkpoint, lambda ck: None)
    model, opts = build(seed=5)
    hostembed.load(path, model, opts)
    assert torch.equal(model[0].weight, base_checkpoint["model"]["0.weight"])
    assert opts[0].state[model[0].weight]["step"] == 1


# ---- R11: SparseAdam.load_state_dict with step '0' half-applied the state


def test_r11_sparse_adam_step_string_changes_nothing():
    model, opts = build()
    opt, weight = opts[0], model[0].weight
    sd = opt.state_dict()
    sd = {"state": {0: {"step": "0", "exp_avg": torch.ones(ROWS, DIM), "exp_avg_sq": torch.ones(ROWS, DIM)}},
          "param_groups": [dict(sd["param_groups"][0], lr=0.5)]}
    before = snapshot(model, opts)
    with pytest.raises(TypeError, match=r"SparseAdam.load_state_dict: state of parameter 0: 'step' must be an int "
                                        r">= 0 or a 0-d tensor holding one, found str '0'"):
        opt.load_state_dict(sd)
    assert_unchanged(before, model, opts)
    assert opt.state[weight]["step"] == 1 and opt.param_groups[0]["lr"] == 0.01


# ---- every field SparseAdam.load_state_dict checks


def _group(**changes):
    def edit(sd):
        sd["param_groups"][0].update(changes)
    return edit


def _state(**changes):
    def edit(sd):
        sd["state"][0].update(changes)
    return edit


def _drop_state(key):
    def edit(sd):
        del sd["state"][0][key]
    return edit


BAD_SPARSE_ADAM = [
    (_group(lr=-1.0), ValueError, r"Invalid learning rate: expected lr >= 0, found -1.0"),
    (_group(lr=float("nan")), ValueError, r"Invalid learning rate"),
    (_group(lr="0.1"), TypeError, r"'lr' must be a real number, found str '0.1'"),
    (_group(lr=None), TypeError, r"'lr' must be a real number, found None"),
    (_group(lr=torch.tensor([0.1, 0.2])), ValueError, r"'lr' is a tensor of 2 elements"),
    (_group(eps=0.0), ValueError, r"Invalid epsilon value: expected eps > 0, found 0.0"),
    (_group(eps=-1e-8), ValueError, r"Invalid epsilon value"),
    (_group(betas=(0.9,)), TypeError, r"'betas' must be a pair"),
    (_group(betas="ab"), TypeError, r"'betas' must be a pair"),
    (_group(betas=(0.9, "x")), TypeError, r"'betas\[1\]' must be a real number"),
    (_group(maximize="False"), TypeError, r"'maximize' must be True or False, found str 'False'"),
    (_group(initial_lr={"nested": [1]}), TypeError, r"'initial_lr' must be plain data"),
    (lambda sd: sd["param_groups"][0].pop("lr"), ValueError, r"the param group has no 'lr'"),
    (_state(step=-1), ValueError, r"'step' must be between 0 and"),
    (_state(step=1 << 64), ValueError, r"'step' must be between 0 and"),
    (_state(step=True), TypeError, r"'step' must be an int"),
    (_state(step=1.0), TypeError, r"'step' must be an int"),
    (_state(step=torch.tensor(1.5)), ValueError, r"'step' must be a whole number of steps, found 1.5"),
    (_state(step=torch.tensor(float("nan"))), ValueError, r"'step' must be a whole number"),
    (_state(step=torch.tensor([1])), TypeError, r"'step' must be an int >= 0 or a 0-d tensor"),
    (_state(exp_avg=torch.zeros(ROWS, DIM, dtype=torch.int32)), TypeError,
     r"'exp_avg' must be a floating-point tensor, found a \[6, 4\] torch.int32 tensor"),
    (_state(exp_avg=torch.zeros(ROWS, DIM).to_sparse()), TypeError, r"'exp_avg' must be a dense tensor"),
    (_state(exp_avg_sq=torch.zeros(ROWS, DIM + 1)), ValueError,
     r"'exp_avg_sq' of parameter 0 has shape \[6, 5\], expected \[6, 4\]"),
    (_state(exp_avg_sq=None), TypeError, r"'exp_avg_sq' must be a tensor"),
    (_state(extra=1), ValueError, r"expected the keys \['step', 'exp_avg', 'exp_avg_sq'\]"),
    (_drop_state("exp_avg_sq"), ValueError, r"expected the keys"),
    (lambda sd: sd["state"].__setitem__(7, {}), ValueError, r"'state' holds parameter id\(s\) \['7'\] that no param "
                                                            r"group lists"),
    (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[1])), ValueError,
     r"the state dict has 2 parameter group\(s\), the optimizer has 1"),
    (lambda sd: sd["param_groups"][0].__setitem__("params", [0, 0]), ValueError, r"appear more than once"),
    (lambda sd: sd["param_groups"][0].__setitem__("params", ["0"]), TypeError, r"must be a list of int parameter"),
    (lambda sd: sd.pop("state"), ValueError, r"has no 'state'"),
    (lambda sd: sd.__setitem__("state", [1]), TypeError, r"'state' must be a mapping"),
    (lambda sd: sd["state"].__setitem__(0, "junk"), TypeError, r"the state of parameter 0 must be a mapping"),
]


@pytest.mark.parametrize("edit,kind,message", BAD_SPARSE_ADAM, ids=[m[:40] for _, _, m in BAD_SPARSE_ADAM])
def test_sparse_adam_load_state_dict_refuses_and_changes_nothing(edit, kind, message):
    model, opts = build()
    sd = copy.deepcopy(opts[0].state_dict())
    sd["state"][0]["exp_avg"] = torch.full((ROWS, DIM), 7.0)  # differs from the live state
    sd["param_groups"][0]["lr"] = 0.5
    edit(sd)
    before = snapshot(model, opts)
    with pytest.raises(kind, match=message):
        opts[0].load_state_dict(sd)
    assert_unchanged(before, model, opts)


@pytest.mark.parametrize("edit,kind,message", BAD_SPARSE_ADAM, ids=[m[:40] for _, _, m in BAD_SPARSE_ADAM])
def test_hostembed_load_refuses_the_same_and_changes_nothing(tmp_path, base_checkpoint, edit, kind, message):
    path = load_edited(tmp_path, base_checkpoint, lambda ck: edit(ck["optimizer"][0]))
    model, opts = build()
    before = snapshot(model, opts)
    if "has shape" in message:  # hostembed.load's own words for a state that does not fit
        kind = RuntimeError
        message = r"'exp_avg_sq' of parameter 0 in .* has shape \[6, 5\], the parameter has \[6, 4\]"
    if "parameter group" in message:
        kind = RuntimeError
    with pytest.raises(kind, match=message):
        hostembed.load(path, model, opts)
    assert_unchanged(before, model, opts)


def test_accepted_edge_values_load():
    """lr = 0 (a scheduler's end), a 0-d tensor step, an empty state, float64 moments."""
    model, opts = build()
    opt, weight = opts[0], model[0].weight
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.0
    sd["param_groups"][0]["initial_lr"] = 0.01
    sd["state"][0]["step"] = torch.tensor(5.0)
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].double() + 1
    opt.load_state_dict(sd)
    assert opt.state[weight]["step"] == 5 and isinstance(opt.state[weight]["step"], int)
    assert opt.state[weight]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[weight]["exp_avg"], (sd["state"][0]["exp_avg"]).float())
    assert opt.param_groups[0]["lr"] == 0.0
    opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
    assert weight not in opt.state or not opt.state[weight]


def test_adam_and_sgd_hyperparameters_checked_by_hostembed_load(tmp_path, base_checkpoint):
    cases = [
        (lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("betas", (1.0, 0.9)), ValueError,
         r"optimizer \[1\] \(Adam\): param_groups\[0\]: Invalid beta parameter at index 0"),
        (lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("weight_decay", -1), ValueError,
         r"Invalid weight_decay value"),
        (lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("amsgrad", "yes"), TypeError,
         r"'amsgrad' must be True or False"),
        (lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("amsgrad", True), ValueError,
         r"the state has no 'max_exp_avg_sq'"),
        (lambda ck: ck["optimizer"][1]["state"][0].__setitem__("exp_avg", torch.zeros(3)), RuntimeError,
         r"optimizer state 'exp_avg' of parameter 0 .* has shape \[3\], the parameter has \[1, 4\]"),
        (lambda ck: ck["optimizer"][1]["state"][1].pop("exp_avg_sq"), ValueError, r"the state has no 'exp_avg_sq'"),
        (lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("params", [0]), RuntimeError,
         r"parameter groups of sizes \[1\], the optimizer has \[2\]"),
    ]
    for edit, kind, message in cases:
        path = load_edited(tmp_path, base_checkpoint, edit)
        model, opts = build()
        before = snapshot(model, opts)
        with pytest.raises(kind, match=message):
            hostembed.load(path, model, opts)
        assert_unchanged(before, model, opts)


def test_hostile_model_entries_change_nothing(tmp_path, base_checkpoint):
    cases = [
        (lambda ck: ck["model"].__setitem__("1.bias", torch.zeros(1).to_sparse()), r"'1.bias' must be a dense"),
        (lambda ck: ck["model"].__setitem__(
            "0.weight", torch.quantize_per_tensor(torch.zeros(ROWS, DIM), 0.1, 0, torch.qint8)),
         r"'0.weight' is a \[6, 4\] torch.qint8 tensor, which does not convert"),
        (lambda ck: ck["model"].__setitem__("1.weight", torch.zeros(4)), r"'1.weight' has shape \[4\] in the "
                                                                           r"checkpoint, \[1, 4\] in the model"),
        (lambda ck: ck["model"].__setitem__("extra", torch.zeros(1)), r"unexpected keys \['extra'\]"),
        (lambda ck: ck["model"].pop("1.bias"), r"missing keys \['1.bias'\]"),
        (lambda ck: ck.__setitem__("model", [1, 2]), r"'model' must be a state dict"),
        (lambda ck: ck.__setitem__("version", "1"), r"has version str '1'"),
        (lambda ck: ck.__setitem__("format", "other"), r"has format str 'other'"),
        (lambda ck: ck.__setitem__("optimizer", ck["optimizer"][:1]), r"holds the state of 1 optimizer"),
        (lambda ck: ck["optimizer"].__setitem__(1, None), r"expected an optimizer state dict"),
    ]
    for edit, message in cases:
        path = load_edited(tmp_path, base_checkpoint, edit)
        model, opts = build()
        before = snapshot(model, opts)
        with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
            hostembed.load(path, model, opts)
        assert_unchanged(before, model, opts)


def test_integer_and_1_element_entries_load_as_torch_would(tmp_path, base_checkpoint):
    def edit(ck):
        ck["model"]["0.weight"] = ck["model"]["0.weight"].round().to(torch.int64)

    path = load_edited(tmp_path, base_checkpoint, edit)
    model, opts = build()
    hostembed.load(path, model, opts)
    assert torch.equal(model[0].weight, base_checkpoint["model"]["0.weight"].round())


# ---- Embedding.load_state_dict on its own: all or nothing


def test_embedding_load_state_dict_with_unexpected_key_changes_nothing():
    emb = hostembed.Embedding(ROWS, DIM)
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "junk"'):
        emb.load_state_dict({"weight": torch.ones(ROWS, DIM), "junk": torch.zeros(1)})
    assert torch.equal(emb.weight, before)
    emb.load_state_dict({"weight": torch.ones(ROWS, DIM), "junk": torch.zeros(1)}, strict=False)
    assert torch.equal(emb.weight, torch.ones(ROWS, DIM))


@pytest.mark.parametrize("weight,message", [
    (torch.zeros(ROWS, DIM).to_sparse(), "must be a dense"),
    (torch.quantize_per_tensor(torch.zeros(ROWS, DIM), 0.1, 0, torch.qint8), "does not convert"),
    (torch.empty(ROWS, DIM, device="meta"), "meta tensor"),
    (torch.zeros(ROWS + 1, DIM), "size mismatch"),
    ([1.0] * ROWS, "expected torch.Tensor"),
])
def test_embedding_load_state_dict_refuses_and_changes_nothing(weight, message):
    emb = hostembed.Embedding(ROWS, DIM)
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match=message):
        emb.load_state_dict({"weight": weight})
    assert torch.equal(emb.weight, before)


# ---- failures while copying


def _fresh_and_trained_targets():
    fresh, fresh_opts = build(seed=3, train=False)
    trained, trained_opts = build(seed=3)
    return [(fresh, fresh_opts), (trained, trained_opts)]


def test_read_error_while_staging_a_fresh_optimizer_changes_nothing(tmp_path, monkeypatch):
    """A fresh optimizer's moments are read into new buffers before anything is overwritten."""
    model, opts = build()
    hostembed.save(tmp_path / "c.pt", model, opts)
    target, target_opts = build(seed=3, train=False)
    before = snapshot(target, target_opts)

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(checkpoint_module, "read_rows", failing)
    with pytest.raises(RuntimeError, match=r"reading the optimizer state of .* failed \(OSError: .*simulated.*\); "
                                           r"nothing was loaded"):
        hostembed.load(tmp_path / "c.pt", target, target_opts)
    assert_unchanged(before, target, target_opts)


def test_read_error_while_copying_rows_says_partially_loaded(tmp_path, monkeypatch):
    model, opts = build()
    hostembed.save(tmp_path / "c.pt", model, opts)
    target, target_opts = build(seed=3)  # trained: its moments are overwritten in place
    before = snapshot(target, target_opts)
    real = checkpoint_module.read_rows

    def failing(rows, dst, **kwargs):
        real(rows, dst, **kwargs)
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(checkpoint_module, "read_rows", failing)
    with pytest.raises(RuntimeError, match=r"failed part way \(OSError: .*simulated.*\); the model and optimizers are "
                                           r"partially loaded: the rows of '0.weight' was being overwritten .* Load a "
                                           r"checkpoint again"):
        hostembed.load(tmp_path / "c.pt", target, target_opts)
    after = snapshot(target, target_opts)
    # What the message says: the table changed; the dense layer and both optimizers did not.
    assert not same(before["model"]["0.weight"], after["model"]["0.weight"])
    assert same(before["model"]["1.bias"], after["model"]["1.bias"])
    for part in ("groups", "state", "objects"):
        assert same(before[part], after[part]), part


def test_interrupt_while_copying_passes_through_with_a_note(tmp_path, monkeypatch):
    model, opts = build()
    hostembed.save(tmp_path / "c.pt", model, opts)
    target, target_opts = build(seed=3)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "read_rows", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        hostembed.load(tmp_path / "c.pt", target, target_opts)
    assert any("partially loaded" in note for note in getattr(info.value, "__notes__", []))


def test_sparse_adam_in_place_copy_failure_says_partially_loaded(monkeypatch):
    from hostembed.optim import sparse_adam as optim

    model, opts = build()
    sd = copy.deepcopy(opts[0].state_dict())
    calls = []

    def failing(dst, src, desc):
        calls.append(desc)
        if len(calls) == 2:
            raise OSError(5, "simulated")
        dst.copy_(src)

    monkeypatch.setattr(optim, "_copy", failing)
    # _LoadPlan binds fill at construction: patch the default too
    monkeypatch.setattr(optim.LoadPlan.__init__, "__defaults__", (failing,))
    with pytest.raises(RuntimeError, match=r"copying 'exp_avg_sq' of parameter 0 into the optimizer's state failed "
                                           r"part way .* partially loaded \(exp_avg of parameter 0, part of exp_avg_sq "
                                           r"of parameter 0 overwritten; hyperparameters and steps unchanged\)"):
        opts[0].load_state_dict(sd)


def test_moments_are_loaded_in_place_and_swapped_sources_are_read_first():
    model, opts = build()
    opt, weight = opts[0], model[0].weight
    state = opt.state[weight]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_values, v_values = m.clone(), v.clone()
    # No second copy of the state: the buffers are reused.
    opt.load_state_dict({"state": {0: {"step": 3, "exp_avg": m_values + 1, "exp_avg_sq": v_values + 1}},
                         "param_groups": opt.state_dict()["param_groups"]})
    assert opt.state[weight]["exp_avg"].data_ptr() == m.data_ptr()
    assert torch.equal(m, m_values + 1)
    # exp_avg <- the current exp_avg_sq buffer and the reverse: the result is the swap.
    m_values, v_values = m.clone(), v.clone()
    opt.load_state_dict({"state": {0: {"step": 3, "exp_avg": v, "exp_avg_sq": m}},
                         "param_groups": opt.state_dict()["param_groups"]})
    assert torch.equal(opt.state[weight]["exp_avg"], v_values)
    assert torch.equal(opt.state[weight]["exp_avg_sq"], m_values)


def test_checkpoint_renamed_over_while_loading_is_not_mixed_in(tmp_path, monkeypatch):
    """Reads go through the descriptor opened first: a save() renaming a new
    checkpoint over the path meanwhile changes nothing of what loads."""
    path = tmp_path / "c.pt"
    model, opts = build()
    hostembed.save(path, model, opts)
    expected = torch.load(path, weights_only=True)
    other, other_opts = build(seed=9)
    with torch.no_grad():
        other[0].weight.add_(100)
    real = checkpoint_module._Load._check_top

    def save_meanwhile(self, checkpoint):
        real(self, checkpoint)
        hostembed.save(path, other, other_opts)

    monkeypatch.setattr(checkpoint_module._Load, "_check_top", save_meanwhile)
    target, target_opts = build(seed=3, train=False)
    hostembed.load(path, target, target_opts)
    assert torch.equal(target[0].weight, expected["model"]["0.weight"])
    assert torch.equal(target_opts[0].state[target[0].weight]["exp_avg_sq"],
                       expected["optimizer"][0]["state"][0]["exp_avg_sq"])


TRUNCATED_SCRIPT = """
import copy, os, sys, torch, hostembed
from torch import nn
from hostembed.io import checkpoint
path, fresh = sys.argv[1], sys.argv[2] == "fresh"
torch.manual_seed(0)
def build(seed):
    torch.manual_seed(seed)
    emb = hostembed.Embedding(4096, 64); lin = nn.Linear(64, 1)
    model = nn.Sequential(emb, lin)
    opts = [hostembed.SparseAdam(emb.parameters(), lr=0.01), torch.optim.Adam(lin.parameters(), lr=0.01)]
    return model, opts
def train(model, opts):
    model(torch.arange(4096)).sum().backward(); [o.step() for o in opts]; [o.zero_grad() for o in opts]
model, opts = build(0); train(model, opts)
hostembed.save(path, model, opts)
target, target_opts = build(1)
if not fresh:
    train(target, target_opts)
lin_before = target[1].weight.detach().clone()
table_before = target[0].weight.detach().clone()
real = checkpoint._Load._check_covered
def truncate_after_checks(self, *args):
    real(self, *args)
    os.truncate(path, os.path.getsize(path) // 2)   # after every check, before any copy
checkpoint._Load._check_covered = truncate_after_checks
try:
    hostembed.load(path, target, target_opts)
    print("LOADED")
except RuntimeError as exc:
    print("RAISED", exc)
print("TABLE_CHANGED", not torch.equal(target[0].weight, table_before))
print("DENSE_CHANGED", not torch.equal(target[1].weight, lin_before))
"""


@pytest.mark.parametrize("target", ["fresh", "trained"])
def test_file_truncated_after_the_checks_raises_instead_of_sigbus(tmp_path, target):
    """Host rows are read with pread, so a file cut short after the checks
    is a clean error, not a SIGBUS of the mapped pages (run in a child:
    through the mapping it would kill the process)."""
    out = subprocess.run([sys.executable, "-c", TRUNCATED_SCRIPT, str(tmp_path / "c.pt"), target],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout
    assert "RAISED" in lines and "ended early" in lines, lines
    assert "DENSE_CHANGED False" in lines
    if target == "fresh":
        # The fresh optimizer's moments are staged first: they hit the
        # truncation before anything was overwritten.
        assert "nothing was loaded" in lines and "TABLE_CHANGED False" in lines, lines
    else:
        assert "partially loaded" in lines, lines


def test_partial_files_are_never_taken_for_a_checkpoint(tmp_path):
    model, opts = build()
    hostembed.save(tmp_path / "c.pt", model, opts)
    data = (tmp_path / "c.pt").read_bytes()
    target, target_opts = build(seed=3)
    before = snapshot(target, target_opts)
    for size in (0, 10, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1):
        (tmp_path / "part.pt").write_bytes(data[:size])
        with pytest.raises(ValueError, match=r"cannot read .* as a checkpoint \(a truncated or partly written file"):
            hostembed.load(tmp_path / "part.pt", target, target_opts)
        assert_unchanged(before, target, target_opts)


def test_loading_reads_identical_bits_to_the_slow_path(tmp_path):
    """The pread route gives the same rows as copying through the mapping."""
    emb = hostembed.Embedding(1000, 33)
    opt = hostembed.SparseAdam(emb.parameters())
    emb(torch.arange(1000)).sum().backward()
    opt.step()
    hostembed.save(tmp_path / "c.pt", emb, opt)
    other = hostembed.Embedding(1000, 33)
    other_opt = hostembed.SparseAdam(other.parameters())
    hostembed.load(tmp_path / "c.pt", other, other_opt)
    assert same(other.weight.detach(), emb.weight.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert same(other_opt.state[other.weight][key], opt.state[emb.weight][key])
    assert math.isclose(other_opt.param_groups[0]["lr"], opt.param_groups[0]["lr"])


# ---- found by fuzzing / review


def test_int_hyperparameter_beyond_int64_is_refused(tmp_path, base_checkpoint):
    """torch's Adam constructor accepts weight_decay=2**64; its step then raises OverflowError."""
    path = load_edited(tmp_path, base_checkpoint,
                       lambda ck: ck["optimizer"][1]["param_groups"][0].__setitem__("weight_decay", 1 << 64))
    model, opts = build()
    before = snapshot(model, opts)
    with pytest.raises(ValueError, match=r"'weight_decay' is the int 18446744073709551616, which does not fit in 64 "
                                         r"bits"):
        hostembed.load(path, model, opts)
    assert_unchanged(before, model, opts)


def test_non_string_keys_refused_by_embedding_load_state_dict():
    emb = hostembed.Embedding(ROWS, DIM)
    before = emb.weight.detach().clone()
    with pytest.raises(TypeError, match=r"state dict keys must be strings, found 0 \(int\)"):
        emb.load_state_dict({"weight": torch.ones(ROWS, DIM), 0: torch.zeros(1)})
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.AdamW(p),
    lambda p: torch.optim.Adam(p, amsgrad=True), lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
    lambda p: torch.optim.Adagrad(p), lambda p: torch.optim.LBFGS(p), lambda p: torch.optim.Rprop(p),
    lambda p: torch.optim.ASGD(p), lambda p: torch.optim.NAdam(p), lambda p: torch.optim.RAdam(p),
    lambda p: torch.optim.Adamax(p), lambda p: torch.optim.Adadelta(p),
], ids=["sgd", "adamw", "amsgrad", "rmsprop", "adagrad", "lbfgs", "rprop", "asgd", "nadam", "radam", "adamax",
        "adadelta"])
def test_torch_optimizers_beside_sparse_adam_round_trip(tmp_path, make):
    """The checks refuse nothing a torch optimizer writes (LBFGS keeps flat
    whole-model vectors under its first parameter)."""
    def pair(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(hostembed.Embedding(ROWS, DIM), nn.Linear(DIM, 1))
        return model, [hostembed.SparseAdam(model[0].parameters()), make(model[1].parameters())]

    model, opts = pair(0)

    def closure():
        opts[1].zero_grad()
        loss = model(torch.tensor([1, 2])).sum()
        loss.backward()
        return loss

    closure()
    opts[0].step()
    opts[1].step(closure)
    hostembed.save(tmp_path / "c.pt", model, opts)
    other, other_opts = pair(1)
    hostembed.load(tmp_path / "c.pt", other, other_opts)
    assert same(snapshot(other, other_opts)["model"], snapshot(model, opts)["model"])
    saved, loaded = opts[1].state_dict(), other_opts[1].state_dict()
    assert same(saved["param_groups"], loaded["param_groups"])
    assert same(saved["state"], loaded["state"])
