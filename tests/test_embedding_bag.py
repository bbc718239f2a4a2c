"""hostembed.EmbeddingBag against torch.nn.EmbeddingBag: forward bitwise,
gradients (table and per_sample_weights) bounded against float64, every
mode x input form x per_sample_weights x padding_idx x id dtype; bad input
refused with the table unchanged; training with every optimizer; the
module protocol (from_pretrained, state_dict, copies, replace_embeddings).
Every test runs twice: small calls through torch's embedding_bag on the
table (as they go), and every call through the core's pooling."""
import copy
import pickle

import pytest
import torch
from torch import nn

import hostembed
from conftest import zipf_ids

NUM_ROWS, DIM = 60, 7


@pytest.fixture(autouse=True, params=["torch_op", "core"])
def bag_path(request, monkeypatch):
    if request.param == "core":
        from hostembed.nn.lookup import bag_cpu
        monkeypatch.setattr(bag_cpu, "TORCH_OP_MAX_BAG_IDS", -1)
    return request.param
MODES = ["sum", "mean", "max"]
FORMS = ["2d", "offsets", "include_last_offset"]


def bag_pair(mode, seed=0, **kwargs):
    """torch's nn.EmbeddingBag (dense gradient: the reference for every
    mode) and a hostembed.EmbeddingBag with the same weights."""
    torch.manual_seed(seed)
    ref = nn.EmbeddingBag(NUM_ROWS, DIM, mode=mode, **kwargs)
    torch.manual_seed(seed)
    ours = hostembed.EmbeddingBag(NUM_ROWS, DIM, mode=mode, **kwargs)
    assert torch.equal(ref.weight, ours.weight), "same seed must give torch's initial table"
    return ref, ours


def batch(form, dtype, padding_idx, weighted, seed=0):
    """(input, offsets, per_sample_weights) of one form, with repeated ids,
    empty bags (1-D forms), and padding ids when padding_idx is set."""
    gen = torch.Generator().manual_seed(seed)
    if form == "2d":
        ids = zipf_ids(NUM_ROWS, 24, generator=gen).view(6, 4)
        offsets = None
    else:
        ids = zipf_ids(NUM_ROWS, 23, generator=gen)
        offsets = torch.tensor([0, 0, 5, 6, 6, 15, 23][: 7 if form == "include_last_offset" else 6])
    if padding_idx is not None:
        ids.view(-1)[::5] = padding_idx % NUM_ROWS
    ids = ids.to(dtype)
    offsets = None if offsets is None else offsets.to(dtype)
    weights = torch.randn(ids.shape, generator=gen) if weighted else None
    return ids, offsets, weights


def float64_reference(ref, ids, offsets, weights):
    """torch's own bag in float64: (output, table gradient, weights' gradient)
    for the upstream gradient used by run()."""
    ref64 = copy.deepcopy(ref).double()
    w64 = None if weights is None else weights.double().requires_grad_()
    out = ref64(ids, offsets, per_sample_weights=w64)
    out.backward(upstream(out).double())
    return out, ref64.weight.grad, None if w64 is None else w64.grad


def upstream(out):
    return torch.linspace(-1.5, 2.0, out.numel(), dtype=out.dtype).view(out.shape)


def run(module, ids, offsets, weights):
    """(output, table gradient as dense, weights' gradient) of one backward."""
    module.zero_grad(set_to_none=True)
    weights = None if weights is None else weights.clone().requires_grad_()
    out = module(ids, offsets, per_sample_weights=weights)
    out.backward(upstream(out))
    grad = module.weight.grad
    return out, (grad.to_dense() if grad.is_sparse else grad), None if weights is None else weights.grad


def assert_within_torch_error(ours, theirs, exact, what):
    """ours is as close to float64 as torch's float32 is (2x, plus an ulp of
    the magnitude for sums torch happens to round exactly)."""
    err_torch = (theirs.double() - exact).abs().max().item()
    err_ours = (ours.double() - exact).abs().max().item()
    slack = 2 * err_torch + 1e-7 * max(exact.abs().max().item(), 1.0)
    assert err_ours <= slack, f"{what}: error {err_ours:.3g} vs torch's {err_torch:.3g}"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("padding_idx", [None, 4, -1], ids=lambda p: f"pad{p}")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)],
                         ids=["sum", "sum-psw", "mean", "max"])  # per_sample_weights: sum only (refusal below)
