"""Compact optimizer state (SparseAdam and Adagrad with state_dtype=,
SparseAdam's row-wise second moment): the 8-bit format against a float64
reference, the core's first step against torch's float32 step stored in
the form, many steps against float32 state within a stated bound, fused ==
unfused, checkpoints in every direction, and bad state refused."""
import os
import warnings

import pytest
import torch

import hostembed
from conftest import zipf_ids
from hostembed.optim.compact_state import Q8_BLOCK, dequantize, quantize

FORMS = {
    "bf16": dict(state_dtype=torch.bfloat16),
    "f16": dict(state_dtype=torch.float16),
    "int8": dict(state_dtype=torch.int8),
    "int8_sr": dict(state_dtype=torch.int8, state_rounding="stochastic"),
    "bf16_sr": dict(state_dtype=torch.bfloat16, state_rounding="stochastic"),
    "rowwise": dict(rowwise_exp_avg_sq=True),
    "int8_rowwise": dict(state_dtype=torch.int8, rowwise_exp_avg_sq=True),
}
DIMS = [40, 300]  # one block of scales, and two (the second partial)


def table(num_rows, dim, seed=0, **kwargs):
    torch.manual_seed(seed)
    return hostembed.Embedding(num_rows, dim, **kwargs)


def train(emb, opt, steps, seed=1, count=256):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = zipf_ids(emb.num_embeddings, count, generator=gen)
        loss = (emb(ids) - 0.5).pow(2).sum() / count
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_of(opt):
    return opt.state[opt.param_groups[0]["params"][0]]


# --- the format --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nonnegative", [False, True])
def test_quantize_within_half_a_code_of_float64(nonnegative):
    gen = torch.Generator().manual_seed(0)
    # Magnitudes over six orders within a row, and rows of every scale.
    values = torch.randn(64, 300, generator=gen, dtype=torch.float64)
    values *= torch.logspace(-6, 0, 300, dtype=torch.float64) * torch.logspace(-8, 8, 64, dtype=torch.float64)[:, None]
    values[3] = 0.0
    values[5, :10] = 0.0
    if nonnegative:
        values = values * values
    codes, scale = quantize(values.float(), nonnegative)
    assert codes.dtype == (torch.uint8 if nonnegative else torch.int8) and scale.shape == (64, 2)
    back = dequantize(codes, scale).double()
    per_column = scale.double().repeat_interleave(Q8_BLOCK, dim=1)[:, :300]

    def root(x):  # what a code is linear in (csrc/quantize.h)
        return x.sqrt().sqrt() if nonnegative else x.abs().sqrt().copysign(x)

    # Half a code of the block's scale in the root, plus float32's rounding
    # of the input, the root and the scale (a few float32 ulps of it).
    bound = 0.5 * per_column
    if nonnegative:  # a positive value under half a code is kept at code 1: a code off
        bound = torch.where(codes == 1, per_column, bound)
        assert ((values > 0) <= (codes > 0)).all(), "a positive value must not become 0"
    assert ((root(back) - root(values)).abs() <= bound * (1 + 1e-5) + 4e-7 * root(values).abs()).all()
    # The block's largest magnitude is kept to float32 rounding.
    peak = root(values).abs()
    assert torch.allclose(scale[:, 0].double() * (255 if nonnegative else 127), peak[:, :Q8_BLOCK].amax(1), rtol=1e-6)
    assert (codes[3] == 0).all() and (scale[3] == 0).all()


def test_quantize_keeps_nan_visible():
    values = torch.ones(2, 10)
    values[1, 4] = float("nan")
    codes, scale = quantize(values, False)
    back = dequantize(codes, scale)
    assert torch.isfinite(back[0]).all() and torch.isnan(back[1]).all()


# --- the core's update in each form -----------------------------------------------------------------------------

