"""The report's parts: what a table of docs/results.md is declared with
(spec), where the declarations are found (tables) and how a page is
rendered from result rows (render). A group's _tables.py imports the
declaration parts from here."""
from _report.spec import (SCALE, Across, Calc, Cell, Col, Fig, Label, OverRuns, Row, Table,  # noqa: F401
                          contender, fixed, lo_hi, none_if_zero, pct, sig, spreads, times, verdict)
