"""The parts a table of docs/results.md is declared with (benchmarks/<group>/
_tables.py): how a figure is written (number formats, unit conversions)
and what a table selects (Fig, Calc, Label, Col, Cell, Row, Table).

A `where` is a dict of a row's field ("benchmark", "folder", "run",
"contender", "date", ...) or "workload.NAME" to the value it must have (a
tuple: one of its values; a missing workload field is None). A cell's rows
are those of its table's, its row's and its column's `where`; each run
among them gives one text from the column's template (a run without one of
the template's figures gives none).
"""
import math
from dataclasses import dataclass, field
from typing import Callable

def fixed(places):
    """Thousands grouped, `places` decimals: 2,049.4."""
    return lambda v: f"{v:,.{places}f}"


def _sig_places(v, digits):
    return 0 if v == 0 else max(0, digits - 1 - math.floor(math.log10(abs(v))))


def sig(digits, suffix=""):
    """`digits` significant digits (at least the integer part): 30.0, 2.34, 13.6."""
    return lambda v: f"{v:,.{_sig_places(v, digits)}f}{suffix}"


def times(places):
    """A ratio: 1.12x."""
    return lambda v: f"{v:.{places}f}x"


def pct(places):
    """A fraction as a percentage: 0.733 -> 73.3%."""
    return lambda v: f"{100 * v:.{places}f}%"


def none_if_zero(fmt, text="(none)"):
    """`text` for a zero (a rate of something that did not happen)."""
    return lambda v: text if v == 0 else fmt(v)


def verdict(v):
    """The verdict on a difference in units of the reference's spread:
    within one spread holds (✓); beyond it, better or worse."""
    return "✓" if abs(v) <= 1 else ("(better)" if v > 0 else "✗")


def spreads(v):
    """A difference in units of the reference's spread, with its verdict."""
    return f"{v:+.1f} {verdict(v)}"


# A row's unit -> the unit a table writes it in.
SCALE = {("bytes", "GiB"): 2 ** -30, ("bytes", "MiB"): 2 ** -20, ("bytes", "MB"): 1e-6,
         ("bytes/step", "MiB"): 2 ** -20, ("bytes/step", "MB"): 1e-6, ("GiB", "GiB"): 1.0}



@dataclass(frozen=True)
class Fig:
    """One row's value: the row of the run with this metric (and `where`)."""
    metric: str
    fmt: Callable = None
    where: dict = field(default_factory=dict)
    to: str = None  # the unit to write it in, converted from the row's (SCALE)


@dataclass(frozen=True)
class Calc:
    """A value worked out from several rows of one run (a ratio, a difference)."""
    fn: Callable
    fmt: Callable
    args: tuple  # of Fig, whose fmt is unused


@dataclass(frozen=True)
class Across:
    """A value worked out from rows of different runs: each argument's row
    from the newest run that has one (two scripts measured in turn, as
    sharded_step.py and TorchRec's peer). A template with one is rendered
    once for the cell, not once a run."""
    fn: Callable
    fmt: Callable
    args: tuple  # of Fig, whose fmt is unused


@dataclass(frozen=True)
class OverRuns:
    """One value from every run of a cell: `fn` (max, min, or lo_hi for a
    span) over each run's value of `part` (a Fig or a Calc of one run). A
    template with one is rendered once for the cell, not once a run."""
    fn: Callable
    fmt: Callable
    part: object


def lo_hi(values):
    """The least and the most (OverRuns' span)."""
    return min(values), max(values)


@dataclass(frozen=True)
class Label:
    """A workload field of the cell's rows, written beside a figure ("(20%)")."""
    field: str
    fmt: Callable


@dataclass
class Col:
    """A figure column: its header and the template of each run's text."""
    header: str
    parts: list  # the template of one run's text: str literals, Fig, Calc, Label
    align: str = "---:"
    where: dict = field(default_factory=dict)
    join: str = " / "  # between runs
    collapse: bool = False  # runs that give the same text are written once
    suffix: str = ""  # after the joined runs ("3.77 / 0.85 GiB")


@dataclass
class Cell:
    """A row's own template for a column; with `where`, its own selection
    (the table's `where` and this, not the row's and the column's)."""
    parts: list
    where: dict = None


@dataclass
class Row:
    """A table row: its label cells and the rows it selects."""
    labels: list
    where: dict
    cells: dict = field(default_factory=dict)  # column index -> Cell
    bold: tuple = ()  # column indices (labels first) written in bold


@dataclass
class Table:
    """Which rows (`where`), the label columns, the figure columns, the rows."""
    where: dict
    labels: list  # (header, align) of the label columns
    cols: list
    rows: list


def contender(name):
    """A table row's selection: one contender's rows."""
    return {"contender": name}

