"""benchmarks/gpu/cache_step.py, the row cache on the anchors' protocols: its id
streams follow the protocols as written in benchmarks/cache/_anchor_streams.py,
and a CPU run at a small scale writes the report's rows."""
import json
import pathlib

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def streams(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # _common
    monkeypatch.syspath_prepend(str(BENCHMARKS / "cache"))
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


def test_the_harness_writes_a_row_per_protocol_cache_and_state(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "gpu"))
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
    assert full["hit_rate"] == 1.0 and full["record_bytes_moved_per_step"] == 0
    assert full["pcie_bytes_per_step_modelled"] == 0 and full["minimum_bytes_per_step_modelled"] == 0
    assert 0 < part["hit_rate"] < 1 and part["bypassed_per_step"] + part["stats"]["fetches"] > 0
    assert part["record_bytes_moved_per_step"] == part["stats"]["fetched_bytes"] + part["stats"]["written_back_bytes"]
    fresh = by["fresh", 1, "float32"]
    assert fresh["first_touch_per_step"] > 0 and 0 < fresh["hit_rate"] < 1
    assert by["fresh", 0, "float32"]["cache_rows_per_gib"] is None
    assert set(fresh["phases_ms"]) == {"forward", "backward", "step"}
    # Nothing is measured on the bus: a figure from a formula is named so,
    # and nothing computed is left under an unlabelled bytes field.
    none = by["fresh", 0, "float32"]
    assert none["record_bytes_moved_per_step"] is None
    assert none["pcie_bytes_per_step_modelled"] == none["bypass_bytes_per_step_modelled"] > 0
    # The no-cache row's record size is a formula; a cache's records of the
    # same state, measured, agree with it.
    assert none["record_bytes_modelled"] == fresh["cache_bytes_per_row"]
    assert all(not k.startswith(("pcie_bytes", "minimum_bytes", "record_bytes", "bypass_bytes"))
               or k.endswith("_modelled") or k == "record_bytes_moved_per_step" for r in rows for k in r)
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| optimizer, state"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "PCIe MiB/step (modelled)" in columns and "minimum MiB/step (modelled)" in columns
    assert not any(c.startswith("PCIe") and "modelled" not in c for c in columns)
    none_line = next(line for line in printed.splitlines() if line.startswith("| adam, float32 | none |"))
    cells = [c.strip() for c in none_line.strip("|").split("|")]
    assert cells[columns.index("records moved MiB/step")] == ""
    assert float(cells[columns.index("PCIe MiB/step (modelled)")]) > 0


def test_the_reported_record_size_is_the_records_the_cache_allocates(tmp_path, monkeypatch):
    """The bytes a row of cache the harness reports are those of the
    records the cache allocated for its rows (weight, each state tensor,
    8-bit scales): measured on the cache each timed run used, at each size,
    for Adam's float32, bfloat16 and 8-bit state and row-wise Adagrad."""
    monkeypatch.syspath_prepend(str(BENCHMARKS / "gpu"))
    import cache_step
    seen = []
    real_run = cache_step.run

    def measuring_run(module, *args):
        result = real_run(module, *args)
        cache = module._table.cache
        if cache is not None:
            tensors = list(cache.cached.values())
            assert all(t.shape[0] == cache.capacity == module.cache_rows for t in tensors)
            # The harness's own count of the storages, checked against the
            # tensors' shapes below (nothing hidden beside them).
            seen.append({"allocated": cache_step.allocated_record_bytes(cache), "capacity": cache.capacity,
                         "by_shape": sum(t.element_size() * t.numel() for t in tensors),
                         "keys": sorted(cache.cached)})
        return result

    monkeypatch.setattr(cache_step, "run", measuring_run)
    out = tmp_path / "r.json"
    for protocol, more in (("fresh", ["--states", "float32,bfloat16,int8"]), ("fbgemm", [])):
        cache_step.main(["--device", "cpu", "--scale", "0.0005", "--iters", "2", "--warmup", "1", "--steps", "2",
                         "--fractions", "1,0.2", "--no-check", "--protocols", protocol, "--json", str(out),
                         "--append"] + more)
    cached = [r for r in json.loads(out.read_text()) if r["cache"]]
    assert len(cached) == len(seen) == 8
    assert [r["cache_rows"] for r in cached] == [s["capacity"] for s in seen]
    per_row = {}
    for row, measured in zip(cached, seen):
        # The records are exactly their tensors, nothing hidden beside them.
        assert measured["allocated"] == measured["by_shape"]
        assert row["cache_records_allocated_bytes"] == measured["allocated"]
        assert row["cache_bytes_per_row"] * row["cache_rows"] == measured["allocated"]
        assert row["cache_rows_per_gib"] == 2**30 * measured["capacity"] / measured["allocated"]
        # The formula the modelled figures use agrees with what is allocated.
        assert row["record_bytes_modelled"] * row["cache_rows"] == measured["allocated"]
        per_row.setdefault((row["optimizer"], row["state"]), set()).add(measured["allocated"] / measured["capacity"])
    assert set(map(len, per_row.values())) == {1}, "a record's size does not depend on the cache's"
    sizes = {k: v.pop() for k, v in per_row.items()}
    # Smaller state, smaller records: 8-bit moments < bfloat16 < float32;
    # row-wise Adagrad keeps one value a row beside the weight.
    assert sizes["adam", "int8"] < sizes["adam", "bfloat16"] < sizes["adam", "float32"]
    assert sizes["rowwise_adagrad", "float32"] < sizes["adam", "int8"]
    assert [s["keys"] for s in seen][-1] == ["row_sum", "weight"]
