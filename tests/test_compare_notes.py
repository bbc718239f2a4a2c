"""benchmarks/compare.py's notes and plot titles, on synthetic numbers (no
training run): a contender below the dense part alone (noise), or the
fused step slower than the unfused one, is said with the other load; the
plots name the run's date and machine; --plot-from draws a run's JSON."""
import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def compare(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import compare
    return compare


def result(ms, others):
    return {"median_ms": ms, "cpu_fraction_used_by_others": others}


def test_no_note_when_the_figures_mean_what_they_seem(compare):
    results = {"torch_sparse_cpu": result(40.0, 0.01), "hostembed": result(26.6, 0.01),
               "hostembed_fused": result(24.0, 0.02), "torch_sparse_gpu": {"skipped": "no GPU"}}
    assert compare.timing_notes(results, result(18.6, 0.01)) == []


def test_a_figure_below_the_floor_is_called_noise_with_the_other_load(compare):
    results = {"hostembed": result(17.0, 0.31), "hostembed_fused": result(16.0, 0.30)}
    notes = compare.timing_notes(results, result(18.62, 0.12))
    below = [n for n in notes if "less than the dense part alone" in n]
    assert len(below) == 2
    assert below[0].startswith("Note: 4. took 17.00 ms") and "1.62 ms less" in below[0]
    assert "noise" in below[0] and "31%" in below[0] and "12%" in below[0]
    assert below[1].startswith("Note: 5. took 16.00 ms") and "30%" in below[1]
    assert not any("(fused) took" in n for n in notes), "fused is faster here"


def test_fused_slower_than_unfused_is_said(compare):
    # Under load: the order of the contenders may explain it.
    busy = compare.timing_notes({"hostembed": result(20.0, 0.02), "hostembed_fused": result(25.0, 0.40)},
                                result(10.0, 0.0))
    assert len(busy) == 1
    assert "5. (fused) took 25.00 ms" in busy[0] and "1.25x" in busy[0]
    assert "2%" in busy[0] and "40%" in busy[0] and "rerun" in busy[0]
    # On an idle machine: the machine's own result.
    idle = compare.timing_notes({"hostembed": result(3.32, 0.0), "hostembed_fused": result(4.05, 0.01)},
                                result(1.83, 0.0))
    assert len(idle) == 1 and "not noise" in idle[0] and "fusing does not pay here" in idle[0]
    # Unknown load (a short window, or a JSON without it) is not called idle.
    unknown = compare.timing_notes({"hostembed": {"median_ms": 3.0}, "hostembed_fused": {"median_ms": 4.0}},
                                   {"median_ms": 1.0})
    assert "an unknown share" in unknown[0] and "rerun" in unknown[0]


def test_the_run_label_names_date_and_machine(compare):
    report = {"machine": {"usable_cpus": 2, "cpu_model": "AMD EPYC 7B13", "gpu": None, "torch": "2.13.0+cpu",
                          "output_device": "cpu"}}
    assert compare.run_label(report, "2026-11-27") == \
        "2026-11-27, 2 CPUs (AMD EPYC 7B13), torch 2.13.0+cpu, outputs on cpu"
    report["machine"].update(gpu={"name": "NVIDIA H200"}, usable_cpus=16, output_device="cuda")
    assert compare.run_label(report, None).startswith("date not recorded, NVIDIA H200 + 16 CPUs")
    assert compare.run_date({"date": "2026-11-28"}, "/x/h200-2026-11-26/a.json") == "2026-11-28"
    assert compare.run_date({}, "/x/h200-2026-11-26/a.json") == "2026-11-26"
    assert compare.run_date({}, "/x/a.json") is None


def test_plot_from_draws_a_runs_json_without_training(compare, tmp_path, monkeypatch, capsys):
    drawn = {}

    def fake_write_plots(out_dir, figures):
        drawn["out"], drawn["names"] = out_dir, sorted(figures)
        return [str(pathlib.Path(out_dir) / name) for name in sorted(figures)], None

    monkeypatch.setattr(compare, "write_plots", fake_write_plots)
    monkeypatch.setattr(compare, "run_contenders", lambda *a: pytest.fail("--plot-from must not train"))
    titles, run_label = [], compare.run_label
    monkeypatch.setattr(compare, "run_label", lambda report, date: titles.append(run_label(report, date)) or titles[-1])
    # As an older run's JSON: no date, no cache_fraction, contenders 6-8 unknown to it.
    config = {"size": "default", "users": 4_000_000, "items": 1_000_000, "dim": 64, "batch": 16_384}
    contenders = {key: {"skipped": "no GPU"} for key in ("torch_adam", "torch_sparse_gpu")}
    contenders.update(torch_sparse_cpu=dict(result(40.1, 0.0), losses=[0.8, 0.7]),
                      hostembed=dict(result(17.0, 0.0), losses=[0.8, 0.7]),
                      hostembed_fused=dict(result(26.6, 0.0), losses=[0.8, 0.7]))
    report = {"benchmark": "compare", "config": config, "contenders": contenders,
              "machine": {"usable_cpus": 2, "cpu_model": "AMD EPYC", "torch": "2.13.0+cpu", "output_device": "cpu"},
              "dense_floor": {"median_ms": 18.6}, "agreement": {"checked": False, "reason": "synthetic"}}
    (tmp_path / "run-2026-11-23").mkdir()
    path = tmp_path / "run-2026-11-23" / "compare_default.json"
    path.write_text(json.dumps(report))
    compare.main(["--plot-from", str(path), "--out", str(tmp_path / "figures")])
    assert drawn == {"out": str(tmp_path / "figures"),
                     "names": ["compare_default_loss.png", "compare_default_ms_per_step.png"]}
    assert titles == ["2026-11-23, 2 CPUs (AMD EPYC), torch 2.13.0+cpu, outputs on cpu"], "the date from its path"
    printed = capsys.readouterr().out
    assert "Note: 4. took 17.00 ms" in printed and "Note: 5. (fused) took 26.60 ms" in printed
