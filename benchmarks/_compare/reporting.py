"""compare.py's report: the notes on figures that do not mean what they
seem, the run's date and machine, the printed table, and the plots."""
import argparse
import re

import numpy as np

from _common import DENSE_ADAM_WARMUP, fmt_gib, fmt_ms

from .contenders import AGREEING, CONTENDERS, HOSTEMBED, HOSTEMBED_CACHED, HOSTEMBED_FUSED
from .rows import DENSE_FLOOR
from .running import LOSS_RTOL

NOISY_LOAD = 0.05  # others' share of the CPUs above which a run's timings are called noisy


def _load(fraction):
    return "an unknown share" if fraction is None else f"{fraction:.0%}"


def timing_notes(results, floor):
    """Notes on figures that do not mean what they seem to: a contender
    below the dense part alone (a floor no table can beat: measurement
    noise) and the fused contender slower than the unfused one. Each names
    the other processes' share of the CPUs while the figures were taken."""
    notes = []
    floor_ms = floor.get("median_ms") if floor else None
    for c in CONTENDERS:
        r = results.get(c.key, {})
        if floor_ms is None or "median_ms" not in r or r["median_ms"] >= floor_ms:
            continue
        notes.append(
            f"Note: {c.number}. took {fmt_ms(r['median_ms'])} ms a step, {fmt_ms(floor_ms - r['median_ms'])} ms "
            f"less than the dense part alone ({fmt_ms(floor_ms)} ms), which does all of its work but the tables': "
            f"measurement noise, not a gain. Other processes used {_load(r.get('cpu_fraction_used_by_others'))} "
            f"of the CPUs while it ran and {_load(floor.get('cpu_fraction_used_by_others'))} while the floor ran; "
            "its step time beyond the floor is not a figure to quote.")
    plain, fused = results.get(HOSTEMBED.key, {}), results.get(HOSTEMBED_FUSED.key, {})
    if "median_ms" in plain and "median_ms" in fused and fused["median_ms"] > plain["median_ms"]:
        loads = [r.get("cpu_fraction_used_by_others") for r in (plain, fused)]
        note = (f"Note: {HOSTEMBED_FUSED.number}. (fused) took {fmt_ms(fused['median_ms'])} ms a step against "
                f"{fmt_ms(plain['median_ms'])} for {HOSTEMBED.number}. (unfused), "
                f"{fused['median_ms'] / plain['median_ms']:.2f}x its time. Other processes used {_load(loads[0])} "
                f"of the CPUs during {HOSTEMBED.number}. and {_load(loads[1])} during {HOSTEMBED_FUSED.number}.; ")
        if all(x is not None and x <= NOISY_LOAD for x in loads):
            note += ("that is little, so the difference is this machine's, not noise: fusing does not pay here "
                     "for this workload.")
        else:
            note += ("the contenders run one after another, so other load can account for the difference: "
                     "rerun on an idle machine (or time both in interleaved rounds, as cpu_step.py does) before "
                     "concluding that fusing does not pay here.")
        notes.append(note)
    return notes


def run_date(report, json_path=None):
    """The run's date: the one its JSON records, else a YYYY-MM-DD in the
    JSON's path (runs kept before the JSON held a date), else None."""
    if report.get("date"):
        return report["date"]
    found = re.findall(r"\d{4}-\d{2}-\d{2}", json_path or "")
    return found[-1] if found else None


def run_label(report, date):
    """The run's date and machine, for the plots' titles."""
    m = report.get("machine", {})
    cpus = f"{m.get('usable_cpus', '?')} CPUs ({m.get('cpu_model', 'unknown CPU')})"
    gpu = m.get("gpu")
    where = f"{gpu['name']} + {cpus}" if gpu else cpus
    return (f"{date or 'date not recorded'}, {where}, torch {m.get('torch', '?')}, "
            f"outputs on {m.get('output_device', '?')}")


