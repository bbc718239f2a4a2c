"""Results are data: every generated table of docs/results.md and README.md is what the
result rows under benchmarks/results/ render (benchmarks/report.py), each
of its figures is a row's value (or worked out from rows' values), every
row has the schema's fields (benchmarks/_rows.py), and the committed rows
are what benchmarks/recover_rows.py makes from the runs' own JSON. Fast and
CPU-only: it reads files and renders text."""
import json
import math
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402  (benchmarks/ on the path first)
import recover_rows  # noqa: E402
import report  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "results.md")
# Only a GPU table may stay without its run (until a GPU reruns it): a CPU one is rerun.
HAND = re.compile(r"^<!-- hand table: no committed run \(GPU run, logs not kept\) -->$")


@pytest.fixture(scope="module")
def rows():
    return _common.read_rows()


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module", params=report.PAGES, ids=os.path.basename)
def page(request):
    return _read(request.param)


def rows_files():
    return sorted(os.path.join(_common.RESULTS_DIR, name, _common.ROWS_FILE)
                  for name in os.listdir(_common.RESULTS_DIR)
                  if os.path.isfile(os.path.join(_common.RESULTS_DIR, name, _common.ROWS_FILE)))


# (a) the page is what the rows render

def test_the_page_is_what_the_rows_render(page, rows):
    problems = report.check_page(page, rows)
    assert not problems, "\n".join(problems) + "\nregenerate with `python benchmarks/report.py`"


