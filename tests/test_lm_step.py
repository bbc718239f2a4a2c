"""benchmarks/clients/lm_step.py at a tiny size: the plain swap trains a small
language model to torch's losses, and hostembed.SparseAdam for an untied
table to torch's SparseAdam's (the script checks each pair before timing);
the untied table's gradient is row-sparse where torch's is table-sized."""
import json
import pathlib


def test_lm_step_benchmark_reports_both_ties(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "clients"))
    import lm_step
    out = tmp_path / "lm.json"
    lm_step.main(["--vocabs", "3000", "--hidden", "16", "--tokens", "256", "--warmup", "1", "--rounds", "2",
                  "--device", "cpu", "--json", str(out)])
    rows = {r["tied"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {True, False} and all(r["ms_per_step"]["hostembed"] > 0 for r in rows.values())
    untied, tied = rows[False]["table_bytes"], rows[True]["table_bytes"]
    assert untied["torch"]["grad"] == 3000 * 16 * 4 > 10 * untied["hostembed"]["grad"] > 0
    assert tied["hostembed"]["grad"] == tied["torch"]["grad"] == 3000 * 16 * 4  # the projection's gradient is dense
    assert untied["hostembed"]["state"] == untied["torch"]["state"] >= 2 * 3000 * 16 * 4
    # Untied, the sparse pair too: only the looked-up rows' gradient, each
    # optimizer's two moments; no GPU here, so no GPU memory is reported.
    assert set(rows[False]["ms_per_step"]) == {"torch", "hostembed", "torch_sparse", "hostembed_sparse"}
    assert set(rows[True]["ms_per_step"]) == {"torch", "hostembed"}
    assert 0 < untied["hostembed_sparse"]["grad"] < 3000 * 16 * 4 / 10
    assert untied["hostembed_sparse"]["state"] == untied["torch_sparse"]["state"] == 2 * 3000 * 16 * 4
    assert rows[False]["gpu_bytes"] is None and untied["hostembed_sparse"]["device"] == "cpu"