@pytest.mark.parametrize("dim", DIMS)
def test_first_step_stores_torchs_float32_moments_in_the_form(dim):
    """From zero state, one step's moments are torch's float32 moments
    (exact: the float32 run matches torch bit for bit), then stored:
    bfloat16 to nearest even, int8 as quantize() quantizes them."""
    emb = table(500, dim)
    ref_opt = hostembed.SparseAdam([emb.weight], lr=1e-2)
    train(emb, ref_opt, 1)
    ref = state_of(ref_opt)
    for dtype in (torch.bfloat16, torch.int8):
        emb = table(500, dim)
        opt = hostembed.SparseAdam([emb.weight], lr=1e-2, state_dtype=dtype)
        train(emb, opt, 1)
        got = state_of(opt)
        if dtype == torch.bfloat16:
            assert torch.equal(got["exp_avg"], ref["exp_avg"].to(dtype))
            assert torch.equal(got["exp_avg_sq"], ref["exp_avg_sq"].to(dtype))
            continue
        for key, nonnegative in (("exp_avg", False), ("exp_avg_sq", True)):
            codes, scale = quantize(ref[key], nonnegative)
            assert torch.equal(got[key], codes), key
            assert torch.equal(got[f"{key}_scale"], scale), key


@pytest.mark.parametrize("dim", DIMS)
def test_rowwise_adam_matches_a_float64_reference(dim):
    """Row-wise Adam: v += (1-b2)(mean(g^2) - v) a row, m per element,
    w -= lr*sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps); the core's float32
    against the formula in float64, 20 Zipf steps."""
    emb = table(300, dim)
    w = emb.weight.detach().double().clone()
    m, v = torch.zeros_like(w), torch.zeros(300, dtype=torch.float64)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    opt = hostembed.SparseAdam([emb.weight], lr=lr, rowwise_exp_avg_sq=True)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 21):
        ids = zipf_ids(300, 128, generator=gen)
        loss = (emb(ids) - 0.5).pow(2).sum() / 128
        opt.zero_grad()
        loss.backward()
        opt.step()
        g = torch.zeros_like(w).index_add_(0, ids, (2 * (w[ids] - 0.5) / 128))
        rows = ids.unique()
        m[rows] += (1 - b1) * (g[rows] - m[rows])
        v[rows] += (1 - b2) * (g[rows].pow(2).mean(1) - v[rows])
        step = lr * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
        w[rows] -= step * m[rows] / (v[rows].sqrt() + eps)[:, None]
    moved = (w - emb.weight.detach().double().clone()).abs()
    assert moved.max() <= 1e-5 * (1 + w.abs().max()), float(moved.max())
    assert state_of(opt)["exp_avg_sq"].shape == (300,)
    torch.testing.assert_close(state_of(opt)["exp_avg_sq"].double(), v, rtol=1e-4, atol=1e-12)


# The largest and the mean difference from float32 state after 100 steps, as
# fractions of how far float32 moved the weights (the largest and the mean).
# Measured (2026-11-27): bfloat16 0.4% and 0.1%; int8 10% and 0.7%,
# stochastic 17% and 0.9%; int8 with a row-wise second moment 0.3% and
# 0.4%. A linear int8 code moved some weights half as far (57%): the bounds
# catch that, and a diverging update by far.
BOUNDS = {"bf16": (0.02, 0.005), "bf16_sr": (0.02, 0.005), "int8": (0.25, 0.02), "int8_sr": (0.25, 0.02),
          "int8_rowwise": (0.02, 0.01)}


@pytest.mark.parametrize("form", sorted(BOUNDS))
def test_100_zipf_steps_stay_near_float32_state(form):
    emb = table(2000, 64)
    start = emb.weight.detach().clone()
    ref_opt = hostembed.SparseAdam([emb.weight], lr=1e-2)
    train(emb, ref_opt, 100)
    ref = emb.weight.detach().clone()
    kwargs = FORMS[form]
    if kwargs.get("rowwise_exp_avg_sq"):  # against the same algorithm in float32
        emb = table(2000, 64)
        train(emb, hostembed.SparseAdam([emb.weight], lr=1e-2, rowwise_exp_avg_sq=True), 100)
        ref = emb.weight.detach().clone()
    emb = table(2000, 64)
    train(emb, hostembed.SparseAdam([emb.weight], lr=1e-2, **kwargs), 100)
    path, diff = (ref - start).abs(), (emb.weight.detach() - ref).abs()
    assert torch.isfinite(emb.weight).all()
    largest, mean = BOUNDS[form]
    assert diff.max() <= largest * path.max(), f"{form}: {float(diff.max())} against a path of {float(path.max())}"
    assert diff.mean() <= mean * path.mean(), f"{form}: {float(diff.mean())} against {float(path.mean())}"


