"""benchmarks/gpu/cache_step.py's report rows as result rows
(benchmarks/_rows.py's schema): what a run writes beside its JSON, so
that a GPU run's figures land as rows with its folder. The metric names
follow benchmarks/recover_rows.py's for the older cache_step JSON; figures
from a formula keep their "_modelled" suffix."""
from _common import make_row

WORKLOAD = ("protocol", "cache", "state", "optimizer", "table_rows", "cache_rows", "cache_of_rows", "unique_per_step",
            "first_touch_per_step", "steps")
FIGURES = [  # (report key, metric, unit)
    ("ms_per_step", "step_time_median", "ms"), ("mean_ms", "step_time_mean", "ms"), ("min_ms", "step_time_min", "ms"),
    ("max_ms", "step_time_max", "ms"), ("hit_rate", "hit_rate", "fraction"),
    ("bypassed_per_step", "bypassed_rows", "rows/step"), ("host_waits_per_step", "host_waits", "waits/step"),
    ("record_bytes_moved_per_step", "record_traffic", "bytes/step"),
    ("host_reads_per_fetch", "host_reads_per_fetch", "rows"), ("cache_rows_per_gib", "cache_rows_per_gib", "rows/GiB"),
    ("pcie_bytes_per_step_modelled", "pcie_traffic_modelled", "bytes/step"),
    ("minimum_bytes_per_step_modelled", "minimum_traffic_modelled", "bytes/step"),
]
PHASES = (("forward", "forward_time"), ("backward", "backward_time"), ("step", "optimizer_step_time"))


def result_rows(report_rows, context):
    """One row a figure of each of cache_step.py's report rows."""
    out = []
    for r in report_rows:
        workload = {k: r[k] for k in WORKLOAD if k in r}
        contender = "hostembed, row cache" if r["cache"] else "hostembed, no cache"
        figures = [(metric, r.get(key), unit) for key, metric, unit in FIGURES]
        figures += [(metric, r["phases_ms"].get(phase), "ms") for phase, metric in PHASES]
        out += [make_row(context, workload, contender, metric, value, unit)
                for metric, value, unit in figures if value is not None]
    return out
