"""A compiled lookup's gradient sums (compiled_grad) held until the backward
pass ends: a backward that raises must not keep them."""
import gc

import torch
from torch import nn

import hostembed
from hostembed._core.ops import compiled_grad


class _RaisesInBackward(torch.autograd.Function):
    """Raises in backward, after the compiled lookup's backward has kept
    its sums: created before the lookup, its node runs after it."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _RaisesInBackward.seen.append(len(compiled_grad._pending))
        raise ValueError("raised on purpose in backward")


def test_a_compiled_backward_that_raises_leaves_no_sums_and_the_next_one_gives_eagers_gradient():
    torch._dynamo.reset()
    torch.manual_seed(0)
    ours = hostembed.Embedding(300, 16)
    reference = nn.Embedding(300, 16)
    with torch.no_grad():
        reference.weight.copy_(ours.weight)
    head = nn.Linear(16, 1)
    step = torch.compile(lambda emb, ids: head(emb(ids)).pow(2).sum())
    side = torch.ones(3, requires_grad=True)
    ids = torch.randint(0, 300, (32, 7), generator=torch.Generator().manual_seed(1))
    _RaisesInBackward.seen.clear()
    failures = 5
    for i in range(failures):
        loss = _RaisesInBackward.apply(side).sum() + step(ours, ids)
        try:
            loss.backward()
        except ValueError as exc:
            assert "raised on purpose" in str(exc), f"expected the test's own error, got {exc!r}"
        else:
            raise AssertionError("the backward pass did not raise: nothing was tested")
        del loss
        gc.collect()
        assert len(compiled_grad._pending) == 0, \
            f"after {i + 1} failed backward passes, {len(compiled_grad._pending)} passes' sums are still held"
    # Proof that each failed pass had kept its sums before it raised.
    assert _RaisesInBackward.seen == [1] * failures, \
        f"expected one pass's sums held when each backward raised, found {_RaisesInBackward.seen}"
    assert ours.weight.grad is None, "a failed compiled backward put a gradient in .grad"

    head.zero_grad()
    step(ours, ids).backward()
    assert len(compiled_grad._pending) == 0, "a completed backward pass left its sums held"
    head.zero_grad()
    head(reference(ids)).pow(2).sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.is_sparse, \
        f"expected a row-sparse gradient after a successful compiled backward, found {ours.weight.grad!r}"
    torch.testing.assert_close(ours.weight.grad.to_dense(), reference.weight.grad, rtol=1e-5, atol=1e-6)
