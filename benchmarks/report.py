"""Renders the tables of docs/results.md from the result rows under
benchmarks/results/ (the schema of _common.py: one measured figure a row).

    python benchmarks/report.py            # rewrites the generated tables in place
    python benchmarks/report.py --check    # exits 1 and names each table that differs

A generated table sits between two marker comments on the page:

    <!-- table: NAME -->
    | ... the table, then one line naming its runs: folder, device, date, commit ... |
    <!-- /table -->

NAME is a key of TABLES below. Only the text between the markers is the
report's; the prose around them stays hand-written. A table definition says
which rows it shows (`where`: the benchmark, run folder, runs, workload
fields), what its rows and columns select (a contender, a workload field, a
metric), and how each figure is written (its places, its unit). Where a cell
selects several runs (the same workload measured more than once), their
figures are joined newest run first (runs of the same date in the order
their rows were written).
"""
import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(sys.path[0], "cache"))  # benchmarks/cache/: _cache_oracles
import _cache_oracles as oracles  # noqa: E402
from _common import REPO_ROOT, RESULTS_DIR, read_rows  # noqa: E402

PAGE = os.path.join(REPO_ROOT, "docs", "results.md")
OPEN = re.compile(r"^<!-- table: ([\w-]+) -->$")
CLOSE = "<!-- /table -->"


# --- number formats: value -> text -----------------------------------------------------

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


def spreads(v):
    """A difference in units of the reference's spread, with its verdict:
    within one spread holds (✓); beyond it, better or worse."""
    mark = "✓" if abs(v) <= 1 else ("(better)" if v > 0 else "✗")
    return f"{v:+.1f} {mark}"


# A row's unit -> the unit a table writes it in.
SCALE = {("bytes", "GiB"): 2 ** -30, ("bytes", "MiB"): 2 ** -20, ("bytes", "MB"): 1e-6,
         ("bytes/step", "MiB"): 2 ** -20, ("bytes/step", "MB"): 1e-6, ("GiB", "GiB"): 1.0}


# --- table definitions ----------------------------------------------------------------------
#
# A `where` is a dict of a row's field ("benchmark", "folder", "run",
# "contender", "date", ...) or "workload.NAME" to the value it must have (a
# tuple: one of its values; a missing workload field is None). A cell's rows
# are those of its table's, its row's and its column's `where`; each run
# among them gives one text from the column's template (a run without one of
# the template's figures gives none).

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


def _contender(name):
    """A table row's selection: one contender's rows."""
    return {"contender": name}


STATE_FORMS = [  # (label, state_step.py's form, bold)
    ("float32 / float32 (torch's SparseAdam state)", "fp32", False), ("float32 / bfloat16", "bf16_state", False),
    ("float32 / 8-bit", "int8", False), ("float32 / float32 exp_avg, row-wise exp_avg_sq", "rowwise", False),
    ("float32 / 8-bit exp_avg, row-wise exp_avg_sq", "int8_rowwise", False),
    ("bfloat16 / float32", "bf16_table", False), ("bfloat16 / 8-bit", "bf16_int8", True),
    ("bfloat16 / 8-bit exp_avg, row-wise exp_avg_sq", "bf16_int8_rowwise", True),
]
UNFUSED, FUSED = {"workload.fused": False}, {"workload.fused": True}

KG_FORMS = [  # (label, state_quality.py's form)
    ("float32 / bfloat16", "bf16_state"), ("float32 / 8-bit", "int8"),
    ("float32 / 8-bit, stochastic rounding", "int8_sr"), ("float32 / row-wise exp_avg_sq", "rowwise"),
    ("float32 / 8-bit exp_avg, row-wise exp_avg_sq", "int8_rowwise"), ("bfloat16 / float32", "bf16_table"),
    ("bfloat16 / 8-bit", "bf16_table_int8"),
    ("bfloat16 / 8-bit exp_avg, row-wise exp_avg_sq (3.06 bytes)", "bf16_table_int8_rowwise"),
]
KG_DATASETS = [("UMLS", "kg_umls"), ("Nations", "kg_nations"), ("Kinships", "kg_kinships")]

LM_TORCH, LM_HOSTEMBED = "torch nn.Embedding", "hostembed.Embedding (plain swap)"
LM_SIZES = ["", Fig("table_weight", fixed(0), to="MiB"), " + ", Fig("table_grad", fixed(1), to="MiB"), " + ",
            Fig("table_optimizer_state", fixed(0), to="MiB"), " MiB"]

