"""Renders the tables of docs/results.md and README.md from the result rows
under benchmarks/results/ (the schema of _rows.py: one measured figure a row).

    python benchmarks/report.py               # rewrites both pages' generated tables in place
    python benchmarks/report.py --check       # exits 1 and names each table that differs
    python benchmarks/report.py --show NAME   # prints one table as the rows render it

A generated table sits between two marker comments on the page:

    <!-- table: NAME -->
    | ... the table, then one line naming its runs: folder, device, date, commit ... |
    <!-- /table -->

NAME is declared in the _tables.py of the benchmark group whose rows it
shows (benchmarks/<group>/_tables.py, with the parts of benchmarks/_report).
Only the text between the markers is the report's; the prose around them
stays hand-written. A table definition says which rows it shows (`where`:
the benchmark, run folder, runs, workload fields), what its rows and
columns select (a contender, a workload field, a metric), and how each
figure is written (its places, its unit). Where a cell selects several runs
(the same workload measured more than once), their figures are joined
newest run first (runs of the same date in the order their rows were
written).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO_ROOT, RESULTS_DIR, read_rows  # noqa: E402
# The parts and the renderer, as tests/test_results_rows.py reaches them through this script.
from _report.render import CLOSE, blocks, check_page, render_cell, render_page, render_table, row_key  # noqa: E402,F401
from _report.spec import (SCALE, Across, Col, Fig, Label, fixed, none_if_zero, pct, sig,  # noqa: E402,F401
                          spreads, times)
from _report.tables import TABLES  # noqa: E402

PAGE = os.path.join(REPO_ROOT, "docs", "results.md")
PAGES = [PAGE, os.path.join(REPO_ROOT, "README.md")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the rows render")
    parser.add_argument("--show", metavar="NAME", help="print table NAME as the rows render it (the page unchanged)")
    parser.add_argument("--page", action="append", help="a page (default: docs/results.md and README.md)")
    parser.add_argument("--results", default=RESULTS_DIR, help="the run folders (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = read_rows(args.results)
    if args.show:
        if args.show not in TABLES:
            print(f"no table {args.show}; declared: {', '.join(sorted(TABLES))}", file=sys.stderr)
            return 2
        print(render_table(args.show, rows).markdown, end="")
        return 0
    status = 0
    for page in args.page or PAGES:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        if args.check:
            problems = check_page(text, rows)
            for problem in problems:
                print(f"{os.path.relpath(page)}: {problem}", file=sys.stderr)
            if problems:
                print(f"{page}: regenerate with `python benchmarks/report.py`", file=sys.stderr)
                status = 1
            continue
        new = render_page(text, rows)
        if new != text:
            with open(page, "w", encoding="utf-8") as f:
                f.write(new)
        print(f"{os.path.relpath(page)}: {len(blocks(new)[0])} tables rendered from {len(rows)} rows")
    return status

if __name__ == "__main__":
    sys.exit(main())