def plot_inputs(rows):
    """What the plots are drawn from, out of one run's rows (run_rows'):
    (cfg, results by contender key, the dense floor's ms, the agreement of
    SparseAdam's contenders, the run's machine as run_label reads it, its
    date). A contender
    without rows is "skipped", and why where the rows say it (a GPU
    contender of a run with CPU outputs), so that the plots of a run and
    those drawn again from its rows are the same."""
    floor = [r for r in rows if r["contender"] == DENSE_FLOOR and r["metric"] == "step_time_median"]
    if len(floor) != 1:
        raise ValueError(f"{len(floor)} dense-floor step times among the run's rows, not 1")
    first = floor[0]
    cfg = argparse.Namespace(**first["workload"])
    results = {}
    for c in CONTENDERS:
        mine = [r for r in rows if r["contender"] == c.label]
        median = [r["value"] for r in mine if r["metric"] == "step_time_median"]
        if not median:
            needs_gpu = (c.on_gpu or c is HOSTEMBED_CACHED) and first["workload"].get("device") == "cpu"
            reason = "needs GPU outputs; this run's were on the CPU" if needs_gpu else "not measured in this run"
            results[c.key] = {"label": c.label, "number": c.number, "skipped": reason}
            continue
        losses = sorted((r["workload"]["step"], r["value"]) for r in mine if r["metric"] == "loss")
        results[c.key] = {"label": c.label, "number": c.number, "median_ms": median[0]}
        if losses:
            results[c.key]["losses"] = [loss for _, loss in losses]
    ran = [c for c in AGREEING if "losses" in results[c.key]]
    agreement = {"checked": len(ran) >= 2}
    if agreement["checked"]:
        agreement.update(reference=ran[0].key, contenders={
            c.key: {} for c in ran[1:] if len(results[c.key]["losses"]) == len(results[ran[0].key]["losses"])})
    machine = first["machine"]
    about = {"usable_cpus": machine["cores"], "cpu_model": machine["cpu_model"], "torch": machine["torch"],
             "gpu": {"name": machine["gpu"]} if machine["gpu"] else None,
             "output_device": first["workload"].get("device")}
    return cfg, results, first["value"], agreement, {"machine": about}, first["date"] and first["date"][:10]


def print_report(cfg, report, json_path, plots, plots_note):
    results, wl = report["contenders"], report["workload"]
    out = report["machine"]["output_device"]
    print("## Collaborative-filtering training step: torch nn.Embedding vs hostembed.Embedding\n")
    print(f"users {cfg.users:,} x {cfg.dim}, items {cfg.items:,} x {cfg.dim} "
          f"({fmt_gib(4 * (cfg.users + cfg.items) * cfg.dim)} of fp32 tables); batch {cfg.batch:,} interactions, "
          f"Zipf({cfg.alpha}) ids (mean {wl['unique_users_per_batch_mean']:,.0f} unique users, "
          f"{wl['unique_items_per_batch_mean']:,.0f} unique items); MLP {2 * cfg.dim}-{cfg.hidden}-1 on {out}; "
          f"lr {cfg.lr:g}; {cfg.threads} threads; size preset '{cfg.size}'\n")
    print("| contender | ms/step | steps/s | speedup vs 2. | peak RSS | peak GPU mem | final loss (step) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in CONTENDERS:
        r = results[c.key]
        if "skipped" in r:
            print(f"| {c.number}. {c.label} | skipped: {r['skipped']} | | | | | |")
            continue
        speedup = r.get("speedup_vs_torch_sparse_cpu")
        print(f"| {c.number}. {c.label} | {fmt_ms(r['median_ms'])} | {r['steps_per_s']:.2f} "
              f"| {'n/a' if speedup is None else f'{speedup:.2f}x'} | {fmt_gib(r['peak_rss_bytes_train'])} "
              f"| {fmt_gib(r['peak_gpu_bytes'])} | {r['final_loss']:.4f} ({len(r['losses'])}) |")

    print(f"\nms/step: median of the timed steps, after {cfg.warmup} untimed (dense Adam: {cfg.adam_steps} timed "
          f"after {DENSE_ADAM_WARMUP}); a step is forward, BCE loss, backward and both optimizers. Peak RSS: the "
          "process's peak while the contender trained. Final loss: on the last training batch, after that many "
          "steps; the curves are in the JSON and the plot.")
    floor = report["dense_floor"]["median_ms"]
    beyond = ", ".join(f"{c.number}. {fmt_ms(results[c.key]['median_ms'] - floor)}"
                       for c in CONTENDERS if "median_ms" in results[c.key]) or "no contender ran"
    print(f"\nDense part alone (MLP, loss and Adam on fixed embedding outputs): {fmt_ms(floor)} ms/step, a floor "
          f"no table can beat. Step time beyond it, ms: {beyond}.")
    for note in report.get("notes", ()):
        print(note)
    for agree in (report["agreement"], report["dense_agreement"]):
        if not agree["checked"]:
            print(f"Agreement: not checked ({agree['reason']}).")
            continue
        ref = results[agree["reference"]]
        for key, a in agree["contenders"].items():
            print(f"Agreement: {results[key]['number']}. matches {ref['number']}.'s loss at all {agree['steps']} "
                  f"steps (max relative difference {a['loss_max_rel_diff']:.2g}, tolerance {LOSS_RTOL:g}); "
                  f"trained weights max abs difference {a['weight_max_abs_diff']:.2g}.")
    print("1., 6. and 7. use dense Adam, a different optimizer from 2.-5.'s SparseAdam: they are compared with "
          "each other.")
    others = report["other_load"]["cpu_fraction_used_by_others"]
    if others is not None and others > NOISY_LOAD:
        print(f"Other processes used {others:.0%} of the CPUs during the run: timings are noisy, rerun on an idle machine.")
    print(f"\nWall time {report['wall_s']:.0f} s. JSON: {json_path}")
    print(f"Plots: {', '.join(plots)}" if plots else plots_note)


def plot_ms_per_step(cfg, results, floor_ms, run):
    # .get: the JSON of an older run (--plot-from) may not know every contender.
    ran = [c for c in CONTENDERS if "median_ms" in results.get(c.key, {})]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(ran)))
        ms = [results[c.key]["median_ms"] for c in ran]
        fraction = getattr(cfg, "cache_fraction", None)  # absent from the JSON of runs before contender 8
        cached = "" if fraction is None else f" ({fraction:.0%} of the rows)"
        ax.barh([f"{c.number}. {c.label}" + (cached if c is HOSTEMBED_CACHED else "") for c in ran], ms,
                color="tab:blue")
        for y, v in enumerate(ms):
            ax.text(v, y, f" {fmt_ms(v)} ms", va="center")
        ax.axvline(floor_ms, color="gray", linestyle="--", label=f"dense part alone ({fmt_ms(floor_ms)} ms)")
        ax.set_xscale("log")
        ax.set_xlim(right=max(ms) * 4)
        ax.invert_yaxis()
        ax.set_xlabel("ms per training step (median, log scale)")
        ax.set_title(f"{run}\nusers {cfg.users:,} + items {cfg.items:,} rows x {cfg.dim}, batch {cfg.batch:,}",
                     fontsize=10)
        ax.legend(loc="lower right")
        skipped = [f"{c.number}. skipped: {results[c.key]['skipped']}" for c in CONTENDERS
                   if "skipped" in results.get(c.key, {})]
        if skipped:
            fig.text(0.01, -0.02, "\n".join(skipped), fontsize=8, va="top")
        return fig
    return draw