CMP_DENSE = "dense part alone (fixed embedding outputs, no tables)"
CMP_TORCH_CPU = "torch nn.Embedding(sparse=True) (CPU) + torch.optim.SparseAdam"
CMP_TORCH_GPU = "torch nn.Embedding(sparse=True) (GPU) + torch.optim.SparseAdam"
CMP_HOSTEMBED = "hostembed.Embedding + hostembed.SparseAdam"
CMP_FUSED = "hostembed.Embedding + hostembed.SparseAdam(fused=True)"
CMP_CACHED = "hostembed.Embedding(cache_rows) + SparseAdam(fused=True), GPU cache"
CMP_DATES = ["2026-11-27", "2026-11-26", "2026-11-25"]
CMP_SPEED = Calc(lambda gpu, ours: gpu / ours, times(2), (Fig("step_time_median", where={"contender": CMP_TORCH_GPU}),
                                                        Fig("step_time_median", where={"contender": CMP_HOSTEMBED})))

GPU_MODES = [("on the CPU (16 cores)", "hostembed, update on the CPU"),
             ('`"auto"` (chose the CPU)', 'hostembed, update="auto"'),
             ("on the GPU through the pinned mapping", "hostembed, update on the GPU"),
             ("fused, on the GPU during backward", "hostembed, fused (GPU update in backward)")]
TBE_UVM = "TorchRec/FBGEMM TBE, weights in host memory (UVM)"
TBE_ALL = "TorchRec/FBGEMM TBE, HBM cache of every touched row (state in host memory)"
TBE_80 = "TorchRec/FBGEMM TBE, cfr 0.8"
DYNAMICEMB_ALL = "NVIDIA dynamicemb, HBM cache with state, cfr 1.0"
DYNAMICEMB_80 = "dynamicemb, cfr 0.8"


def _published(*pairs):
    """A cell of published figures: "name figure, name figure"."""
    parts = []
    for name, contender in pairs:
        parts += [", " if parts else "", f"{name} ", Fig("step_time_mean", fixed(2), where={"contender": contender})]
    return Cell(parts, where={"workload.published": True})


DISK_ON, DISK_IN = {"contender": "hostembed, table on disk"}, {"contender": "hostembed, table in memory"}
DISK_RATIO = Calc(lambda disk, memory: disk / memory, sig(2, "x"),
                  (Fig("step_time_median", where=DISK_ON), Fig("step_time_median", where=DISK_IN)))
DISK_ROWS = [("SparseAdam", "sparse_adam", "Zipf(1.05)", "zipf"), ("SparseAdam", "sparse_adam", "uniform", "uniform"),
             ("row-wise Adagrad", "rowwise_adagrad", "Zipf(1.05)", "zipf"),
             ("row-wise Adagrad", "rowwise_adagrad", "uniform", "uniform")]


def _write_behind_cols():
    zipf, uniform = {"workload.ids": "zipf"}, {"workload.ids": "uniform"}
    disk = Fig("step_time_median", where=DISK_ON)
    floor, memory = Fig("io_floor", where=DISK_ON), Fig("step_time_median", where=DISK_IN)
    return [
        Col("disk reads/s, writes/s", [Fig("read_rate", fixed(0)), ", ", Fig("write_rate", fixed(0))], align="---",
            where={"contender": "the disk, rows at random"}),
        Col("Zipf: on disk ms", [Fig("step_time_median", fixed(1), DISK_ON)], where=zipf),
        Col("I/O floor ms", [Fig("io_floor", fixed(1), DISK_ON)], where=zipf),
        Col("in memory ms", [Fig("step_time_median", fixed(1), DISK_IN)], where=zipf),
        Col("above floor and in-memory step ms", [Calc(lambda d, f, m: d - f - m, fixed(1), (disk, floor, memory))],
            where=zipf),
        Col("on disk / in memory", [DISK_RATIO], where=zipf),
        Col("uniform: on disk ms", [Fig("step_time_median", fixed(1), DISK_ON)], where=uniform),
        Col("on disk / in memory", [DISK_RATIO], where=uniform),
    ]


