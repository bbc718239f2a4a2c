"""The speed figures the README and docs/index.md claim (every "1.12x",
each end of a "0.13-0.14x") appear on docs/results.md, where each has its
workload, machine, date and run: a figure retyped wrong, or a ratio
worked out for the front page and never shown beside its data, fails.
A figure matches a number on the page written to at least its places
(0.69x matches 0.690 or 0.69, not 0.7)."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _places(number):
    return len(number.split(".")[1]) if "." in number else 0


def missing_figures(claims, page):
    """The ratios of `claims` that no number of `page` gives, each with
    the words around it."""
    shown = [n.replace(",", "") for n in NUMBER.findall(page)]
    missing = []
    for m in RATIO.finditer(claims):
        for figure in filter(None, m.groups()):
            places = _places(figure)
            if not any(_places(n) >= places and round(float(n), places) == float(figure) for n in shown):
                context = claims[max(0, m.start() - 60):m.end()].replace("\n", " ")
                missing.append(f"{figure}x in '...{context}'")
    return missing


def test_the_check_finds_a_figure_the_page_lacks():
    page = "| hostembed | 3.32 ms | 1.12x | 0.690 |"
    assert missing_figures("at 1.12x and 0.69x", page) == []
    assert missing_figures("from 0.69-1.12x", page) == []
    assert missing_figures("at 1.2x", page) == ["1.2x in '...at 1.2x'"]  # 1.12 is not 1.2
    assert missing_figures("at 0.7x", "0.71") == []  # written to fewer places: rounds
    assert missing_figures("at 0.71x", "0.7") == ["0.71x in '...at 0.71x'"]
    assert len(missing_figures("0.85-0.96x", page)) == 2


@pytest.mark.parametrize("claims", ["README.md", "docs/index.md"])
def test_every_speed_figure_is_on_the_results_page(claims):
    missing = missing_figures(_read(claims), _read("docs/results.md"))
    assert not missing, f"{claims} claims figures that docs/results.md does not show:\n" + "\n".join(missing)
