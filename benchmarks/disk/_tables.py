"""The tables of docs/results.md drawn from the rows of disk/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Calc, Col, Fig, Row, Table, fixed, none_if_zero, pct, sig

TABLES = {}

# --- disk_table.py ---
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

# Evictions written in the background: disk_table.py --optimizers sparse_adam, before and after, 2026-11-28.
TABLES["disk-write-behind"] = Table(
    where={"benchmark": "disk_table", "folder": "cpu-2026-11-28", "workload.optimizer": ("sparse_adam", None)},
    labels=[("run", "---")],
    cols=_write_behind_cols(),
    rows=[Row([f"{code}, {n}"], {"run": f"disk_table_write_behind_{code}_{n}"})
          for n in (1, 2) for code in ("before", "after")])

# A row and its state as one record: disk_table.py, two runs of 2026-11-28.
TABLES["disk-one-record"] = Table(
    where={"benchmark": "disk_table", "folder": "cpu-2026-11-28", "run": ("disk_table", "disk_table_run2")},
    labels=[("optimizer", "---"), ("ids", "---")],
    cols=_one_record_cols(),
    rows=[Row([opt_label, ids_label], {"workload.optimizer": optimizer, "workload.ids": ids})
          for opt_label, optimizer, ids_label, ids in DISK_ROWS])