def _one_record_cols():
    def on_disk(metric, fmt, to=None):
        return Fig(metric, fmt, DISK_ON, to)

    return [
        Col("on disk ms", [on_disk("step_time_median", fixed(1))], join=", "),
        Col("I/O floor ms", [on_disk("io_floor", fixed(1))], join=", "),
        Col("in memory ms", [Fig("step_time_median", fixed(1), DISK_IN)], join=", "),
        Col("on disk / in memory", [DISK_RATIO], join=", "),
        Col("hit rate", [on_disk("hit_rate", pct(1))], collapse=True),
        Col("misses a step", [on_disk("misses", fixed(0))], collapse=True),
        Col("reads a miss", [on_disk("reads_per_miss", fixed(2))], collapse=True),
        Col("writes an eviction", [on_disk("writes_per_eviction", none_if_zero(fixed(2)))], collapse=True),
        Col("disk MiB read / written a step (minimum)",
            [on_disk("disk_read", fixed(1), "MiB"), " / ", on_disk("disk_written", fixed(1), "MiB"), " (",
             on_disk("minimum_read", fixed(1), "MiB"), " / ", on_disk("minimum_written", fixed(1), "MiB"), ")"],
            align="---", collapse=True),
        Col("peak RSS MiB", [on_disk("peak_rss", fixed(0), "MiB")], join=", "),
        Col("files on disk GiB", [on_disk("files_on_disk", fixed(1), "GiB")], collapse=True),
    ]


# The row cache's planners: cache_plan.py, 2026-11-29.
PLANNER_FOLDER = "cpu-2026-11-29-cache-planner"
# The simulator's candidates, as cache_plan.py names them ([index] name).
CANDIDATE_NAMES = [f"[{i}] {c.name}" for i, c in enumerate(oracles.CANDIDATES)]
PLANNER_FREQUENCY, PLANNER_CLOCK = "planner: CPU planner, frequency (default)", "planner: CPU planner, clock"
STATIC, STATIC_RANKS, BELADY = "oracle: static top-frequency", "oracle: static top ranks", "oracle: Belady (bypass)"


def _hit_rate_cols(protocols):
    """A column a (protocol, cache fraction): the hit rate, 4 places."""
    return [Col(f"{label} {fraction:.0%}", [Fig("hit_rate", fixed(4))],
                where={"workload.protocol": protocol, "workload.fraction": fraction})
            for protocol, label, fractions in protocols for fraction in fractions]


ANCHOR_PROTOCOLS = [("dynamicemb", "dynamicemb", (0.8, 0.5, 0.2)), ("fbgemm", "FBGEMM", (0.2, 0.05))]
OWN_PROTOCOLS = [("fresh", "fresh", (0.8, 0.5, 0.2, 0.05)), ("replayed", "replayed", (0.8, 0.5, 0.2, 0.05))]
POLICY_ROWS = [Row(["CPU planner, frequency (the default)"], _contender(PLANNER_FREQUENCY), bold=(0,)),
               Row(["CPU planner, clock (before it)"], _contender(PLANNER_CLOCK)),
               Row(["static top-frequency (oracle)"], _contender(STATIC)),
               Row(["static top ranks by the generator's law (oracle)"], _contender(STATIC_RANKS)),
               Row(["Belady with bypass (oracle)"], _contender(BELADY))]
REFERENCE_COLS = [Col(f"{fraction:.0%}", [Fig("hit_rate", pct(1))], where={"workload.fraction": fraction})
                  for fraction in (1.0, 0.8, 0.2, 0.05)]


def _reference_rows():
    rows = []
    for stream, label in (("replayed", "a replayed 10-batch stream"), ("fresh", "a new batch every step")):
        for policy in ("frequency", "clock"):
            where = {"workload.stream": stream, "contender": f"CPU planner, {policy}"}
            rows.append(Row([f"hit rate, {label}", policy], where))
            rows.append(Row([f"plan ms/step, {label}", policy], where,
                            cells={j: Cell([Fig("plan_time_median", sig(3))]) for j in range(4)}))
    return rows