def test_matches_torch(mode, weighted, form, padding_idx, id_dtype):
    kwargs = {"padding_idx": padding_idx, "include_last_offset": form == "include_last_offset"}
    ref, ours = bag_pair(mode, **kwargs)
    ids, offsets, weights = batch(form, id_dtype, padding_idx, weighted)
    out_ref, grad_ref, wgrad_ref = run(ref, ids, offsets, weights)
    out, grad, wgrad = run(ours, ids, offsets, weights)
    assert ours._last_lookup_path == "cpu"
    # The same rows pooled by the same torch kernel in the same order.
    assert torch.equal(out, out_ref)
    assert ours.weight.grad.is_sparse
    out64, grad64, wgrad64 = float64_reference(ref, ids, offsets, weights)
    assert_within_torch_error(out, out_ref, out64, "output")
    assert_within_torch_error(grad, grad_ref, grad64, "table gradient")
    if padding_idx is not None:
        assert not grad[padding_idx % NUM_ROWS].any()
        assert padding_idx % NUM_ROWS not in ours.weight.grad.coalesce().indices()
    if weighted:
        assert_within_torch_error(wgrad, wgrad_ref, wgrad64, "per_sample_weights gradient")


@pytest.mark.parametrize("mode", MODES)
def test_nested_input(mode):
    ref, ours = bag_pair(mode)
    nested = torch.nested.nested_tensor([torch.tensor([1, 2, 2]), torch.tensor([5]), torch.tensor([7, 1])],
                                        layout=torch.jagged)
    assert torch.equal(ours(nested), ref(nested))


@pytest.mark.parametrize("mode", MODES)
def test_empty_bags_and_empty_input(mode):
    ref, ours = bag_pair(mode)
    for ids, offsets in [(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0, 0])),
                         (torch.tensor([3, 3]), torch.tensor([0, 2, 2])),
                         (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))]:
        out = ours(ids, offsets)
        assert torch.equal(out, ref(ids, offsets))
        out.sum().backward()
    # 2-D input with bags of length 0: zeros (torch's arange refuses step 0).
    assert torch.equal(ours(torch.empty(3, 0, dtype=torch.int64)), torch.zeros(3, DIM))


@pytest.mark.parametrize("mode", MODES)
def test_max_norm_renorms_the_rows_as_torch(mode):
    ref, ours = bag_pair(mode, max_norm=1.5, norm_type=3.0)
    ids, offsets, _ = batch("offsets", torch.int64, None, False)
    out_ref, grad_ref, _ = run(ref, ids, offsets, None)
    out, grad, _ = run(ours, ids, offsets, None)
    # Within two ulps: torch's norm sums in another order at each
    # ATEN_CPU_CAPABILITY (its scalar build: 2 ulps of a 1.3 from ours).
    torch.testing.assert_close(ours.weight, ref.weight, rtol=2.4e-7, atol=2e-7)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_scale_grad_by_freq_divides_by_each_ids_count(mode):
    # The documented semantics, which torch's CUDA kernel and nn.Embedding
    # follow; torch 2.13's CPU embedding_bag divides some rows by another
    # id's count (pytorch/pytorch#190063), so the reference is the float64
    # gradient without scaling, divided by the counts.
    ref, ours = bag_pair(mode, scale_grad_by_freq=True, padding_idx=2)
    ids, offsets, _ = batch("offsets", torch.int64, 2, False)
    _, grad, _ = run(ours, ids, offsets, None)
    ref.scale_grad_by_freq = False
    _, grad_unscaled, _ = run(ref, ids, offsets, None)
    _, grad64, _ = float64_reference(ref, ids, offsets, None)
    counts = torch.bincount(ids, minlength=NUM_ROWS).clamp(min=1).unsqueeze(1)
    assert (counts > 1).sum() > 3, "the batch must repeat ids for the test to mean anything"
    assert_within_torch_error(grad, grad_unscaled / counts, grad64 / counts, "scaled gradient")


def test_max_mode_sparse_gradient_matches_torch_dense():
    # torch refuses sparse=True with max; the host table's gradient is
    # row-sparse whatever the mode.
    ref, ours = bag_pair("max")
    ids, offsets, _ = batch("offsets", torch.int64, None, False)
    _, grad_ref, _ = run(ref, ids, offsets, None)
    _, grad, _ = run(ours, ids, offsets, None)
    assert ours.weight.grad.is_sparse
    assert torch.equal(grad, grad_ref)  # max routes each gradient element to one row: no sums


