"""benchmarks/cache_step.py, the row cache on the anchors' protocols: its id
streams follow the protocols as written in benchmarks/_anchor_streams.py,
and a CPU run at a small scale writes the report's rows."""
import json
import pathlib

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def streams(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _anchor_streams
    return _anchor_streams


def test_powerlaw_ids_are_dynamicembs_draw(streams):
    ids = streams.powerlaw_ids(1000, 1.05, 200_000, torch.Generator().manual_seed(0), "cpu")
    assert ids.dtype == torch.int64 and int(ids.min()) == 1 and int(ids.max()) <= 999
    counts = torch.bincount(ids, minlength=1000).double()
    # The continuous law's mass on [k, k+1): ids 1 and 2 take about
    # (1 - 2^-0.05) / (1 - 1000^-0.05) and (2^-0.05 - 3^-0.05) / (...) of the draws.
    norm = 1 - 1000 ** -0.05
    assert counts[1] / len(ids) == pytest.approx((1 - 2 ** -0.05) / norm, rel=0.02)
    assert counts[2] / len(ids) == pytest.approx((2 ** -0.05 - 3 ** -0.05) / norm, rel=0.03)
    assert counts[0] == 0 and counts[1] > counts[2] > counts[10] > counts[500]


def test_dynamicemb_stream_renumbers_each_table_to_its_touched_rows(streams):
    w = streams.dynamicemb(scale=0.0005, batches=5, device="cpu")
    per_table = w.notes["ids_per_table"]
    assert len(w.batches) == 5 and all(b.numel() == 10 * per_table for b in w.batches)
    assert w.warmup == w.timed == list(range(5)), "the timed pass replays the warm-up pass's batches"
    every = torch.cat(w.batches)
    assert torch.equal(torch.unique(every), torch.arange(w.rows)), "the folded table is exactly the touched rows"
    # Table t's rows are a block of their own: no id of two tables meet.
    blocks = [torch.unique(torch.stack(w.batches)[:, t * per_table:(t + 1) * per_table]) for t in range(10)]
    for a, b in zip(blocks, blocks[1:]):
        assert int(a.max()) < int(b.min())


def test_fbgemm_stream_has_distinct_bags_and_reuses_a_tenth(streams):
    w = streams.fbgemm(scale=0.02, iters=3, device="cpu")
    rows_per_table, bag = w.notes["rows_per_table"], w.bag_size
    assert (w.rows, bag, len(w.batches)) == (32 * rows_per_table, 20, 6) and w.timed == [3, 4, 5]
    first = w.batches[0].view(32, -1, bag)
    tables = torch.arange(32).view(32, 1, 1)
    assert bool(((first >= tables * rows_per_table) & (first < (tables + 1) * rows_per_table)).all())
    # The first batch has no reuse: every bag's ids are distinct.
    ordered = first.sort(dim=-1).values
    assert bool((ordered[..., 1:] > ordered[..., :-1]).all())
    for prev, cur in zip(w.batches, w.batches[1:]):
        same = (prev.view(32, -1) == cur.view(32, -1)).double().mean(1)
        assert bool((same >= 0.1 - 1e-9).all()) and bool((same < 0.5).all())
    # Zipf(1.15): the hottest row of a table far above the mean of its rows.
    counts = torch.bincount(torch.cat(w.batches) % rows_per_table, minlength=rows_per_table).double()
    assert counts.max() > 20 * counts.mean()


def test_the_harness_writes_a_row_per_protocol_cache_and_state(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cache_step
    out = tmp_path / "cache_protocols.json"
    cache_step.main(["--device", "cpu", "--scale", "0.0005", "--batches", "3", "--iters", "2", "--warmup", "2",
                     "--steps", "3", "--states", "float32,int8", "--json", str(out)])
    rows = json.loads(out.read_text())
    keys = {"protocol", "cache", "state", "ms_per_step", "device", "date"}
    assert all(keys <= set(r) and r["device"] == "cpu" and r["ms_per_step"] > 0 for r in rows)
    got = {(r["protocol"], r["cache"], r["state"], r["optimizer"]) for r in rows}
    for protocol, fractions in (("dynamicemb", (0, 1, 0.8)), ("fresh", (0, 1, 0.8, 0.2, 0.05)),
                                ("replayed", (0, 1, 0.8, 0.2, 0.05))):
        assert {(protocol, f, s, "adam") for f in fractions for s in ("float32", "int8")} <= got
    assert {("fbgemm", f, "float32", "rowwise_adagrad") for f in (0, 0.2, 1)} <= got
    by = {(r["protocol"], r["cache"], r["state"]): r for r in rows}
    # dynamicemb's timed pass replays the warm-up's batches: a cache of every
    # touched row hits every row and moves nothing; 80% of them cannot.
    full, part = by["dynamicemb", 1, "float32"], by["dynamicemb", 0.8, "float32"]
    assert full["hit_rate"] == 1.0 and full["pcie_bytes_per_step"] == 0 and full["minimum_bytes_per_step"] == 0
    assert 0 < part["hit_rate"] < 1 and part["bypassed_per_step"] + part["stats"]["fetches"] > 0
    # Fresh batches bring rows no cache has seen; the records are smaller with 8-bit moments.
    fresh, fresh8 = by["fresh", 1, "float32"], by["fresh", 1, "int8"]
    assert fresh["first_touch_per_step"] > 0 and 0 < fresh["hit_rate"] < 1
    assert fresh8["record_bytes"] < fresh["record_bytes"] == 3 * 128 * 4
    # Rows a GiB of the cache's records as allocated: float32 + Adam 1,536
    # bytes a row, 8-bit moments 4 x 128 + 2 x 128 + 2 scales = 776.
    assert fresh["cache_rows_per_gib"] == 2**30 / 1536 and fresh8["cache_rows_per_gib"] == 2**30 / 776
    assert by["fresh", 0, "float32"]["cache_rows_per_gib"] is None
    assert set(fresh["phases_ms"]) == {"forward", "backward", "step"}


def test_the_harness_refuses_to_time_a_cache_whose_bits_differ(tmp_path, monkeypatch):
    """Before timing, a cached table must train to the uncached bits on a
    small draw of the stream; a cache that changed one value is refused."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cache_step
    real_run = cache_step.run

    def off_by_one_ulp(module, *args):
        out = real_run(module, *args)
        if module.cache_rows:
            with torch.no_grad():
                module.weight[0, 0] = torch.nextafter(module.weight[0, 0], torch.tensor(1.0))
        return out

    monkeypatch.setattr(cache_step, "run", off_by_one_ulp)
    with pytest.raises(SystemExit, match="CORRECTNESS CHECK FAILED: fresh, adam float32: the cached table"):
        cache_step.main(["--device", "cpu", "--scale", "0.0005", "--warmup", "2", "--steps", "2",
                         "--protocols", "fresh", "--json", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists(), "nothing timed"
