import os
import pytest
import torch

import hostembed


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def threads(request):
    """Runs a test under several core thread counts, restoring the default."""
    before = hostembed.get_num_threads()
    hostembed.set_num_threads(request.param)
    yield request.param
    hostembed.set_num_threads(before)


def zipf_ids(num_rows, count, alpha=1.15, generator=None):
    """Zipf(alpha) ids over a random permutation of the rows: duplicate-heavy
    like real recommendation traffic, hot rows scattered over the table."""
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    weights = ranks.pow(-alpha)
    draws = torch.multinomial(weights, count, replacement=True, generator=generator)
    perm = torch.randperm(num_rows, generator=generator)
    return perm[draws]


def pair(num_rows, dim, seed=0, **kwargs):
    """A torch nn.Embedding and a hostembed.Embedding with the same weights."""
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(num_rows, dim, **kwargs)
    torch.manual_seed(seed)
    ours = hostembed.Embedding(num_rows, dim, **kwargs)
    assert torch.equal(ref.weight, ours.weight), "same seed must give torch's initial table"
    return ref, ours


def compile_matches_eager(device, check_tables=None):
    """torch.compile(fullgraph=True) of a loss over a hostembed table with
    max_norm gives eager's losses, gradients and renormed table, with no
    graph break. check_tables(eager_emb, compiled_emb) runs after each
    backward (e.g. that the GPU kernels ran)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"emb": hostembed.Embedding(300, 8, max_norm=2.0, device=device),
                                    "head": torch.nn.Linear(8, 1).to(device)})

    def loss_of(model, ids):
        return model["head"](model["emb"](ids)).pow(2).mean()

    eager, compiled = build(), build()
    step = torch.compile(loss_of, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = zipf_ids(300, 40, generator=gen).view(5, 8).to(device)
        expected = loss_of(eager, ids)
        got = step(compiled, ids)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        expected.backward()
        got.backward()
        if check_tables is not None:
            check_tables(eager["emb"], compiled["emb"])
        assert compiled["emb"].weight.grad.is_sparse
        torch.testing.assert_close(compiled["emb"].weight.grad.to_dense(), eager["emb"].weight.grad.to_dense(),
                                   rtol=1e-6, atol=1e-7)
        eager.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(eager["emb"].weight, compiled["emb"].weight), "max_norm renormed the same rows"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def assert_adam_bound(ours, theirs, reference, what):
    """ours (the core's Adam) is within twice torch's own float32 error of
    the float64 run, and every element within 4 roundings of torch's or,
    near 0, within torch's own largest error."""
    eps = torch.finfo(theirs.dtype).eps
    ours, theirs, reference = ours.double(), theirs.double(), reference.double()
    torch_error = (theirs - reference).abs().max()
    assert (ours - reference).abs().max() <= 2 * torch_error + 4 * eps * 1e-2, what
    assert ((ours - theirs).abs() <= 4 * eps * theirs.abs() + torch_error).all(), what


# Skips: only a test marked `gpu` may skip where there is no CUDA device.
# With HOSTEMBED_NO_SKIPS=1 (.ci/run sets it) any other skip fails the run:
# a test that skips in CI is no evidence, and a missing package or tool
# would otherwise pass unnoticed.
_unexpected_skips = []


def _skip_reason(report):
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # The marker itself, not report.keywords: those hold parametrize ids
    # too, and a case named "gpu" is not a GPU test.
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        _unexpected_skips.append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report):
    if report.skipped:  # a whole module, e.g. importorskip of a missing package
        _unexpected_skips.append((report.nodeid, _skip_reason(report)))


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips and os.environ.get("HOSTEMBED_NO_SKIPS") == "1":
        terminalreporter.section("skipped without a GPU reason (HOSTEMBED_NO_SKIPS=1)", red=True)
        for nodeid, reason in _unexpected_skips:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and os.environ.get("HOSTEMBED_NO_SKIPS") == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
