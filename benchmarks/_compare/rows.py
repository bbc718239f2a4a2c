"""compare.py's result rows (the schema of _rows.py: one measured figure a
row), from its JSON report: compare_rows (the figures of the page's tables;
also what benchmarks/recover_rows.py makes of the runs kept before the
script wrote rows), run_rows (those and every other figure of the JSON:
each step's loss, the agreement checks, build and first-step times, other
load, the batches' unique ids), and compare_log_rows (the printed table of a
run that kept no JSON).

The workload of every row is the run's COMPARE_WORKLOAD config fields (a
loss adds "step", an agreement figure "reference"); the contenders are the
labels compare.py prints. Imports only _common (no hostembed), as
compare.py's --plot-from needs no build.
"""
import re

from _common import figure_rows, make_row, summary_figures

COMPARE_WORKLOAD = ("size", "users", "items", "dim", "hidden", "batch", "alpha", "steps", "warmup", "lr", "seed",
                    "threads", "device", "cache_fraction")
DENSE_FLOOR = "dense part alone (fixed embedding outputs, no tables)"
BATCHES = "the batches"  # the contender of the workload's own figures
WHOLE_RUN = "the whole run"  # and of the run's peak RSS and other load


def _pick(mapping, keys):
    return {k: mapping[k] for k in keys if k in mapping}




def compare_rows(ctx, data):
    """The table's figures: each contender's step time (spread), peak RSS and
    GPU memory, final loss and speed against torch's CPU SparseAdam; the
    dense part's step time."""
    workload = _pick(data["config"], COMPARE_WORKLOAD)
    rows = figure_rows(ctx, workload, DENSE_FLOOR, summary_figures("step_time", data["dense_floor"]))
    for result in data["contenders"].values():
        if "skipped" in result:
            continue
        rows += figure_rows(ctx, workload, result["label"], summary_figures("step_time", result) + [
            ("peak_rss", result.get("peak_rss_bytes_train"), "bytes"),
            ("peak_gpu_memory", result.get("peak_gpu_bytes"), "bytes"), ("final_loss", result.get("final_loss"), "loss"),
            ("speedup_vs_torch_sparse_cpu", result.get("speedup_vs_torch_sparse_cpu"), "x")])
    return rows


def run_rows(ctx, data):
    """Every figure of a run's JSON: compare_rows', then per contender its
    timed and warm-up steps, build time, first step, peak RSS while built,
    the other processes' share of the CPUs and the loss of every step (a
    row a step: workload "step", from 1); the agreement checks against
    their reference; the batches' unique ids; the run's peak RSS and other load."""
    workload = _pick(data["config"], COMPARE_WORKLOAD)
    rows = compare_rows(ctx, data)
    floor = data["dense_floor"]
    rows += figure_rows(ctx, workload, DENSE_FLOOR, [("cpu_used_by_others", floor.get("cpu_fraction_used_by_others"),
                                                "fraction")])
    for result in data["contenders"].values():
        if "skipped" in result:
            continue
        label = result["label"]
        rows += figure_rows(ctx, workload, label, [
            ("timed_steps", result.get("timed_steps"), "steps"), ("warmup_steps", result.get("warmup_steps"), "steps"),
            ("build_time", result.get("build_s"), "s"), ("first_step_time", result.get("first_step_ms"), "ms"),
            ("peak_rss_build", result.get("peak_rss_bytes_build"), "bytes"),
            ("cpu_used_by_others", result.get("cpu_fraction_used_by_others"), "fraction")])
        for step, loss in enumerate(result.get("losses", ()), 1):
            rows.append(make_row(ctx, dict(workload, step=step), label, "loss", loss, "loss"))
    for agreement in (data.get("agreement"), data.get("dense_agreement")):
        if not agreement or not agreement.get("checked"):
            continue
        reference = data["contenders"][agreement["reference"]]["label"]
        for key, found in agreement["contenders"].items():
            rows += figure_rows(ctx, dict(workload, reference=reference), data["contenders"][key]["label"], [
                ("loss_max_relative_difference", found["loss_max_rel_diff"], "fraction"),
                ("weight_max_abs_difference", found["weight_max_abs_diff"], "weight")])
    stats = data.get("workload", {})
    rows += figure_rows(ctx, workload, BATCHES, [
        ("unique_users_per_batch_mean", stats.get("unique_users_per_batch_mean"), "rows"),
        ("unique_items_per_batch_mean", stats.get("unique_items_per_batch_mean"), "rows"),
        ("positive_fraction", stats.get("positive_fraction"), "fraction")])
    rows += figure_rows(ctx, workload, WHOLE_RUN, [
        ("peak_rss", data.get("peak_rss_bytes"), "bytes"),
        ("cpu_used_by_others", data.get("other_load", {}).get("cpu_fraction_used_by_others"), "fraction")])
    return rows


def _number(text):
    return float(text.replace(",", ""))


def compare_log_rows(ctx, path, cache_fraction):
    """compare.py's printed table (the run kept no JSON): its figures as
    printed, so to their printed places."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head = re.search(r"users ([\d,]+) x (\d+), items ([\d,]+) x \d+ .*?; batch ([\d,]+) interactions, "
                     r"Zipf\(([\d.]+)\) ids .*?; MLP [\d-]+ on (\w+); lr ([\d.e-]+); (\d+) threads; "
                     r"size preset '(\w+)'", text)
    workload = {"size": head.group(9), "users": int(_number(head.group(1))), "items": int(_number(head.group(3))),
                "dim": int(head.group(2)), "batch": int(_number(head.group(4))), "alpha": float(head.group(5)),
                "lr": float(head.group(7)), "threads": int(head.group(8)), "device": head.group(6),
                "cache_fraction": cache_fraction}
    rows = []
    floor = re.search(r"^Dense part alone .*?: ([\d.]+) ms/step", text, re.M)
    rows += figure_rows(ctx, workload, DENSE_FLOOR, [("step_time_median", _number(floor.group(1)), "ms")])
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or not re.match(r"\d+\. ", cells[0]) or len(cells) != 7:
            continue
        label = cells[0].split(". ", 1)[1]
        rows += figure_rows(ctx, workload, label, [
            ("step_time_median", _number(cells[1]), "ms"),
            ("speedup_vs_torch_sparse_cpu", _number(cells[3].rstrip("x")), "x"),
            ("peak_rss", _number(cells[4].split()[0]), "GiB"),
            ("peak_gpu_memory", _number(cells[5].split()[0]), "GiB"),
            ("final_loss", _number(cells[6].split()[0]), "loss")])
    return rows