def plot_losses(cfg, results, agreement, run):
    ran = [c for c in CONTENDERS if "losses" in results.get(c.key, {})]
    agreeing = ", ".join(f"{c.number}." for c in AGREEING if c in ran)
    styles = {1: ("tab:red", "-", "o"), 2: ("tab:orange", "-", None), 3: ("tab:green", "--", None),
              4: ("tab:blue", ":", None), 5: ("tab:purple", "-.", None), 6: ("tab:brown", "-", "s"),
              7: ("tab:cyan", ":", "^"), 8: ("tab:olive", "--", "x")}

    def draw(plt):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
        for c in ran:
            color, line, marker = styles[c.number]
            losses = results[c.key]["losses"]
            top.plot(range(1, len(losses) + 1), losses, color=color, linestyle=line, marker=marker,
                     label=f"{c.number}. {c.label}")
        top.set_ylabel("BCE loss (training batch)")
        top.legend(fontsize=8)
        top.set_title(f"{run}\nSame start, same batches: SparseAdam's {agreeing} must overlap", fontsize=10)
        if agreement["checked"]:
            ref = np.array(results[agreement["reference"]]["losses"])
            for key in agreement["contenders"]:
                c = next(c for c in CONTENDERS if c.key == key)
                rel = np.abs(np.array(results[key]["losses"]) - ref) / np.abs(ref)
                # Equal losses have no place on a log axis: draw them at the bottom.
                bottom.plot(range(1, rel.size + 1), np.maximum(rel, 1e-10), color=styles[c.number][0],
                            label=f"{c.number}. vs {results[agreement['reference']]['number']}.")
            bottom.axhline(LOSS_RTOL, color="gray", linestyle="--", label="tolerance")
            bottom.set_yscale("log")
            bottom.legend(fontsize=8)
        bottom.set_ylabel("relative loss difference\n(equal: drawn at 1e-10)")
        bottom.set_xlabel("step")
        return fig
    return draw