def test_dense_gradient_with_sparse_false():
    ref, _ = bag_pair("mean")
    with pytest.warns(UserWarning, match=r"hostembed.EmbeddingBag\(sparse=False\)"):
        ours = hostembed.EmbeddingBag.from_pretrained(ref.weight.detach(), freeze=False, sparse=False)
    ids, offsets, _ = batch("offsets", torch.int64, None, False)
    _, grad_ref, _ = run(ref, ids, offsets, None)
    _, grad, _ = run(ours, ids, offsets, None)
    assert not ours.weight.grad.is_sparse
    _, grad64, _ = float64_reference(ref, ids, offsets, None)
    assert_within_torch_error(grad, grad_ref, grad64, "dense gradient")


# ---- training with each optimizer, against torch's on its sparse bag

OPTIMIZERS = {
    "SparseAdam": (lambda p: hostembed.SparseAdam(p, lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
    "SparseAdam-fused": (lambda p: hostembed.SparseAdam(p, lr=0.05, fused=True),
                         lambda p: torch.optim.SparseAdam(p, lr=0.05)),
    "SGD": (lambda p: hostembed.SGD(p, lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "Adagrad": (lambda p: hostembed.Adagrad(p, lr=0.2), lambda p: torch.optim.Adagrad(p, lr=0.2)),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_trains_like_torch(mode, name):
    make_ours, make_theirs = OPTIMIZERS[name]
    ref, ours = bag_pair(mode, sparse=True, padding_idx=0)
    opt_ref, opt = make_theirs(ref.parameters()), make_ours(ours.parameters())
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        ids = zipf_ids(NUM_ROWS, 40, generator=gen)
        offsets = torch.tensor([0, 3, 3, 17, 30])
        weights = torch.rand(40, generator=gen) if mode == "sum" else None
        for module, optimizer in ((ref, opt_ref), (ours, opt)):
            optimizer.zero_grad()
            module(ids, offsets, per_sample_weights=weights).sin().sum().backward()
            optimizer.step()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours.weight, bag_pair(mode)[1].weight), "training moved nothing"


# ---- bad input: clear errors, nothing written (max_norm would renorm rows)

BAD = [
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 2])), RuntimeError, r"offsets\[0\] has to be 0"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 1])), RuntimeError,
     r"offsets must not decrease.*offsets\[2\] = 1 < offsets\[1\] = 2"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 4])), RuntimeError,
     r"offsets\[-1\] can not be greater than input's length 3"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0.0, 1.0])), TypeError,
     r"offsets must have dtype torch.int64 or torch.int32, got torch.float32"),
    (dict(input=torch.tensor([1, 2, 3])), ValueError, "offsets has to be a 1D Tensor but got None"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([[0]])), ValueError, "offsets has to be a 1D Tensor"),
    (dict(input=torch.tensor([[1, 2, 3]]), offsets=torch.tensor([0])), ValueError, "if input is 2D, then offsets"),
    (dict(input=torch.tensor([[[1]]])), ValueError, "input has to be 1D or 2D Tensor"),
    (dict(input=torch.tensor([1.0, 2.0]), offsets=torch.tensor([0])), TypeError,
     r"input must have dtype torch.int64 or torch.int32"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0]), per_sample_weights=torch.ones(2)), ValueError,
     "per_sample_weights .* must have the same shape as the input"),
    (dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0]), per_sample_weights=torch.ones(3).double()),
     RuntimeError, r"per_sample_weights to have the same type as the weight \(torch.float32\), got torch.float64"),
    (dict(input=torch.tensor([1, 2, 60]), offsets=torch.tensor([0])), IndexError, r"id 60 at position 2"),
    (dict(input=torch.tensor([1, -1]), offsets=torch.tensor([0])), IndexError, r"id -1 at position 1"),
]


@pytest.mark.parametrize("args,error,match", BAD, ids=lambda v: None)
def test_bad_input_is_refused_with_nothing_written(args, error, match):
    _, ours = bag_pair("sum", max_norm=0.5)
    before = ours.weight.detach().clone()
    with pytest.raises(error, match=match):
        ours(**args)
    assert torch.equal(ours.weight, before)


def test_include_last_offset_needs_an_offset():
    _, ours = bag_pair("sum", include_last_offset=True)
    with pytest.raises(RuntimeError, match="number of offset should be at least 1"):
        ours(torch.tensor([1]), torch.tensor([], dtype=torch.int64))


