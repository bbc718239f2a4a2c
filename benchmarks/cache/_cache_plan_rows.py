"""benchmarks/cache/cache_plan.py's reports as result rows (benchmarks/_rows.py's
schema): what the benchmark writes after a run, and what
benchmarks/recover_rows.py makes of a run's JSON kept from before."""
from _common import make_row


def reference_rows(report, context):
    """The reference stream's figures (main's report) as result rows
    (benchmarks/_rows.py): each cache size's hit rate and planning time."""
    a = report["args"]
    base = {"stream": "replayed" if a["stream"] else "fresh", "distinct_batches": a["stream"], "rows": a["rows"],
            "lookups_per_step": a["batch"], "alpha": a["alpha"], "warmup_batches": a["warmup"],
            "timed_batches": a["steps"], "protect": 2 if a["lookahead"] else 1}
    rows = []
    for fraction, r in report["sizes"].items():
        workload = dict(base, fraction=float(fraction), capacity=r["capacity"])
        contender = f"CPU planner, {a.get('policy', 'clock')}"
        rows.append(make_row(context, workload, contender, "hit_rate", r["hit_rate"], "fraction"))
        for stat in ("median", "min", "max"):
            rows.append(make_row(context, workload, contender, f"plan_time_{stat}", r["plan"][f"{stat}_ms"], "ms"))
    return rows


def policy_rows(report, context):
    """--protocol's figures (compare_policies' report) as result rows: each
    policy's hit rate at each cache size of each protocol."""
    rows = []
    for r in report["rows"]:
        workload = dict(r["workload"], protocol=r["protocol"], fraction=r["fraction"], capacity=r["capacity"],
                        protect=r["protect"])
        rows.append(make_row(context, workload, f"{r['kind']}: {r['policy']}", "hit_rate", r["hit_rate"],
                             "fraction"))
        rows.append(make_row(context, workload, f"{r['kind']}: {r['policy']}", "time", r["seconds"], "s"))
    return rows
