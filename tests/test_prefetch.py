"""Embedding.prefetch: a lookup that takes prefetched rows gives the bits a
lookup without prefetch gives, whatever changed the table in between."""
import pytest
import torch

import hostembed
from hostembed.nn.lookup import prefetch as _prefetch
from conftest import zipf_ids

N, D = 400, 12


def twins(**kwargs):
    torch.manual_seed(0)
    a = hostembed.Embedding(N, D, **kwargs)
    torch.manual_seed(0)
    b = hostembed.Embedding(N, D, **kwargs)
    return a, b


def outcome(emb):
    return emb._table.prefetch_outcome


def wait_for_gather(emb):
    """Joins the prefetch's thread: its rows are gathered (and now stale for
    anything written after)."""
    emb._table.prefetch._thread.join()


@pytest.mark.parametrize("fused", [False, True])
def test_fifty_zipf_steps_with_prefetch_give_the_same_bits(fused, threads, monkeypatch):
    # Every prefetch taken and patched, however many rows the step changed.
    monkeypatch.setattr(_prefetch, "MAX_REREAD", 1.0)
    plain, ahead = twins()
    opts = [hostembed.SparseAdam(e.parameters(), lr=0.05, fused=fused) for e in (plain, ahead)]
    gen = torch.Generator().manual_seed(1)
    batches = [zipf_ids(N, 256, generator=gen).view(16, 16) for _ in range(51)]
    patched = 0
    ahead.prefetch(batches[0])
    for i in range(50):
        ids = batches[i]
        outs = []
        for emb, opt in zip((plain, ahead), opts):
            opt.zero_grad()
            out = emb(ids)
            outs.append(out.detach().clone())
            if emb is ahead:
                taken = outcome(ahead)
                assert taken.startswith("taken"), taken
                patched += int(taken.split()[1])
                ahead.prefetch(batches[i + 1])  # overlaps this step's backward and update
                if i % 2:
                    wait_for_gather(ahead)  # gathered before the update: stale rows for sure
            out.pow(2).sum().backward()
            opt.step()
        assert torch.equal(outs[0], outs[1]), f"step {i}"
    assert torch.equal(plain.weight, ahead.weight)
    # Zipf batches share hot rows: the updates touched prefetched rows.
    assert patched > 0


def test_a_different_batch_drops_the_prefetch():
    emb, _ = twins()
    emb.prefetch(torch.tensor([1, 2, 3]))
    other = torch.tensor([3, 2])
    assert torch.equal(emb(other), emb.weight.detach()[other])
    assert outcome(emb) == "dropped: other ids" and emb._table.prefetch is None
    # Equal values in another tensor are the same batch.
    emb.prefetch(torch.tensor([[5, 6]]))
    assert torch.equal(emb(torch.tensor([[5, 6]])), emb.weight.detach()[torch.tensor([[5, 6]])])
    assert outcome(emb).startswith("taken")


def test_an_abandoned_prefetch_is_harmless():
    emb, _ = twins()
    emb.prefetch(torch.tensor([1, 2]))
    emb.prefetch(torch.tensor([7, 8]))  # replaces the first
    wait_for_gather(emb)
    assert torch.equal(emb(torch.tensor([1, 2])), emb.weight.detach()[[1, 2]])
    assert outcome(emb) == "dropped: other ids"
    emb.prefetch(torch.tensor([9]))
    del emb  # with its prefetch outstanding


def test_out_of_range_ids_raise_at_the_lookup_and_write_nothing():
    emb, _ = twins()
    opt = hostembed.SparseAdam(emb.parameters(), fused=True)
    bad = torch.tensor([1, N])
    emb.prefetch(bad)  # no error here
    before = emb.weight.detach().clone()
    with pytest.raises(IndexError, match=f"id {N} at position 1"):
        emb(bad)
    assert outcome(emb) == "dropped: its gather failed"
    assert torch.equal(emb.weight, before) and not opt.state


@pytest.mark.parametrize("change", ["inplace", "load_state_dict", "data"])
def test_writes_that_do_not_name_rows_drop_the_prefetch(change):
    emb, _ = twins()
    ids = torch.tensor([3, 4, 3])
    emb.prefetch(ids)
    wait_for_gather(emb)
    new = torch.randn(N, D)
    if change == "inplace":
        with torch.no_grad():
            emb.weight[3] = 7.0
    elif change == "load_state_dict":
        emb.load_state_dict({"weight": new})
    else:
        emb.weight.data = new.clone()
    assert torch.equal(emb(ids), emb.weight.detach()[ids])
    assert outcome(emb).startswith("dropped"), outcome(emb)


def test_checkpoint_load_drops_the_prefetch(tmp_path):
    emb, other = twins()
    with torch.no_grad():
        other.weight.mul_(3)
    hostembed.save(tmp_path / "ckpt.pt", other)
    ids = torch.tensor([0, 1])
    emb.prefetch(ids)
    wait_for_gather(emb)
    hostembed.load(tmp_path / "ckpt.pt", emb)
    assert torch.equal(emb(ids), other.weight.detach()[ids])
    assert outcome(emb).startswith("dropped")


def test_max_norm_tables_prefetch_nothing():
    emb, ref = twins(max_norm=0.5)
    ids = torch.tensor([1, 2, 2])
    emb.prefetch(ids)
    assert emb._table.prefetch is None
    assert torch.equal(emb(ids), ref(ids))


def test_prefetch_checks_the_ids():
    emb, _ = twins()
    with pytest.raises(TypeError, match="int64 or torch.int32"):
        emb.prefetch(torch.tensor([1.0]))


def stale_prefetch(first, second):
    """A fused step on `first` whose update lands after `second` was
    prefetched (and gathered); the lookups of `second` with and without
    the prefetch."""
    plain, ahead = twins()
    outs = []
    for emb in (plain, ahead):
        opt = hostembed.SparseAdam(emb.parameters(), lr=0.05, fused=True)
        loss = emb(first).sum()
        if emb is ahead:
            emb.prefetch(second)
            wait_for_gather(emb)
        loss.backward()  # the fused update
        opt.step()
        outs.append(emb(second))
    return outs, outcome(ahead)


def test_a_prefetch_mostly_changed_by_the_step_is_gathered_anew():
    cold, hot = torch.arange(100, 200), torch.tensor([1, 2, 3, 4] * 10)
    # 40 of 90 positions hot
    (plain, ahead), what = stale_prefetch(torch.cat([hot, cold[:50]]), torch.cat([hot, cold[50:]]))
    assert what == "dropped: 40 of 90 positions changed"
    assert torch.equal(plain, ahead)


def test_a_few_changed_rows_are_re_read():
    # 10 of 60 positions shared
    (plain, ahead), what = stale_prefetch(torch.arange(0, 60), torch.arange(50, 110))
    assert what == "taken, 10 of 60 positions re-read"
    assert torch.equal(plain, ahead)


def test_ids_tensor_refilled_after_prefetch():
    emb, _ = twins()
    ids = torch.tensor([1, 2, 3])
    emb.prefetch(ids)
    wait_for_gather(emb)
    ids.copy_(torch.tensor([7, 8, 9]))  # the caller reuses its buffer
    assert torch.equal(emb(ids), emb.weight.detach()[[7, 8, 9]])
    assert outcome(emb) == "dropped: other ids"