def test_per_sample_weights_are_sum_only():
    _, ours = bag_pair("mean")
    with pytest.raises(NotImplementedError, match="only supported for mode='sum' \\(got mode='mean'\\)"):
        ours(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))


def test_bad_options():
    with pytest.raises(ValueError, match="mode has to be one of sum, mean or max"):
        hostembed.EmbeddingBag(5, 2, mode="median")
    with pytest.raises(ValueError, match="max mode does not support scaling the gradient"):
        hostembed.EmbeddingBag(5, 2, mode="max", scale_grad_by_freq=True)
    bag = hostembed.EmbeddingBag(5, 2)
    bag.mode = "median"  # set after construction: refused at the call, as torch does
    with pytest.raises(ValueError, match="mode has to be one of sum, mean or max"):
        bag(torch.tensor([[1]]))
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64; dtype=torch.int64"):
        hostembed.EmbeddingBag(5, 2, dtype=torch.int64)
    for cls in (torch.nn.EmbeddingBag, hostembed.EmbeddingBag):  # torch's words for bags
        with pytest.raises(AssertionError, match="^padding_idx must be within num_embeddings"):
            cls(5, 2, padding_idx=5)


# ---- the module protocol

def test_from_pretrained_tensor_and_file(tmp_path):
    ref, _ = bag_pair("sum", padding_idx=1)
    ours = hostembed.EmbeddingBag.from_pretrained(ref.weight.detach(), mode="sum", padding_idx=1)
    assert not ours.weight.requires_grad and ours.padding_idx == 1
    torch.save({"weight": ref.weight.detach()}, tmp_path / "w.pt")
    from_file = hostembed.EmbeddingBag.from_pretrained(tmp_path / "w.pt", freeze=False, mode="max",
                                                       include_last_offset=True)
    assert from_file.weight.requires_grad and from_file.mode == "max" and from_file.include_last_offset
    ids, offsets = torch.tensor([1, 2, 9, 9]), torch.tensor([0, 1, 4])
    assert torch.equal(from_file(ids, offsets), nn.EmbeddingBag.from_pretrained(
        ref.weight.detach(), mode="max", include_last_offset=True)(ids, offsets))
    assert torch.equal(ours.weight, ref.weight)


def test_state_dict_copies_pickle_and_checkpoint(tmp_path):
    _, ours = bag_pair("mean", padding_idx=3)
    ids, offsets = torch.tensor([1, 3, 7, 7, 2]), torch.tensor([0, 2])
    expected = ours(ids, offsets)
    fresh = hostembed.EmbeddingBag(NUM_ROWS, DIM, mode="mean", padding_idx=3)
    fresh.load_state_dict(ours.state_dict())
    twin = copy.deepcopy(ours)
    unpickled = pickle.loads(pickle.dumps(ours))
    for other in (fresh, twin, unpickled):
        assert isinstance(other, hostembed.EmbeddingBag)
        assert other.weight.data_ptr() != ours.weight.data_ptr()
        assert torch.equal(other(ids, offsets), expected)
    model = nn.Sequential(ours)
    opt = hostembed.SparseAdam(model.parameters())
    model[0](ids, offsets).sum().backward()
    opt.step()
    hostembed.save(tmp_path / "c.pt", model, opt)
    loaded = nn.Sequential(hostembed.EmbeddingBag(NUM_ROWS, DIM, mode="mean", padding_idx=3))
    opt2 = hostembed.SparseAdam(loaded.parameters())
    hostembed.load(tmp_path / "c.pt", loaded, opt2)
    assert torch.equal(loaded[0].weight, ours.weight)
    assert torch.equal(opt2.state[loaded[0].weight]["exp_avg"], opt.state[ours.weight]["exp_avg"])
    assert "hostembed.EmbeddingBag(60, 7, mode='mean', padding_idx=3, table in host memory" in repr(ours)