TABLES = {
    # Compact optimizer state (CPU): state_step.py, 2026-11-28.
    "state-step": Table(
        where={"benchmark": "state_step", "folder": "cpu-2026-11-28"},
        labels=[("table / moments", "---")],
        cols=[Col("bytes a parameter (RSS / allocated)", [Fig("bytes_per_parameter_rss", fixed(2)), " / ",
                                                          Fig("bytes_per_parameter_allocated", fixed(2))]),
              Col("step ms", [Fig("step_time_median", fixed(2))], where=UNFUSED),
              Col("x float32", [Fig("speed_vs_fp32", times(2))], where=UNFUSED),
              Col("`fused=True` ms", [Fig("step_time_median", fixed(2))], where=FUSED),
              Col("x float32", [Fig("speed_vs_fp32", times(2))], where=FUSED),
              Col("weight + state bytes a step", [Fig("weight_and_state_traffic", fixed(1), to="MB"), " MB"])],
        rows=[Row([label], _contender(form), bold=(0, 1) if bold else ()) for label, form, bold in STATE_FORMS]),
    # Compact state on real knowledge graphs: state_quality.py --models kg_*, 2026-11-28.
    "state-quality-kg": Table(
        where={"benchmark": "state_quality", "folder": "cpu-2026-11-28"},
        labels=[("table / moments", "---")],
        cols=[Col(name, [Calc(lambda d, t: d / t, spreads, (Fig("mrr_difference"), Fig("mrr_tolerance")))],
                  where={"workload.model": model}) for name, model in KG_DATASETS],
        rows=[Row(["float32 / float32: mean MRR (spread)"], _contender("fp32"),
                  cells={i: Cell([Fig("mrr_mean", fixed(4)), " (",
                                  Calc(lambda hi, lo: hi - lo, fixed(4), (Fig("mrr_max"), Fig("mrr_min"))), ")"])
                         for i in range(3)})]
        + [Row([label], _contender(form)) for label, form in KG_FORMS]),
    # A language model's token table (CPU): lm_step.py --hidden 64 --tokens 1024, 2026-11-28.
    "lm-step": Table(
        where={"benchmark": "lm_step", "folder": "cpu-2026-11-28"},
        labels=[("vocabulary", "---:"), ("tie", "---")],
        cols=[Col("torch ms/step", [Fig("step_time_median", fixed(1))], where={"contender": LM_TORCH}),
              Col("hostembed ms/step", [Fig("step_time_median", fixed(1))], where={"contender": LM_HOSTEMBED}),
              Col("speed vs torch", [Fig("speed_vs_torch", times(2))], where={"contender": LM_HOSTEMBED}),
              Col("weight + gradient + AdamW state of the table, torch", LM_SIZES, align="---",
                  where={"contender": LM_TORCH}),
              Col("hostembed", LM_SIZES, align="---", where={"contender": LM_HOSTEMBED})],
        rows=[Row([f"{vocab:,}", "tied" if tied else "untied"], {"workload.vocab": vocab, "workload.tied": tied})
              for vocab in (50257, 256000) for tied in (True, False)]),
    # On a GPU: compare.py on the H200, every run of 2026-11-25 to -27.
    "gpu-compare": Table(
        where={"benchmark": "compare", "workload.device": "cuda", "workload.size": "default"},
        labels=[("tables", "---")],
        cols=[Col(f"ms/step {date[5:]}", [Fig("step_time_median", fixed(2))], where={"date": date})
              for date in CMP_DATES]
        + [Col("GPU memory", [Fig("peak_gpu_memory", fixed(2), to="GiB")], collapse=True, suffix=" GiB")],
        rows=[Row(["the dense part alone"], _contender(CMP_DENSE)),
              Row(["torch on the CPU + SparseAdam"], _contender(CMP_TORCH_CPU)),
              Row(["torch on the GPU + SparseAdam"], _contender(CMP_TORCH_GPU)),
              Row(["hostembed + SparseAdam"], _contender(CMP_HOSTEMBED)),
              Row(["its speed against torch on the GPU"], {},
                  cells={i: Cell([CMP_SPEED]) for i in range(3)} | {3: Cell([])}),
              Row(["hostembed + SparseAdam(fused=True)"], _contender(CMP_FUSED)),
              Row(["hostembed with a GPU row cache, fused"], _contender(CMP_CACHED),
                  cells={i: Cell([Fig("step_time_median", fixed(2)), " (", Label("cache_fraction", pct(0)), ")"])
                         for i in range(3)})]),
    # The 60M-row reference workload: gpu.py on the H200, 2026-11-25.
    "gpu-reference": Table(
        where={"folder": "h200-2026-11-25"},
        labels=[("update", "---")],
        cols=[Col("ms/step", [Fig("step_time_median", fixed(1))]), Col("forward", [Fig("forward_time", fixed(1))]),
              Col("backward", [Fig("backward_time", fixed(1))]),
              Col("step()", [Fig("optimizer_step_time", fixed(1))])],
        rows=[Row([label], {"benchmark": "gpu", "contender": contender, "workload.rows": 60_000_000})
              for label, contender in GPU_MODES]
        + [Row(["FBGEMM TBE, weights in host memory (published, H100)"],
               {"run": "call2_cache_step", "contender": TBE_UVM},
               cells={0: Cell([Fig("step_time_mean", fixed(2))]), 1: Cell([]), 2: Cell([]), 3: Cell([])})]),
    # The row cache (NVIDIA H200): cache_step.py --prefetch, 2026-11-26.
    "gpu-row-cache-h200": Table(
        where={"benchmark": "cache_step", "folder": "h200-2026-11-26"},
        labels=[("cache", "---")],
        cols=[Col("replayed ms/step", [Fig("step_time_median", sig(3))], where={"workload.stream": "replayed"}),
              Col("hit rate", [Fig("hit_rate", pct(0))], where={"workload.stream": "replayed"}),
              Col("published", [], align="---"),
              Col("fresh ms/step", [Fig("step_time_median", sig(3))], where={"workload.stream": "fresh"}),
              Col("hit rate", [Fig("hit_rate", pct(0))], where={"workload.stream": "fresh"})],
        rows=[Row(["none"], {"workload.cache_fraction": None})]
        + [Row([label], {"workload.cache_fraction": fraction},
               cells={2: published} if published else {})
           for label, fraction, published in (
               ("100%", 1.0, _published(("FBGEMM TBE", TBE_ALL), ("NVIDIA dynamicemb", DYNAMICEMB_ALL))),
               ("80%", 0.8, _published(("TBE", TBE_80), ("dynamicemb", DYNAMICEMB_80))),
               ("20%", 0.2, None), ("5%", 0.05, None))]),
    # Evictions written in the background: disk_table.py --optimizers sparse_adam, before and after, 2026-11-28.
    "disk-write-behind": Table(
        where={"benchmark": "disk_table", "folder": "cpu-2026-11-28", "workload.optimizer": ("sparse_adam", None)},
        labels=[("run", "---")],
        cols=_write_behind_cols(),
        rows=[Row([f"{code}, {n}"], {"run": f"disk_table_write_behind_{code}_{n}"})
              for n in (1, 2) for code in ("before", "after")]),
    # A row and its state as one record: disk_table.py, two runs of 2026-11-28.
    "disk-one-record": Table(
        where={"benchmark": "disk_table", "folder": "cpu-2026-11-28", "run": ("disk_table", "disk_table_run2")},
        labels=[("optimizer", "---"), ("ids", "---")],
        cols=_one_record_cols(),
        rows=[Row([opt_label, ids_label], {"workload.optimizer": optimizer, "workload.ids": ids})
              for opt_label, optimizer, ids_label, ids in DISK_ROWS]),
    # The row cache's policies on the anchors' streams and hostembed's own
    # (cache_plan.py --protocol): each planner, the oracles.
    "cache-policy-anchors": Table(
        where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
        labels=[("policy", "---")], cols=_hit_rate_cols(ANCHOR_PROTOCOLS), rows=POLICY_ROWS),
    "cache-policy-own": Table(
        where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
        labels=[("policy", "---")], cols=_hit_rate_cols(OWN_PROTOCOLS),
        rows=[row for row in POLICY_ROWS if row.where["contender"] != STATIC_RANKS]),
    # The candidates tried on the way to the frequency policy (the simulator).
    "cache-policy-candidates": Table(
        where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
        labels=[("candidate (simulated)", "---")], cols=_hit_rate_cols(ANCHOR_PROTOCOLS),
        rows=[Row([name], {"contender": f"simulated: {name}"}) for name in CANDIDATE_NAMES]),
    # The reference stream: hit rates and planning time, each policy.
    "cache-plan-reference": Table(
        where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "workload.protect": 2},
        labels=[("figure, stream (cache: of the touched rows)", "---"), ("policy", "---")], cols=REFERENCE_COLS,
        rows=_reference_rows()),
}


# --- rendering ------------------------------------------------------------------------------

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


def render_cell(parts, rows, col):
    """A cell's pieces: each run's, newest first, joined by the column's
    separator (identical ones once where the column collapses them)."""
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
            problems.append(f"table {name}: no such table in benchmarks/report.py")
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the rows render")
    parser.add_argument("--page", default=PAGE, help="the page (default docs/results.md)")
    parser.add_argument("--results", default=RESULTS_DIR, help="the run folders (default benchmarks/results)")
    args = parser.parse_args(argv)
    with open(args.page, encoding="utf-8") as f:
        text = f.read()
    rows = read_rows(args.results)
    if args.check:
        problems = check_page(text, rows)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"{args.page}: regenerate with `python benchmarks/report.py`", file=sys.stderr)
        return 1 if problems else 0
    new = render_page(text, rows)
    if new != text:
        with open(args.page, "w", encoding="utf-8") as f:
            f.write(new)
    print(f"{args.page}: {len(blocks(new)[0])} tables rendered from {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
