"""Rendering docs/results.md's generated tables from result rows: a table's
cells (each run's figures, newest run first), the line naming the runs the
figures came from, and the page's marker blocks (found, rendered, checked).

A generated table sits between two marker comments on the page:

    <!-- table: NAME -->
    | ... the table, then one line naming its runs: folder, device, date, commit ... |
    <!-- /table -->
"""
import dataclasses
import json
import re
from dataclasses import dataclass

from _report.spec import SCALE, Across, Calc, Fig, Label, OverRuns
from _report.tables import TABLES

OPEN = re.compile(r"^<!-- table: ([\w-]+) -->$")
CLOSE = "<!-- /table -->"

def _field(row, key):
    if key.startswith("workload."):
        return row["workload"].get(key[len("workload."):])
    return row.get(key)


def matches(row, where):
    """Every key of `where` holds for `row`: equal, or one of a tuple's values."""
    for key, want in where.items():
        have = _field(row, key)
        if isinstance(want, tuple) and not isinstance(have, tuple):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def row_key(row):
    """What names one row among all of them (its run, what and how measured)."""
    return (row["folder"], row["run"], row["contender"], row["metric"], json.dumps(row["workload"], sort_keys=True))


def runs_newest_first(rows):
    """The rows grouped by run, newest first; runs of the same date (or
    none) in the order their rows came (sorted() keeps ties' order)."""
    runs = {}
    for row in rows:
        runs.setdefault((row["folder"], row["run"]), []).append(row)
    return sorted(runs.values(), key=lambda run_rows: run_rows[0]["date"] or "", reverse=True)


def _one(rows, fig):
    found = [r for r in rows if r["metric"] == fig.metric and matches(r, fig.where)]
    if len(found) > 1:
        raise ValueError(f"{fig} matches {len(found)} rows of one run: {[row_key(r) for r in found]}")
    return found[0] if found else None


def _value(row, fig):
    if fig.to is None or fig.to == row["unit"]:
        return row["value"]
    return row["value"] * SCALE[(row["unit"], fig.to)]


def render_run(parts, rows):
    """One run's pieces of a cell, or None where the run lacks a figure the
    template needs. A piece: ("text", s), ("label", s, field) or
    ("figure", s, value, [row keys])."""
    pieces = []
    for part in parts:
        if isinstance(part, str):
            pieces.append(("text", part))
        elif isinstance(part, Fig):
            row = _one(rows, part)
            if row is None:
                return None
            value = _value(row, part)
            pieces.append(("figure", part.fmt(value), value, [row_key(row)]))
        elif isinstance(part, Calc):
            found = [_one(rows, arg) for arg in part.args]
            if None in found:
                return None
            value = part.fn(*(_value(row, arg) for row, arg in zip(found, part.args)))
            pieces.append(("figure", part.fmt(value), value, [row_key(row) for row in found]))
        elif isinstance(part, Label):
            values = {json.dumps(r["workload"].get(part.field)) for r in rows}
            if len(values) != 1:
                raise ValueError(f"the rows of one run disagree on {part.field}: {values}")
            pieces.append(("label", part.fmt(rows[0]["workload"][part.field]), part.field))
    return pieces


def _across_runs(part, runs):
    """An Across or OverRuns part over a cell's runs (newest first): its
    value and the rows it came from, or None where a run it needs is missing."""
    if isinstance(part, Across):
        found = [next((row for run_rows in runs if (row := _one(run_rows, arg)) is not None), None)
                 for arg in part.args]
        if None in found:
            return None
        return part.fn(*(_value(row, arg) for row, arg in zip(found, part.args))), found
    inner = part.part if part.part.fmt else dataclasses.replace(part.part, fmt=str)  # its own text is unused
    per_run = [pieces[0] for pieces in (render_run([inner], run_rows) for run_rows in runs) if pieces]
    if not per_run:
        return None
    by_key = {row_key(row): row for run_rows in runs for row in run_rows}
    return part.fn([piece[2] for piece in per_run]), [by_key[key] for piece in per_run for key in piece[3]]


def render_across(parts, rows):
    """A template of Across or OverRuns parts, labels and text, rendered once
    for the cell: [] where a part has no value."""
    runs = runs_newest_first(rows)
    pieces, used = [], []
    for part in parts:
        if isinstance(part, str):
            pieces.append(("text", part))
            continue
        if isinstance(part, Label):  # of the rows the figures before it came from
            values = {json.dumps(r["workload"].get(part.field)) for r in used}
            if len(values) != 1:
                raise ValueError(f"the rows before {part} disagree on (or lack) {part.field}: {values}")
            pieces.append(("label", part.fmt(used[0]["workload"][part.field]), part.field))
            continue
        if not isinstance(part, (Across, OverRuns)):
            raise ValueError(f"a template with Across or OverRuns parts holds only those, labels and text, not {part}")
        found = _across_runs(part, runs)
        if found is None:
            return []
        value, found_rows = found
        used += found_rows
        pieces.append(("figure", part.fmt(value), value, [row_key(row) for row in found_rows]))
    return pieces


def render_cell(parts, rows, col):
    """A cell's pieces: each run's, newest first, joined by the column's
    separator (identical ones once where the column collapses them)."""
    if any(isinstance(part, (Across, OverRuns)) for part in parts):
        return render_across(parts, rows)
    per_run = [p for p in (render_run(parts, run_rows) for run_rows in runs_newest_first(rows)) if p]
    if col.collapse:
        seen, kept = set(), []
        for pieces in per_run:
            text = "".join(p[1] for p in pieces)
            if text not in seen:
                seen.add(text)
                kept.append(pieces)
        per_run = kept
    cell = []
    for i, pieces in enumerate(per_run):
        cell += ([("text", col.join)] if i else []) + pieces
    return cell + [("text", col.suffix)] if cell and col.suffix else cell