def test_replace_embeddings_converts_bags_with_their_options_and_rows():
    torch.manual_seed(0)
    old = nn.EmbeddingBag(NUM_ROWS, DIM, mode="max", include_last_offset=True, padding_idx=2, max_norm=3.0)
    rows = old.weight.detach().clone()
    new = hostembed.replace_embeddings(nn.Sequential(old))[0]
    assert isinstance(new, hostembed.EmbeddingBag)
    for name in ("mode", "include_last_offset", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"):
        assert getattr(new, name) == getattr(old, name), name
    assert torch.equal(new.weight, rows)
    assert new.sparse is True  # row-sparse by default, as after the plain swap (sparse=None keeps the flag)


@pytest.mark.parametrize("form", ["offsets", "include_last_offset", "2d"])
@pytest.mark.parametrize("mode,scale,padding_idx", [("sum", False, 4), ("mean", True, 4), ("max", False, 4),
                                                    ("sum", True, None)])
def test_compile_fullgraph_matches_eager(form, mode, scale, padding_idx):
    # Under torch.compile the bag looks up every id with the Embedding
    # lookup op and pools with torch's embedding_bag: no graph break.
    torch._dynamo.reset()
    kwargs = {"padding_idx": padding_idx, "scale_grad_by_freq": scale, "include_last_offset": form == "include_last_offset"}
    _, eager = bag_pair(mode, **kwargs)
    _, compiled = bag_pair(mode, **kwargs)
    step = torch.compile(lambda m, i, o, w: m(i, o, per_sample_weights=w).pow(2).sum(), fullgraph=True)
    ids, offsets, weights = batch(form, torch.int64, padding_idx, mode == "sum")
    expected, got = eager(ids, offsets, per_sample_weights=weights).pow(2).sum(), step(compiled, ids, offsets, weights)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    expected.backward()
    got.backward()
    assert compiled.weight.grad.is_sparse
    torch.testing.assert_close(compiled.weight.grad.to_dense(), eager.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)


def test_compiled_bag_refuses_bad_offsets_and_a_short_last_offset():
    torch._dynamo.reset()
    _, bag = bag_pair("sum", include_last_offset=True)
    step = torch.compile(lambda i, o: bag(i, o), fullgraph=True)
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.equal(step(ids, torch.tensor([0, 2, 4])), bag(ids, torch.tensor([0, 2, 4])))
    with pytest.raises(RuntimeError, match="offsets must not decrease"):
        step(ids, torch.tensor([0, 3, 2]))
    # Eagerly the ids after the last offset belong to no bag; a compiled
    # graph has no data-dependent sizes, so it asks for the documented form.
    with pytest.raises(RuntimeError, match=r"under torch.compile.*offsets\[-1\] = 3.*input's length 4"):
        step(ids, torch.tensor([0, 2, 3]))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_ids_after_the_last_offset_belong_to_no_bag(mode, padding_idx):
    # torch documents offsets[-1] == len(input) with include_last_offset;
    # for a shorter one each bag is still its offsets' range (torch's CPU
    # kernel agrees in sum mode without padding_idx, and runs the last bag
    # on in the other cases): the reference is torch on the ids inside.
    ref, ours = bag_pair(mode, include_last_offset=True, padding_idx=padding_idx)
    ids = torch.tensor([5, 3, 7, 9, 11, 2])
    offsets = torch.tensor([0, 2, 4])
    out = ours(ids, offsets)
    assert torch.equal(out, ref(ids[:4], offsets))
    if mode == "sum" and padding_idx is None:
        assert torch.equal(out, ref(ids, offsets))
    # ...and get no gradient
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)
    ref(ids[:4], offsets).backward(grad_out)
    assert torch.equal(ours.weight.grad.to_dense(), ref.weight.grad)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "frozen"])
def test_bags_without_autograd_match_torch(mode, how):
    """Where no gradient can flow the pooling skips autograd's Function;
    outputs stay torch's bit for bit, with no graph behind them, and a
    frozen table's per_sample_weights still get their gradient."""
    ref, ours = bag_pair(mode, padding_idx=3)
    ids, offsets, weights = batch("offsets", torch.int64, 3, mode == "sum")
    if how == "frozen":
        ref.weight.requires_grad_(False)
        ours.weight.requires_grad_(False)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how, torch.enable_grad)
    with context():
        expected, got = ref(ids, offsets, weights), ours(ids, offsets, weights)
    assert torch.equal(got, expected) and got.grad_fn is None
    if how == "frozen" and weights is not None:
        w_ref, w_ours = weights.clone().requires_grad_(), weights.clone().requires_grad_()
        ref(ids, offsets, w_ref).sum().backward()
        ours(ids, offsets, w_ours).sum().backward()
        torch.testing.assert_close(w_ours.grad, w_ref.grad)
        assert ours.weight.grad is None