def test_the_check_reports_a_changed_figure_and_the_report_puts_it_back(tmp_path, capsys):
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    start = text.index("<!-- table: lm-step -->")
    figure = "| 441.5 |"  # hostembed's ms/step, vocabulary 50,257, tied
    at = text.index(figure, start)
    assert at < text.index(report.CLOSE, start)
    copy = tmp_path / "results.md"
    copy.write_text(text[:at] + "| 441.6 |" + text[at + len(figure):], encoding="utf-8")

    assert report.main(["--check", "--page", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "table lm-step differs" in err and "441.6" in err and "441.5" in err

    assert report.main(["--page", str(copy)]) == 0  # rewrites the block from the rows
    assert copy.read_text(encoding="utf-8") == text
    assert report.main(["--check", "--page", str(copy)]) == 0


def test_the_check_reports_a_table_whose_rows_changed(rows):
    changed = [dict(r, value=r["value"] * 2) if r["benchmark"] == "state_step" else r for r in rows]
    problems = report.check_page(_read(PAGE), changed)
    assert len(problems) == 1 and problems[0].startswith("table state-step differs"), problems


# (b) every generated figure comes from rows

def provenance_problems(name, rows):
    """Where a rendered table's figures do not come from rows: a literal
    with a digit in it (a figure typed into the definition), a figure whose
    rows are not exactly one row each, a figure that is not its one row's
    value (in the row's unit or the table's), a label not of the rows' own
    workload."""
    by_key = {}
    for row in rows:
        by_key.setdefault(report.row_key(row), []).append(row)
    rendered = report.render_table(name, rows)
    problems = [] if any(p[0] == "figure" for _, _, pieces in rendered.cells for p in pieces) else ["no figure"]
    for i, j, pieces in rendered.cells:
        keys = [key for p in pieces if p[0] == "figure" for key in p[3]]
        for piece in pieces:
            where = f"{name} row {i} column {j}: {piece[:2]}"
            if piece[0] == "text":
                if re.search(r"\d", piece[1]):
                    problems.append(f"{where}: a literal figure")
            elif piece[0] == "label":
                if not any(piece[2] in json.loads(key[4]) for key in keys):
                    problems.append(f"{where}: not a workload field of the cell's rows")
            else:
                _, text, value, piece_keys = piece
                if not piece_keys or any(len(by_key.get(key, [])) != 1 for key in piece_keys):
                    problems.append(f"{where}: not exactly one row each: {piece_keys}")
                elif len(piece_keys) == 1:
                    have = by_key[piece_keys[0]][0]["value"]
                    if not any(math.isclose(value, have * s, rel_tol=1e-12) for s in [1.0, *report.SCALE.values()]):
                        problems.append(f"{where}: {value} is not the row's {have}")
    return problems


def test_every_generated_figure_comes_from_rows(page, rows):
    names = [name for name, _, _ in report.blocks(page)[0]]
    assert names
    problems = [p for name in names for p in provenance_problems(name, rows)]
    assert not problems, "\n".join(problems)


def test_a_figure_typed_into_a_definition_is_caught(rows, monkeypatch):
    table = report.TABLES["lm-step"]
    monkeypatch.setattr(table, "cols", table.cols + [report.Col("typed", ["446.5"])])
    assert any("a literal figure" in p for p in provenance_problems("lm-step", rows))


def test_every_generated_table_names_its_runs(page, rows):
    for name, first, end in report.blocks(page)[0]:
        rendered = report.render_table(name, rows)
        line = rendered.markdown.rstrip("\n").split("\n")[-1]
        assert line.startswith("Data: ")
        for folder, run in rendered.runs:
            assert f"`{folder}/{run}`" in line, (name, folder, run)


# (c) every row has the schema's fields

@pytest.mark.parametrize("path", rows_files(), ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_every_row_has_the_schema(path):
    rows = _common.read_rows_file(path)
    assert rows
    problems = [f"line {n + 1}: {p}" for n, row in enumerate(rows) for p in _common.row_problems(row)]
    assert not problems, "\n".join(problems[:20])
    keys = [report.row_key(dict(row, folder="")) for row in rows]
    twice = {k for k in keys if keys.count(k) > 1}
    assert not twice, f"the same figure twice in one run: {sorted(twice)[:5]}"


def test_the_schema_rejects_what_is_not_a_figure():
    ctx = {"benchmark": "b", "run": "r", "device": "cpu", "machine": dict(recover_rows.UNKNOWN_MACHINE),
           "commit": None, "date": "2026-11-29", "command": None}
    assert _common.make_row(ctx, {"n": 1}, "c", "m", 1.5, "ms")["value"] == 1.5
    for value in (True, float("nan"), "1.5", None):
        with pytest.raises(ValueError):
            _common.make_row(ctx, {}, "c", "m", value, "ms")
    with pytest.raises(ValueError):
        _common.make_row(dict(ctx, date="28 Nov"), {}, "c", "m", 1, "ms")
    with pytest.raises(ValueError):
        _common.make_row(ctx, {"nested": {"a": 1}}, "c", "m", 1, "ms")
    row = _common.make_row(ctx, {}, "c", "m", 1, "ms")
    assert _common.row_problems(dict(row, extra=1)) == ["unknown field 'extra'"]
    assert _common.row_problems(dict(row, machine={})) != []


def test_write_rows_replaces_a_run_in_place_and_keeps_the_others(tmp_path):
    ctx = {"benchmark": "b", "device": "cpu", "machine": dict(recover_rows.UNKNOWN_MACHINE), "commit": None,
           "date": "2026-11-29", "command": None}

    def run(name, value):
        return [_common.make_row(dict(ctx, run=name), {}, "c", "m", value, "ms")]

    folder = tmp_path / "run-folder"
    _common.write_rows(folder, run("one", 1) + run("two", 2))
    first = (folder / _common.ROWS_FILE).read_text()
    _common.write_rows(folder, run("one", 1) + run("two", 2))
    assert (folder / _common.ROWS_FILE).read_text() == first  # written twice, the same file
    _common.write_rows(folder, run("one", 3))  # a run written again replaces its rows, where they were
    _common.write_rows(folder, run("three", 4))
    written = _common.read_rows_file(folder / _common.ROWS_FILE)
    assert [(r["run"], r["value"]) for r in written] == [("one", 3), ("two", 2), ("three", 4)]
    assert {r["folder"] for r in _common.read_rows(tmp_path)} == {"run-folder"}


def test_the_committed_rows_are_what_their_runs_json_gives():
    for name, recover in recover_rows.FOLDERS.items():
        folder = os.path.join(_common.RESULTS_DIR, name)
        made = recover(folder)
        runs = {r["run"] for r in made}
        committed = [r for r in _common.read_rows_file(os.path.join(folder, _common.ROWS_FILE)) if r["run"] in runs]
        assert committed == made, f"{name}: rows.jsonl is not what recover_rows.py makes (run it again)"



def test_rows_a_benchmark_wrote_are_what_its_json_gives():
    # cache_plan.py writes its rows beside its JSON: each committed run of it
    # (named by the --json in its command) gives the same figures again.
    from _cache_plan_rows import reference_rows  # benchmarks/cache/, on the path recover_rows.py sets
    checked = 0
    for folder in sorted(os.listdir(_common.RESULTS_DIR)):
        path = os.path.join(_common.RESULTS_DIR, folder, _common.ROWS_FILE)
        if not os.path.exists(path):
            continue
        runs = {}
        for row in _common.read_rows_file(path):
            if row["benchmark"] == "cache_plan" and "--json" in (row["command"] or "") and "--protocol" not in row["command"]:
                runs.setdefault(row["run"], []).append(row)
        for run, rows in runs.items():
            json_path = re.search(r"--json (\S+)", rows[0]["command"]).group(1)
            with open(os.path.join(ROOT, json_path), encoding="utf-8") as f:
                made = reference_rows(json.load(f), {k: rows[0][k] for k in ("benchmark", "run", "device", "machine",
                                                                              "commit", "date", "command")})
            assert made == rows, f"{folder}/{run}: rows.jsonl is not what {json_path} gives"
            checked += 1
    assert checked >= 4  # the reference runs of cpu-2026-11-29-cache-planner

# (d) the markers

def test_every_table_declared_is_on_a_page():
    found = [name for path in report.PAGES for name, _, _ in report.blocks(_read(path))[0]]
    assert sorted(found) == sorted(report.TABLES), "a table declared but on no page, or on two"


def test_the_markers_are_well_formed(page):
    found, problems = report.blocks(page)
    assert not problems, problems
    lines = page.split("\n")
    for name, first, end in found:
        assert lines[first].startswith("| "), f"{name}: the block does not start with its table"
    for n, line in enumerate(lines):
        if line.startswith("<!-- hand table"):
            assert HAND.match(line), f"line {n + 1}: {line}"
            assert lines[n + 1].startswith("| "), f"line {n + 1}: a hand-table mark not right above a table"


@pytest.mark.parametrize("text, problem", [
    ("<!-- table: lm-step -->\n| a |\n", "never closed"),
    ("| a |\n<!-- /table -->\n", "without an open one"),
    ("<!-- table: no-such-table -->\n<!-- /table -->\n", "no such table"),
    ("<!-- table: lm-step -->\n<!-- table: state-step -->\n<!-- /table -->\n", "opens inside"),
    ("<!-- table:lm-step -->\n", "malformed"),
    ("<!-- table: lm-step -->\n<!-- /table -->\n<!-- table: lm-step -->\n<!-- /table -->\n", "appears 2 times"),
])
def test_the_marker_check_finds_a_broken_marker(text, problem, rows):
    problems = report.blocks(text)[1]
    assert any(problem in p for p in problems), problems
    assert report.check_page(text, rows) == problems


# the report's own rules

def test_runs_are_joined_newest_first():
    def row(run, date, value):
        return {"folder": "f", "run": run, "date": date, "contender": "c", "metric": "m", "workload": {},
                "value": value, "unit": "ms"}

    rows = [row("old", "2026-11-25", 1.0), row("new", "2026-11-27", 3.0), row("same-day", "2026-11-25", 2.0)]
    pieces = report.render_cell([report.Fig("m", report.fixed(1))], rows, report.Col("h", []))
    assert "".join(p[1] for p in pieces) == "3.0 / 1.0 / 2.0"  # a date's runs in the order written
    collapsed = report.render_cell([report.Fig("m", report.fixed(0))], rows, report.Col("h", [], collapse=True))
    assert "".join(p[1] for p in collapsed) == "3 / 1 / 2"
    same = [row("a", "2026-11-25", 1.0), row("b", "2026-11-26", 1.0)]
    collapsed = report.render_cell([report.Fig("m", report.fixed(1))], same, report.Col("h", [], collapse=True))
    assert "".join(p[1] for p in collapsed) == "1.0"


def test_a_figure_across_runs_takes_each_argument_from_its_newest_run():
    # Two scripts measured in turn (sharded_step.py, TorchRec's peer) are
    # separate runs: a ratio of theirs takes each side's newest run.
    def row(run, date, contender, value, procs=4):
        return {"folder": "f", "run": run, "date": date, "contender": contender, "metric": "m",
                "workload": {"procs": procs}, "value": value, "unit": "ms"}

    rows = [row("ours-old", "2026-11-25", "ours", 1.0), row("theirs", "2026-11-26", "theirs", 30.0),
            row("ours-new", "2026-11-27", "ours", 10.0)]
    ratio = report.Across(lambda t, o: t / o, report.times(1),
                          (report.Fig("m", where={"contender": "theirs"}), report.Fig("m", where={"contender": "ours"})))
    procs = report.Label("procs", lambda v: f"{v} processes")
    pieces = report.render_cell([ratio, " on ", procs], rows, report.Col("h", []))
    assert "".join(p[1] for p in pieces) == "3.0x on 4 processes"
    assert pieces[0][3] == [report.row_key(rows[1]), report.row_key(rows[2])]
    # A side no run has leaves the cell empty, never a figure from elsewhere.
    assert report.render_cell([ratio], rows[:1], report.Col("h", [])) == []


def test_a_runs_name_is_its_start_to_the_microsecond():
    # Two runs of one benchmark into one folder in the same second must not
    # share a name: write_rows would replace the first's rows.
    info = {"cpu_model": "x", "usable_cpus": 2, "torch": "2.13", "git": None}
    context = _common.run_context("bench", info=info, command="c")
    assert re.fullmatch(r"bench-\d{8}T\d{6}\.\d{6}Z", context["run"])
    assert context["date"].startswith(context["run"][6:10])


def test_an_unnamed_run_lands_in_its_device_and_days_folder():
    folder = _common.run_folder()
    assert os.path.dirname(folder) == _common.RESULTS_DIR
    assert re.fullmatch(r"cpu-\d{4}-\d{2}-\d{2}", os.path.basename(folder))


def test_the_number_formats():
    assert report.fixed(1)(2049.37) == "2,049.4"
    assert [report.sig(3)(v) for v in (29.987, 2.3444, 13.604, 0.25)] == ["30.0", "2.34", "13.6", "0.250"]
    assert [report.sig(2, "x")(v) for v in (9.01, 55.2, 2.84)] == ["9.0x", "55x", "2.8x"]
    assert report.pct(1)(0.73265) == "73.3%" and report.times(2)(1.0115) == "1.01x"
    assert [report.spreads(v) for v in (0.45, 1.2, -14.5, -0.04)] == \
        ["+0.5 ✓", "+1.2 (better)", "-14.5 ✗", "-0.0 ✓"]
    assert report.none_if_zero(report.fixed(2))(0.0) == "(none)"