@dataclass
class Rendered:
    markdown: str
    cells: list  # (row index, column index, pieces) of the figure columns
    runs: list  # (folder, run) of every row the figures came from


def render_table(name, rows):
    table = TABLES[name]
    selected = [r for r in rows if matches(r, table.where)]
    lines = ["| " + " | ".join([h for h, _ in table.labels] + [c.header for c in table.cols]) + " |",
             "|" + "|".join([a for _, a in table.labels] + [c.align for c in table.cols]) + "|"]
    cells, used = [], []
    for i, spec in enumerate(table.rows):
        texts = list(spec.labels)
        for j, col in enumerate(table.cols):
            own = spec.cells.get(j)
            if own is not None and own.where is not None:
                candidates = [r for r in selected if matches(r, own.where)]
            else:
                candidates = [r for r in selected if matches(r, spec.where) and matches(r, col.where)]
            pieces = render_cell(own.parts if own is not None else col.parts, candidates, col)
            cells.append((i, j, pieces))
            used += [key for p in pieces if p[0] == "figure" for key in p[3]]
            texts.append("".join(p[1] for p in pieces))
        for k in spec.bold:
            if texts[k]:
                texts[k] = f"**{texts[k]}**"
        lines.append("|" + "|".join(f" {text} " if text else " " for text in texts) + "|")
    runs = list(dict.fromkeys((key[0], key[1]) for key in used))
    return Rendered("\n".join(lines) + "\n\n" + footer(rows, used) + "\n", cells, runs)


def _host(row):
    machine = row["machine"]
    about = [machine["cpu_model"], machine["cores"] and f"{machine['cores']} cores",
             machine["torch"] and f"torch {machine['torch']}"]
    return f"{row['device']} ({', '.join(str(x) for x in about if x)})"


def _run_line(row):
    commit = row["commit"][:7] + (", dirty" if row["commit"].endswith("-dirty") else "") if row["commit"] else None
    return f"`{row['folder']}/{row['run']}` ({(row['date'] or 'date unknown')[:10]}, commit {commit or 'unknown'})"


def footer(rows, used):
    """One line naming where the figures came from: per device and machine,
    each run (its folder and name, date and commit), newest first; then the
    runs that carried figures published by others."""
    keys = set(used)
    runs = runs_newest_first([r for r in rows if row_key(r) in keys and not r["workload"].get("published")])
    hosts = {}
    for run_rows in runs:
        hosts.setdefault(_host(run_rows[0]), []).append(_run_line(run_rows[0]))
    parts = [f"{host}: {', '.join(lines)}" for host, lines in hosts.items()]
    for run_rows in runs_newest_first([r for r in rows if row_key(r) in keys and r["workload"].get("published")]):
        row = run_rows[0]
        parts.append(f"figures published for {row['device']}, as `{row['folder']}/{row['run']}` carries them")
    return "Data: " + "; ".join(parts) + "."


# --- the page -------------------------------------------------------------------------------

def blocks(text):
    """The generated blocks of a page: (name, first line, end line) with the
    content lines[first:end], and the marker problems found."""
    lines = text.split("\n")
    found, problems, open_at = [], [], None
    for n, line in enumerate(lines):
        opened = OPEN.match(line)
        if line.startswith("<!-- table") and not opened:
            problems.append(f"line {n + 1}: a malformed marker: {line}")
        if opened:
            if open_at is not None:
                problems.append(f"line {n + 1}: table {opened.group(1)} opens inside {open_at[0]}")
            open_at = (opened.group(1), n)
        elif line.strip() == CLOSE:
            if open_at is None:
                problems.append(f"line {n + 1}: a close marker without an open one")
            else:
                found.append((open_at[0], open_at[1] + 1, n))
                open_at = None
    if open_at is not None:
        problems.append(f"line {open_at[1] + 1}: table {open_at[0]} is never closed")
    for name, _, _ in found:
        if name not in TABLES:
            problems.append(f"table {name}: no such table (declared in no benchmarks/<group>/_tables.py)")
    names = [name for name, _, _ in found]
    problems += [f"table {name} appears {names.count(name)} times" for name in sorted(set(names))
                 if names.count(name) > 1]
    return found, problems


def render_page(text, rows):
    """The page with every generated block rendered from `rows`."""
    lines = text.split("\n")
    found, problems = blocks(text)
    if problems:
        raise ValueError("; ".join(problems))
    for name, first, end in reversed(found):
        lines[first:end] = render_table(name, rows).markdown.rstrip("\n").split("\n")
    return "\n".join(lines)


def check_page(text, rows):
    """What differs between the page and what the rows render: one line a
    problem, naming the table (empty when the page is current)."""
    found, problems = blocks(text)
    if problems:
        return problems
    lines = text.split("\n")
    for name, first, end in found:
        want = render_table(name, rows).markdown.rstrip("\n").split("\n")
        have = lines[first:end]
        if have != want:
            diff = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            problems.append(f"table {name} differs from its rows (line {first + diff + 1}):\n"
                            f"  page: {have[diff] if diff < len(have) else '(nothing)'}\n"
                            f"  rows: {want[diff] if diff < len(want) else '(nothing)'}")
    return problems

