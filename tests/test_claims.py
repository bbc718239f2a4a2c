"""The speed figures the README and docs/index.md claim (every "1.12x",
each end of a "0.13-0.14x") appear on docs/results.md as ratios, where
each has its workload, machine, date and run: a figure retyped wrong, or a
ratio worked out for the front page and never shown beside its data,
fails. A ratio on the page is a number followed by x, or a number in a
table column headed as one ("speedup", "x torch Adam"); a figure matches
one written to at least its places (0.69x matches 0.690 or 0.69, not
0.7). A table generated from result rows (between `<!-- table: NAME -->`
and `<!-- /table -->`) is left out of the claims: tests/test_results_rows.py
checks each of its figures against the rows it came from."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
RATIO_COLUMN = re.compile(r"(^|\s)x(\s|$)|speedup", re.I)
GENERATED = re.compile(r"^<!-- table: [\w-]+ -->$.*?^<!-- /table -->$", re.M | re.S)


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _places(number):
    return len(number.split(".")[1]) if "." in number else 0


def page_ratios(page):
    """Every ratio `page` shows: numbers followed by x, and the numbers of
    its Markdown tables' ratio columns."""
    found = [figure for m in RATIO.finditer(page) for figure in m.groups() if figure]
    header = None
    for line in page.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            for name, cell in zip(header, cells):
                if RATIO_COLUMN.search(name):
                    found += NUMBER.findall(cell)
    return found


def missing_figures(claims, page):
    """The ratios of `claims` (outside its generated tables) that no ratio
    of `page` gives, each with the words around it."""
    claims = GENERATED.sub("", claims)
    shown = [n.replace(",", "") for n in page_ratios(page)]
    missing = []
    for m in RATIO.finditer(claims):
        for figure in filter(None, m.groups()):
            places = _places(figure)
            if not any(_places(n) >= places and round(float(n), places) == float(figure) for n in shown):
                context = claims[max(0, m.start() - 60):m.end()].replace("\n", " ")
                missing.append(f"{figure}x in '...{context}'")
    return missing


def test_the_check_finds_a_figure_the_page_lacks():
    page = "| hostembed | 3.32 ms | 1.12x | 0.690x |"
    assert missing_figures("at 1.12x and 0.69x", page) == []
    assert missing_figures("from 0.69-1.12x", page) == []
    assert missing_figures("at 1.2x", page) == ["1.2x in '...at 1.2x'"]  # 1.12 is not 1.2
    assert missing_figures("at 0.7x", "0.71x") == []  # written to fewer places: rounds
    assert missing_figures("at 0.71x", "0.7x") == ["0.71x in '...at 0.71x'"]
    assert len(missing_figures("0.85-0.96x", page)) == 2
    assert missing_figures("at 3.32x", page) == ["3.32x in '...at 3.32x'"]  # a time, not a ratio
    table = "| contender | ms/step | x torch Adam |\n|---|---:|---:|\n| swap | 109.9 | 5.36 |\n"
    assert missing_figures("5.4x", table) == [] and len(missing_figures("109.9x", table)) == 1
    generated = "<!-- table: readme-results -->\n| a | 7.7x |\n<!-- /table -->\nthen 7.8x"
    assert [m.split(" in ")[0] for m in missing_figures(generated, page)] == ["7.8x"]  # 7.7x is the rows'


@pytest.mark.parametrize("claims", ["README.md", "docs/index.md"])
def test_every_speed_figure_is_on_the_results_page(claims):
    missing = missing_figures(_read(claims), _read("docs/results.md"))
    assert not missing, f"{claims} claims figures that docs/results.md does not show:\n" + "\n".join(missing)