@pytest.mark.filterwarnings("ignore:SparseAdam. float16 state underflows")
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dim", DIMS)
def test_fused_gives_unfused_bits(form, dim):
    results = []
    for fused in (False, True):
        emb = table(400, dim)
        opt = hostembed.SparseAdam([emb.weight], lr=1e-2, fused=fused, **FORMS[form])
        train(emb, opt, 4)
        results.append((emb.weight.detach().clone(), {k: v.clone() for k, v in state_of(opt).items()
                                                      if torch.is_tensor(v)}))
    assert torch.equal(results[0][0], results[1][0])
    for key in results[0][1]:
        assert torch.equal(results[0][1][key], results[1][1][key]), key


def test_bag_fused_gives_unfused_bits_with_a_bfloat16_table():
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        bag = hostembed.EmbeddingBag(300, 48, mode="sum", dtype=torch.bfloat16)
        opt = hostembed.SparseAdam([bag.weight], lr=1e-2, fused=fused, state_dtype=torch.int8,
                                   rowwise_exp_avg_sq=True)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            ids = zipf_ids(300, 64, generator=gen)
            out = bag(ids, torch.arange(0, 64, 4))
            opt.zero_grad()
            out.float().pow(2).sum().backward()
            opt.step()
        results.append((bag.weight.detach().clone(), state_of(opt)["exp_avg"].clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_adagrad_first_step_stores_the_sum_in_the_form():
    emb = table(300, 40)
    ref_opt = hostembed.Adagrad([emb.weight], lr=0.1)
    train(emb, ref_opt, 1)
    total = state_of(ref_opt)["sum"]
    for dtype in (torch.bfloat16, torch.int8):
        emb = table(300, 40)
        opt = hostembed.Adagrad([emb.weight], lr=0.1, state_dtype=dtype)
        train(emb, opt, 1)
        got = state_of(opt)
        if dtype == torch.bfloat16:
            assert torch.equal(got["sum"], total.to(dtype))
        else:
            codes, scale = quantize(total, True)
            assert torch.equal(got["sum"], codes) and torch.equal(got["sum_scale"], scale)


def test_state_bytes_per_parameter():
    """bfloat16 table, int8 exp_avg, row-wise exp_avg_sq: 2 + 1 + 8/D bytes
    a parameter (D=128: 3.06), against 12 for torch's float32 Adam."""
    emb = table(1000, 128, dtype=torch.bfloat16)
    opt = hostembed.SparseAdam([emb.weight], state_dtype=torch.int8, rowwise_exp_avg_sq=True)
    train(emb, opt, 1)
    state = opt.state_bytes()[emb.weight]
    assert state == 1000 * 128 + 1000 * 4 + 1000 * 4
    assert (state + emb.weight.numel() * 2) / emb.weight.numel() == pytest.approx(3.0625)


@pytest.mark.parametrize("named", [True, False])
def test_state_bytes_prints_each_table_by_index_name_shape_and_dtype_not_its_values(named):
    """Keyed by parameter as optimizer.state is (existing callers index it
    so), but printed without a table's values: as state_dict() numbers the
    parameters, with their names where the optimizer was given them."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"user": hostembed.Embedding(2000, 64), "head": torch.nn.Linear(64, 1),
                                 "item": hostembed.Embedding(300, 16, dtype=torch.bfloat16)})
    params = model.named_parameters() if named else model.parameters()
    opt = hostembed.SparseAdam(params, state_dtype=torch.int8)
    ids = torch.tensor([1, 5, 5, 1999])
    (model["head"](model["user"](ids)).sum() + model["item"](ids % 300).float().sum()).backward()
    opt.step()
    got = opt.state_bytes()
    # The reference: the bytes of every tensor the optimizer keeps for each table.
    expected = {p: sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
                for p in (model["user"].weight, model["item"].weight)}
    assert dict(got) == expected, f"expected {list(expected.values())} bytes, got {list(got.values())}"
    assert got[model["user"].weight] == expected[model["user"].weight]
    # user.weight, head.weight, head.bias, item.weight: the tables are params 0 and 3.
    user = "param 0 'user.weight'" if named else "param 0"
    item = "param 3 'item.weight'" if named else "param 3"
    printed = (f"{{{user} [2000, 64] float32: {expected[model['user'].weight]} bytes, "
               f"{item} [300, 16] bfloat16: {expected[model['item'].weight]} bytes}}")
    assert repr(got) == printed and str(got) == printed, f"expected {printed!r}, printed {got!r}"
    # The whole table printed (the default dict repr) would start "Parameter containing".
    assert "tensor" not in repr(got).lower() and "parameter containing" not in repr(got).lower()


# --- checkpoints --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["int8", "bf16", "int8_rowwise"])
def test_save_load_round_trip_is_bit_exact_and_trains_on_the_same(form, tmp_path):
    emb = table(400, 300)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-2, **FORMS[form])
    train(emb, opt, 3)
    path = os.path.join(tmp_path, "ckpt.pt")
    hostembed.save(path, torch.nn.ModuleDict({"e": emb}), opt)
    other = table(400, 300, seed=5)
    other_opt = hostembed.SparseAdam([other.weight], lr=1e-2, **FORMS[form])
    hostembed.load(path, torch.nn.ModuleDict({"e": other}), other_opt)
    for key, value in state_of(opt).items():
        assert torch.equal(torch.as_tensor(state_of(other_opt)[key]), torch.as_tensor(value)), key
    train(emb, opt, 2, seed=9)
    train(other, other_opt, 2, seed=9)
    assert torch.equal(emb.weight, other.weight)


def test_float32_state_loads_quantized_and_back_dequantized():
    emb = table(400, 300)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-2)
    train(emb, opt, 3)
    saved = opt.state_dict()
    compact = hostembed.SparseAdam([table(400, 300).weight], lr=1e-2, state_dtype=torch.int8)
    compact.load_state_dict(saved)
    got = state_of(compact)
    for key, nonnegative in (("exp_avg", False), ("exp_avg_sq", True)):
        codes, scale = quantize(state_of(opt)[key], nonnegative)
        assert torch.equal(got[key], codes) and torch.equal(got[f"{key}_scale"], scale)
    back = hostembed.SparseAdam([table(400, 300).weight], lr=1e-2)
    back.load_state_dict(compact.state_dict())
    assert state_of(back)["exp_avg"].dtype == torch.float32
    assert torch.equal(state_of(back)["exp_avg"], dequantize(got["exp_avg"], got["exp_avg_scale"]))
    rowwise = hostembed.SparseAdam([table(400, 300).weight], lr=1e-2, rowwise_exp_avg_sq=True)
    rowwise.load_state_dict(saved)  # the per-element second moment becomes its row's mean
    torch.testing.assert_close(state_of(rowwise)["exp_avg_sq"], state_of(opt)["exp_avg_sq"].mean(1))


def test_adagrad_state_loads_across_forms():
    emb = table(300, 40)
    opt = hostembed.Adagrad([emb.weight], lr=0.1, state_dtype=torch.int8)
    train(emb, opt, 3)
    plain = hostembed.Adagrad([table(300, 40).weight], lr=0.1)
    plain.load_state_dict(opt.state_dict())
    got = state_of(opt)
    assert torch.equal(state_of(plain)["sum"], dequantize(got["sum"], got["sum_scale"]))
    again = hostembed.Adagrad([table(300, 40).weight], lr=0.1, state_dtype=torch.int8)
    again.load_state_dict(opt.state_dict())
    assert torch.equal(state_of(again)["sum"], got["sum"])


def _saved_int8(steps=2):
    emb = table(200, 40)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-2, state_dtype=torch.int8)
    train(emb, opt, steps)
    return opt.state_dict()


@pytest.mark.parametrize("damage, error, words", [
    (lambda s: s.pop("exp_avg_scale"), ValueError, "needs 'exp_avg_scale'"),
    (lambda s: s.update(exp_avg_scale=torch.zeros(200, 2)), ValueError, "needs 'exp_avg_scale'"),
    (lambda s: s.update(exp_avg_sq_scale=torch.zeros(200, 1, dtype=torch.float64)), ValueError, "float32"),
    (lambda s: s.update(exp_avg=torch.zeros(200, 41, dtype=torch.int8)), ValueError, "shape"),
    (lambda s: s.update(exp_avg=torch.zeros(200, 40, dtype=torch.int32)), TypeError, "floating-point"),
    (lambda s: s.update(bogus=torch.zeros(1)), ValueError, "expected the keys"),
])
def test_bad_compact_state_is_refused_and_changes_nothing(damage, error, words):
    saved = _saved_int8()
    damage(saved["state"][0])
    emb = table(200, 40)
    opt = hostembed.SparseAdam([emb.weight], lr=1e-2, state_dtype=torch.int8)
    train(emb, opt, 1)
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in state_of(opt).items()}
    with pytest.raises(error, match=words):
        opt.load_state_dict(saved)
    after = state_of(opt)
    assert set(after) == set(before)
    for key, value in before.items():
        assert torch.equal(torch.as_tensor(after[key]), torch.as_tensor(value)), key


def test_options_are_checked():
    weight = table(10, 4).weight
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        hostembed.SparseAdam([weight], state_dtype=torch.float64)
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        hostembed.SparseAdam([weight], state_rounding="up")
    with pytest.raises(TypeError, match="rowwise_exp_avg_sq must be a bool"):
        hostembed.SparseAdam([weight], rowwise_exp_avg_sq=1)
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        hostembed.Adagrad([weight], state_dtype=torch.uint8)
    with pytest.warns(UserWarning, match="float16 state underflows"):
        hostembed.SparseAdam([weight], state_dtype=torch.float16)


def test_core_refuses_a_square_root_form_for_a_signed_state_and_writes_nothing():
    from hostembed._core.ops import update as update_ops
    emb = table(50, 8)
    before = emb.weight.detach().clone()
    tab = hostembed._core.table.table_of(emb.weight)
    state = {"exp_avg": (tab.zeros(dtype=torch.uint8), tab.zeros(dtype=torch.float32, width=1), False),
             "exp_avg_sq": (tab.zeros(dtype=torch.uint8), tab.zeros(dtype=torch.float32, width=1), False)}
    with pytest.raises(ValueError, match="exp_avg takes negative values"):
        update_ops.sparse_update(update_ops.ADAM, emb.weight, state, torch.tensor([1, 2]), torch.ones(2, 8),
                                 lr=0.1, step=1, maximize=False, beta1=0.9, beta2=0.999, eps=1e-8)
    assert torch.equal(emb.weight, before)


def test_float64_table_refuses_compact_state_and_writes_nothing():
    emb = table(50, 8, dtype=torch.float64)
    before = emb.weight.detach().clone()
    opt = hostembed.SparseAdam([emb.weight], state_dtype=torch.bfloat16)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="float64 table must be float64"):
        opt.step()
    assert torch.equal(emb.weight, before) and not opt.state.get(emb.weight)


@pytest.mark.parametrize("form", ["int8", "bf16", "int8_rowwise"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_row_cache_keeps_compact_state_in_its_records_with_the_uncached_bits(form, fused):
    """A table with a row cache (records in host memory) trains to the
    uncached table's bits, its records holding the codes and scales."""
    runs = []
    for cache_rows in (None, 60):
        torch.manual_seed(0)
        emb = hostembed.Embedding(300, 40, cache_rows=cache_rows, device="cpu")
        opt = hostembed.SparseAdam([emb.weight], lr=1e-2, fused=fused, **FORMS[form])
        train(emb, opt, 6, count=64)
        runs.append((emb, opt))
    (plain, plain_opt), (cached, cached_opt) = runs
    records = cached._table.cache.cached
    assert records["exp_avg"].dtype == state_of(plain_opt)["exp_avg"].dtype
    if FORMS[form].get("state_dtype") == torch.int8:
        assert records["exp_avg"].shape == (60, 40) and records["exp_avg_scale"].shape == (60, 1)
    assert torch.equal(cached.weight, plain.weight)  # reading the weight writes the records back
    mine = cached_opt.state_dict()["state"][0]
    for key, value in plain_opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("make", [lambda p: hostembed.SparseAdam(p, state_dtype=torch.int8),
                                  lambda p: hostembed.Adagrad(p, state_dtype=torch.int8)])
def test_8bit_state_on_rows_too_narrow_to_gain_says_so(make):
    """A width-1 table: a code and a float32 scale (5 bytes) against 4 as
    float32. Said once per table, and the form stays the one asked for."""
    narrow, wide = hostembed.Embedding(100, 1), hostembed.Embedding(100, 2)
    with pytest.warns(UserWarning, match=r"8-bit state of a \[100, 1\] table takes 5 bytes .* against 4"):
        opt = make(narrow.parameters())
        narrow(torch.tensor([1, 2])).sum().backward()
        opt.step()
    assert any(t.dtype in (torch.int8, torch.uint8) for t in opt.state[narrow.weight].values()
               if isinstance(t, torch.Tensor))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = make(wide.parameters())
        wide(torch.tensor([1, 2])).sum().backward()
        opt.step()
