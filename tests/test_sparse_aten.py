"""The sparse kernels hostembed registers into aten (_core/ops/sparse_aten):
never over a kernel torch already has for the key, whichever key it is
registered under, and nothing at all where torch cannot be asked."""
import json
import subprocess
import sys
import uuid

import pytest
import torch

from hostembed._core.ops import sparse_aten


def _ours(x):
    return torch.full(x.shape, 7.0)


@pytest.fixture
def test_ops():
    """A fresh namespace with one op per way torch can serve SparseCPU, and
    one it does not serve there."""
    ns = "hostembed_guard_" + uuid.uuid4().hex[:8]
    lib = torch.library.Library(ns, "DEF")
    ways = {
        "exact": "SparseCPU",
        "implicit": "CompositeImplicitAutograd",
        "explicit": "CompositeExplicitAutograd",
        "unserved": "CPU",  # served for dense tensors only
    }
    for name, key in ways.items():
        lib.define(f"{name}(Tensor x) -> Tensor")
        lib.impl(name, lambda x: x * 2, key)
    impl = torch.library.Library(ns, "IMPL")
    yield ns, impl
    impl._destroy()
    lib._destroy()


def test_the_guard_leaves_an_op_torch_serves_through_any_key_to_torch(test_ops):
    ns, impl = test_ops
    names = ("exact", "implicit", "explicit", "unserved")
    registered = sparse_aten._register({name: _ours for name in names}, ("SparseCPU",), impl)
    assert registered == [("unserved", "SparseCPU")], \
        f"expected only the op without a SparseCPU kernel to be registered, found {registered}"
    x = torch.tensor([[0.0, 3.0], [1.5, 0.0]]).to_sparse()
    ops = getattr(torch.ops, ns)
    for name in ("exact", "implicit", "explicit"):
        got = getattr(ops, name)(x).to_dense()
        assert torch.equal(got, x.to_dense() * 2), f"{name}: expected torch's own kernel (x * 2), got {got}"
    got = ops.unserved(x).to_dense()
    assert torch.equal(got, torch.full((2, 2), 7.0)), f"unserved: expected the registered kernel's 7s, got {got}"


def test_the_guard_leaves_aten_ops_torch_has_for_sparse_keys_alone():
    """aten ops served for SparseCPU by their own kernel (abs), through
    CompositeExplicitAutograd (norm.Scalar) or CompositeImplicitAutograd
    (linalg_norm, clip_): none would be registered."""
    class Recording:
        ns = "aten"
        calls = []

        def impl(self, name, kernel, key):
            self.calls.append((name, key))

    lib = Recording()
    served = ("abs", "norm.Scalar", "linalg_norm", "clip_")
    registered = sparse_aten._register({name: _ours for name in served}, ("SparseCPU",), lib)
    assert registered == [] and lib.calls == [], f"expected torch's kernels left alone, found {lib.calls}"


def test_a_torch_without_the_dispatcher_question_registers_nothing_and_says_what_wont_work():
    """Registration happens at import, so in a fresh interpreter whose torch
    lacks the private function: import still works, a warning names what
    won't work, and torch's clipping still fails on a sparse gradient."""
    code = f"""
import json, warnings, torch
delattr(torch._C, {sparse_aten._SERVED!r})
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import hostembed
messages = [str(w.message) for w in seen if "sparse kernels" in str(w.message)]
registered = [torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + name, key)
              for name in {list(sparse_aten._KERNELS)!r} for key in ("SparseCPU", "SparseCUDA")]
emb = hostembed.Embedding(10, 3)
emb(torch.tensor([1, 2])).sum().backward()
try:
    torch.nn.utils.clip_grad_norm_([emb.weight], 1.0)
    clip = "no error"
except (NotImplementedError, RuntimeError) as exc:
    clip = type(exc).__name__
total = float(hostembed.clip_grad_norm_([emb.weight], 1.0))
print(json.dumps(dict(messages=messages, registered=registered, clip=clip, total=total)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import hostembed failed without the private function:\n{proc.stderr[-3000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["messages"]) == 1, f"expected one warning about the sparse kernels, found {got['messages']}"
    assert "clip_grad_norm_" in got["messages"][0] and sparse_aten._SERVED in got["messages"][0], \
        f"expected the warning to name the missing function and clip_grad_norm_, found {got['messages'][0]!r}"
    assert not any(got["registered"]), f"expected no sparse kernel registered, found {got['registered']}"
    assert got["clip"] != "no error", "torch's clip_grad_norm_ took a sparse gradient with no kernel registered"
    # Two rows of ones in a [10, 3] gradient: norm sqrt(6).
    assert got["total"] == pytest.approx(6 ** 0.5, rel=1e-6), f"hostembed.clip_grad_norm_ gave {got['total']}"
