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
