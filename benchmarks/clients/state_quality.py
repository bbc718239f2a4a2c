"""Does compact optimizer state hold model quality?

Trains three small synthetic models, each with a learnable signal (labels
from a hidden model), and DistMult on three real knowledge graphs, with
hostembed.SparseAdam over the tables in several forms of state, and
compares each form's held-out metric (AUC; filtered MRR for the graphs)
with float32 state's:

  cf      collaborative filtering (benchmarks/compare.py's RecModel and data:
          user and item tables, Zipf ids, labels from a hidden rank-8 model)
  dlrm    DLRM-style: six EmbeddingBag(mode="sum") tables of different sizes,
          bags of 3 Zipf ids, dense features through a bottom MLP, pairwise
          dot interaction, top MLP
  deepfm  benchmarks/clients/ctr_adam.py's CTRModel and data (fields sharing a factor
          table and a first-order table, FM term + MLP)
  kg_umls, kg_nations, kg_kinships
          DistMult (score = sum(e_h * w_r * e_t)) on UMLS (135 entities, 46
          relations, 5,216 training triples), Nations (14, 55, 1,592) and
          Kinships (104, 25, 8,544), read from the files that ship inside the
          PyKEEN package (pip install pykeen==1.11.1 torch==2.13.0; skipped
          with a message where it is missing; nothing is downloaded).
          PyKEEN's default DistMult recipe: dimension 50, entities kept at
          unit L2 norm after every step (its entity constrainer), an L2
          regulariser on the relations (weight 0.1, norm / dim), one
          negative a triple (head or tail replaced by another entity, drawn
          once per pool sample), margin ranking loss (margin 1), batches of
          256, table lr 3e-3. Metric: the test split's filtered MRR, head
          and tail prediction both, a tie ranked in the middle of its group,
          the filter every triple of train, valid and test

A form is (table dtype, state dtype, row-wise second moment, state rounding):

  fp32                     float32 table and state: the reference
  bf16_state(_sr)          bfloat16 moments, rounded to nearest (stochastically)
  f16_state                float16 moments
  int8(_sr)                int8 moments, rounded to nearest (stochastically)
  rowwise                  float32 exp_avg, one second moment a row
  int8_rowwise             int8 exp_avg, one second moment a row
  bf16_table               a bfloat16 table, float32 moments (what the table's
                           dtype alone costs)
  bf16_table_int8          int8 moments on a bfloat16 table (4.06 bytes a
                           parameter at D=128)
  bf16_table_int8_rowwise  int8 exp_avg and a row-wise second moment on a
                           bfloat16 table: the most compact (3.06)
  bnb_adam8bit             the field's 8-bit Adam: torch nn.Embedding tables,
                           bitsandbytes' Adam8bit over the whole model. Dense
                           Adam, not lazy (every row moves every step), so it
                           is judged against
  torch_adam               the same with float32 torch.optim.Adam (no verdict:
                           its dAUC is dense against lazy Adam). These two run
                           where bitsandbytes imports

The dense layers are trained by torch.optim.Adam in every hostembed form.
For one seed every form starts from the same weights (bfloat16 tables
round them) and sees the same batches; the seed sets both. The hidden model
and the held-out set are the same for every seed.

For each (model, form, seed): the mean training loss over each window of
--log-every steps, the held-out metric at the end, and whether the loss became
non-finite (diverged). A form "holds" where
    |mean metric(form) - mean metric(ref)| <= max(ref max - ref min, 2e-3)
over the seeds, and no run of it diverged; ref is fp32 (torch_adam for
bnb_adam8bit where it ran). The rule is two-sided: a form that learns faster
fails it as a slower one does. The row-wise forms change the algorithm (one
step size a row), not only the precision, so a difference is expected there.
On the graphs it is large: with the entities projected back to unit norm
every step, a step proportional to the gradient within a row (row-wise)
lets the coordinates with the largest gradients take the norm from the
others, and each entity and relation ends up on a few coordinates
(--kg-diagnostics prints it).

The models and their data are in _quality_models.py. The run's JSON
(--out-json) holds every run's curve; its figures also go as result rows
(result_rows) to rows.jsonl beside it, which docs/results.md's tables are
rendered from, each form's mean loss curve among them. The plot
(--out-png) is drawn from those rows, the run's date and machine in its
title.

    PYTHONPATH=python python benchmarks/clients/state_quality.py              # ~9 min on 2 vCPUs
    PYTHONPATH=python python benchmarks/clients/state_quality.py --quick      # < 1 min smoke test
    PYTHONPATH=python python benchmarks/clients/state_quality.py --models dlrm --forms fp32,int8 --seeds 5
    PYTHONPATH=python python benchmarks/clients/state_quality.py --models kg_umls,kg_nations,kg_kinships \
        --forms fp32,bf16_state,int8,rowwise,bf16_table_int8_rowwise --kg-diagnostics --threads 1   # ~2 min
    (the graphs' steps are tiny: on busy cores, --threads 1 runs them ~10x faster)
"""
import argparse
import datetime
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/clients/: ctr_adam, _quality_models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import REPO_ROOT, run_folder, log, machine_info, make_row, require_hostembed, run_context  # noqa: E402
from _common import usable_cpus, write_json, write_plots, write_rows  # noqa: E402

hostembed = require_hostembed()
import ctr_adam  # noqa: E402  (auc)
from _quality_models import KGTask, TASKS  # noqa: E402,F401  (the models and their data; KGTask for the tests)

F32, BF16, I8 = torch.float32, torch.bfloat16, torch.int8
# name: (table dtype, state_dtype, rowwise_exp_avg_sq, state_rounding)
FORMS = {
    "fp32": (F32, F32, False, "nearest"),
    "bf16_state": (F32, BF16, False, "nearest"),
    "bf16_state_sr": (F32, BF16, False, "stochastic"),
    "f16_state": (F32, torch.float16, False, "nearest"),
    "int8": (F32, I8, False, "nearest"),
    "int8_sr": (F32, I8, False, "stochastic"),
    "rowwise": (F32, F32, True, "nearest"),
    "int8_rowwise": (F32, I8, True, "nearest"),
    "bf16_table": (BF16, F32, False, "nearest"),
    "bf16_table_int8": (BF16, I8, False, "nearest"),
    "bf16_table_int8_rowwise": (BF16, I8, True, "nearest"),
}
DENSE_FORMS = ("bnb_adam8bit", "torch_adam")  # torch tables, one dense optimizer over the model
REFERENCE = "fp32"
MIN_TOLERANCE = 2e-3


def reference_of(form, forms):
    """The form a form is judged against; None for fp32."""
    if form == REFERENCE:
        return None
    return "torch_adam" if form == "bnb_adam8bit" and "torch_adam" in forms else REFERENCE


def bitsandbytes():
    """The bitsandbytes module, or None with the reason."""
    try:
        import bitsandbytes as bnb
        return bnb, None
    except Exception as exc:  # not installed, or no backend for this machine
        return None, f"{type(exc).__name__}: {exc}"


# --- forms ------------------------------------------------------------------------------------------

def table_factory(form):
    """table(rows, dim, bag=False) -> the module the form trains."""
    if form in DENSE_FORMS:
        return lambda rows, dim, bag=False: nn.EmbeddingBag(rows, dim, mode="sum") if bag else nn.Embedding(rows, dim)
    dtype = FORMS[form][0]

    def table(rows, dim, bag=False):
        module = (hostembed.EmbeddingBag(rows, dim, mode="sum", dtype=dtype) if bag
                  else hostembed.Embedding(rows, dim, dtype=dtype))
        if dtype != F32:  # a bfloat16 table gives bfloat16 rows: the float32 model gets them as float32
            module.register_forward_hook(lambda mod, inputs, out: out.float())
        return module
    return table


def state_options(form):
    """SparseAdam's keyword arguments for the form; those at their default
    are left out, so that fp32 is plain SparseAdam."""
    _, state_dtype, rowwise, rounding = FORMS[form]
    options = {"state_dtype": state_dtype, "rowwise_exp_avg_sq": rowwise, "state_rounding": rounding}
    defaults = {"state_dtype": F32, "rowwise_exp_avg_sq": False, "state_rounding": "nearest"}
    return {k: v for k, v in options.items() if v != defaults[k]}


def split_params(model):
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    ids = {id(p) for p in tables}
    return tables, [p for p in model.parameters() if id(p) not in ids]


def optimizers(form, model, task):
    tables, dense = split_params(model)
    groups = [{"params": tables, "lr": task.table_lr}] + ([{"params": dense, "lr": task.dense_lr}] if dense else [])
    if form == "bnb_adam8bit":
        return [bitsandbytes()[0].optim.Adam8bit(groups)]
    if form == "torch_adam":
        return [torch.optim.Adam(groups)]
    return ([torch.optim.Adam(dense, lr=task.dense_lr)] if dense else []) + [
        hostembed.SparseAdam(tables, lr=task.table_lr, **state_options(form))]


# --- one run ---------------------------------------------------------------------------------------

def seeded_data(pool, seed, steps, batch):
    """The training samples in the seed's order, and the held-out set (the same for every seed)."""
    x, y, test_x, test_y = pool
    order = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))[:steps * batch]
    return tuple(t[order] for t in x), y[order], test_x, test_y


def initial_state(task, seed):
    """The seed's initial weights, drawn once with torch tables: every form loads them."""
    return {k: v.clone() for k, v in task.model(table_factory("torch_adam"), seed).state_dict().items()}


@torch.no_grad()
def held_out_auc(model, x, y, chunk=8192):
    scores = torch.cat([model(*(t[i:i + chunk] for t in x)) for i in range(0, y.numel(), chunk)])
    return ctr_adam.auc(scores.double(), y) if torch.isfinite(scores).all() else float("nan")


def metric_name(task):
    return getattr(task, "metric", "AUC")


def train(task, form, seed, data, initial, steps, log_every, diagnose=False):
    model = task.model(table_factory(form), seed)
    model.load_state_dict(initial)
    opts = optimizers(form, model, task)
    x, y, test_x, test_y = data
    curve, window, diverged, t0 = [], [], False, time.perf_counter()
    for k in range(steps):
        rows = slice(k * task.batch, (k + 1) * task.batch)
        batch_x = tuple(t[rows] for t in x)
        loss = (task.loss(model, batch_x, y[rows]) if hasattr(task, "loss")
                else F.binary_cross_entropy_with_logits(model(*batch_x), y[rows]))
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        if hasattr(task, "after_step"):
            task.after_step(model)
        window.append(loss.item())
        if not math.isfinite(window[-1]):
            diverged = True
            break
        if (k + 1) % log_every == 0 or k + 1 == steps:
            curve.append([k + 1, float(np.mean(window))])
            window = []
    evaluate = task.evaluate if hasattr(task, "evaluate") else held_out_auc
    result = {"seed": seed, "diverged": diverged, "curve": curve, "train_s": time.perf_counter() - t0,
              "final_loss": curve[-1][1] if curve and not diverged else float("nan"),
              "metric": float("nan") if diverged else evaluate(model, test_x, test_y)}
    if diagnose and hasattr(task, "diagnostics") and form in FORMS:
        result["diagnostics"] = task.diagnostics(model, opts[-1])
    return result


# --- summary, report, plot --------------------------------------------------------------------------

def summarize(runs, ref, ref_name=None):
    values = [r["metric"] for r in runs]
    s = {"metric_mean": float(np.mean(values)), "metric_min": float(np.min(values)),
         "metric_max": float(np.max(values)),
         "final_loss_mean": float(np.mean([r["final_loss"] for r in runs])),
         "diverged": any(r["diverged"] for r in runs), "runs": runs}
    if ref is not None:
        tolerance = max(ref["metric_max"] - ref["metric_min"], MIN_TOLERANCE)
        s["reference"], s["delta"] = ref_name, s["metric_mean"] - ref["metric_mean"]
        s["tolerance"] = tolerance
        s["holds"] = bool(abs(s["delta"]) <= tolerance and not s["diverged"])  # False where NaN
    return s


def verdict(form, s):
    if form in (REFERENCE, "torch_adam") or "holds" not in s:
        return {REFERENCE: "reference", "torch_adam": "dense reference"}.get(form, "no reference ran")
    return "diverged" if s["diverged"] else ("holds" if s["holds"] else "DOES NOT HOLD")


def print_table(name, task, results, seeds):
    print(f"\n## {name}: {task.steps} steps of {task.batch}, table lr {task.table_lr:g}, dense lr "
          f"{task.dense_lr:g}, {len(seeds)} seed(s)\n")
    metric = metric_name(task)
    print(f"| form | held-out {metric} mean | min..max | final train loss | vs | difference | tolerance "
          "| in ref spreads | verdict |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for form, s in results.items():
        vs, delta, tol, spreads = (s["reference"], f"{s['delta']:+.4f}", f"{s['tolerance']:.4f}",
                                   f"{s['delta'] / s['tolerance']:+.1f}") if "reference" in s else ("", "", "", "")
        print(f"| {form} | {s['metric_mean']:.4f} | {s['metric_min']:.4f}..{s['metric_max']:.4f} "
              f"| {s['final_loss_mean']:.4f} | {vs} | {delta} | {tol} | {spreads} | {verdict(form, s)} |")
    diagnosed = {form: [r["diagnostics"] for r in s["runs"] if "diagnostics" in r] for form, s in results.items()}
    if any(diagnosed.values()):
        print(f"\n{name}, mean over the seeds: coordinates each row uses (participation ratio of its squared"
              f" weights, of {task.dim}); per-element exp_avg_sq against its row's mean (where kept per element)\n")
        for form, runs in diagnosed.items():
            if runs:
                mean = {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}
                print(f"  {form}: " + "; ".join(
                    f"{k} " + (" ".join(f"{x:.3g}" for x in v) if np.ndim(v) else f"{v:.3g}") for k, v in mean.items()))


def mean_curve(runs):
    steps = [c[0] for c in runs[0]["curve"]]
    n = min(len(r["curve"]) for r in runs)
    return steps[:n], np.mean([[c[1] for c in r["curve"][:n]] for r in runs], axis=0)


def curves_of(rows):
    """{model: {form: (steps, mean loss)}} from a run's "training_loss_mean"
    rows (one a logged step: the loss over the log window and the seeds)."""
    curves = {}
    for row in rows:
        if row["metric"] == "training_loss_mean":
            model = curves.setdefault(row["workload"]["model"], {})
            model.setdefault(row["contender"], []).append((row["workload"]["step"], row["value"]))
    return {model: {form: tuple(np.array(v) for v in zip(*sorted(points))) for form, points in forms.items()}
            for model, forms in curves.items()}


def plot(rows):
    """The loss curves of one run, drawn from its result rows and titled
    with the run's date and machine."""
    curves = curves_of(rows)
    first = next(row for row in rows if row["metric"] == "training_loss_mean")

    def draw(plt):
        fig, axes = plt.subplots(2, len(curves), figsize=(5.5 * len(curves), 7), squeeze=False,
                                 gridspec_kw={"height_ratios": (2, 1)}, sharex="col")
        for col, (name, forms) in enumerate(curves.items()):
            top, bottom = axes[0][col], axes[1][col]
            ref = forms.get(REFERENCE)
            kept = []  # the curves the axes are scaled to: a form far off fp32's would flatten the rest
            for form, (steps, loss) in forms.items():
                off = ref is not None and not np.all(np.abs(loss[:len(ref[1])] - ref[1][:len(loss)]) < 0.1)
                style = (dict(color="black", linewidth=2.5) if form == REFERENCE else
                         dict(linewidth=1, linestyle="--" if form in DENSE_FORMS else "-"))
                label = f"{form} (off the chart)" if off else form
                top.plot(steps, loss, label=label, **style)
                if ref is not None:
                    n = min(len(loss), len(ref[1]))
                    bottom.plot(steps[:n], loss[:n] - ref[1][:n], label=label, **style)
                    if not off:
                        kept.append((loss, loss[:n] - ref[1][:n]))
            if kept:
                for axis, values in ((top, [k[0] for k in kept]), (bottom, [k[1] for k in kept])):
                    low, high = min(map(np.min, values)), max(map(np.max, values))
                    pad = 0.05 * (high - low or 1.0)
                    axis.set_ylim(low - pad, high + pad)
            top.set_title(name)
            bottom.set_xlabel("step")
        work = first["workload"]
        axes[0][0].set_ylabel(f"training loss (mean of {work['log_every']} steps and the seeds)")
        axes[1][0].set_ylabel("minus fp32's")
        axes[0][0].legend(fontsize=7)
        machine = first["machine"]
        fig.suptitle(f"{(first['date'] or 'date not recorded')[:10]}, {machine['cpu_model']}, "
                     f"{machine['cores']} CPUs, torch {machine['torch']}, seeds 0-{work['seeds'] - 1}", fontsize=9)
        return fig
    return draw


# --- result rows -----------------------------------------------------------------------------------

ROW_WORKLOAD = ("dataset", "dim", "epochs", "batch", "steps", "table_lr", "dense_lr", "margin", "users", "items",
                "rows", "fields", "hidden", "bag", "dense", "alpha", "init_std")


def result_rows(ctx, report, curves=True):
    """A run's report (its JSON) as result rows (benchmarks/_common.py's
    schema), one contender a form: the held-out metric's mean, min and max
    over the seeds ("auc_*", "mrr_*" for the graphs' filtered MRR), the mean
    final training loss, and against the reference form's mean (fp32's;
    torch_adam's for bnb_adam8bit where it ran) the difference and the
    spread it is held to (the reference's max minus min, at least
    min_tolerance). A figure that is not finite (a form whose runs
    diverged) is no row; such a form gets "diverged_runs", the seeds whose
    loss became non-finite. With `curves`, each logged step's training loss
    (over its window and the seeds) is a "training_loss_mean" row too, the
    plot's data. recover_rows.py converts the committed runs' JSON with it
    too (without the curves, which those rows never had)."""
    rows = []
    for model, forms in report["models"].items():
        task = report["tasks"][model]
        metric = {"filtered MRR": "mrr"}.get(task["metric"], task["metric"].lower().replace(" ", "_"))
        workload = {k: list(task[k]) if isinstance(task[k], tuple) else task[k] for k in ROW_WORKLOAD if k in task}
        workload.update(model=model, seeds=report["config"]["seeds"])
        for form, result in forms.items():
            diverged = sum(bool(run["diverged"]) for run in result["runs"])
            figures = [(f"{metric}_{stat}", result[f"metric_{stat}"], "score") for stat in ("mean", "min", "max")]
            figures += [("final_loss_mean", result["final_loss_mean"], "loss"),
                        (f"{metric}_difference", result.get("delta"), "score"),
                        (f"{metric}_tolerance", result.get("tolerance"), "score"),
                        ("diverged_runs", diverged or None, "runs")]
            rows += [make_row(ctx, workload, form, name, value, unit) for name, value, unit in figures
                     if value is not None and math.isfinite(value)]
            if curves and not diverged:
                steps, loss = mean_curve(result["runs"])
                rows += [make_row(ctx, dict(workload, step=int(step), log_every=report["config"]["log_every"]),
                                  form, "training_loss_mean", float(value), "loss")
                         for step, value in zip(steps, loss) if math.isfinite(value)]
    return rows


# --- main ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    p.add_argument("--forms", default=None, help="comma-separated subset of " + ",".join(list(FORMS) + list(
        DENSE_FORMS)) + " (default: all; the dense two where bitsandbytes imports)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, the same for every form")
    p.add_argument("--steps", type=int, default=None, help="training steps of every model (default: each its own, "
                   "400; the graphs' epochs, 100 (Kinships 40), in batches of 256)")
    p.add_argument("--kg-diagnostics", action="store_true", help="the graphs: print how many coordinates each "
                   "entity and relation row uses, and the spread of exp_avg_sq within rows")
    p.add_argument("--log-every", type=int, default=10, help="steps a logged loss averages")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 60 steps")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--out-json", "--json", dest="out_json", default=os.path.join(run_folder(), "state_quality.json"),
                   help="the run's JSON; its result rows go to rows.jsonl beside it")
    p.add_argument("--out-png", default=os.path.join(REPO_ROOT, "benchmarks", "figures", "state_quality.png"))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 1, args.steps or 60
    args.models = [m for m in args.models.split(",") if m]
    bnb, args.bitsandbytes = bitsandbytes()
    if args.forms is None:  # the dense two only where bitsandbytes imports
        args.forms = ",".join(list(FORMS) + (list(DENSE_FORMS) if bnb else []))
    args.forms = [f for f in args.forms.split(",") if f]
    unknown = [m for m in args.models if m not in TASKS] + [f for f in args.forms if f not in FORMS and
                                                             f not in DENSE_FORMS]
    if unknown:
        p.error(f"unknown model or form: {', '.join(unknown)}")
    if min(args.seeds, args.log_every, args.threads, args.steps or 1) < 1:
        p.error("--seeds, --steps, --log-every and --threads must be >= 1")
    if "bnb_adam8bit" in args.forms and bnb is None:
        p.error(f"bnb_adam8bit: bitsandbytes does not import ({args.bitsandbytes})")
    args.bitsandbytes = bnb.__version__ if bnb else args.bitsandbytes
    return args


def task_config(task):
    return {"metric": metric_name(task), **{k: getattr(task, k) for k in dir(task) if not k.startswith("_") and
                                            isinstance(getattr(task, k), (int, float, str, tuple))}}


def run_model(task, args):
    steps = args.steps or task.steps
    task.steps = steps
    pool = task.pool(steps * task.batch)
    runs = {form: [] for form in args.forms}
    for seed in range(args.seeds):
        data, initial = seeded_data(pool, seed, steps, task.batch), initial_state(task, seed)
        for form in args.forms:
            r = train(task, form, seed, data, initial, steps, args.log_every, args.kg_diagnostics)
            log(f"{task.name} seed {seed} {form}: {metric_name(task)} {r['metric']:.4f}, loss {r['final_loss']:.4f}"
                f"{' DIVERGED' if r['diverged'] else ''} ({r['train_s']:.1f} s)")
            runs[form].append(r)
    results = {}
    for form in sorted(args.forms, key=lambda f: (f != REFERENCE, f != "torch_adam")):  # references first
        ref = reference_of(form, args.forms)
        results[form] = summarize(runs[form], results.get(ref), ref)
    return {form: results[form] for form in args.forms}


def main(argv=None):
    t0 = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    if "bnb_adam8bit" not in args.forms:
        log(f"bnb_adam8bit not run (bitsandbytes: {args.bitsandbytes})")
    for name in [m for m in args.models if getattr(TASKS[m], "unavailable", None)]:
        log(f"{name} skipped: {TASKS[name].unavailable}")
        args.models.remove(name)
    models = {name: run_model(TASKS[name], args) for name in args.models}
    report = {"benchmark": "state_quality", "date": datetime.datetime.now().astimezone().isoformat(),
              "machine": machine_info(threads=args.threads, bitsandbytes=args.bitsandbytes),
              "config": vars(args), "min_tolerance": MIN_TOLERANCE,
              "tasks": {name: task_config(TASKS[name]) for name in args.models},
              "models": models}
    for name in args.models:
        print_table(name, TASKS[name], models[name], range(args.seeds))
    report["wall_s"] = time.perf_counter() - t0
    write_json(args.out_json, report)
    context = run_context("state_quality", info=report["machine"], date=report["date"])
    rows = result_rows(context, report)
    rows_path = write_rows(os.path.dirname(os.path.abspath(args.out_json)), rows)
    paths, note = write_plots(os.path.dirname(os.path.abspath(args.out_png)),
                              {os.path.basename(args.out_png): plot(rows)}) if curves_of(rows) else ([], "no curve to draw")
    print(f"\nWall time {report['wall_s']:.0f} s. JSON: {args.out_json}, rows: {rows_path}. "
          + (f"Plot: {paths[0]}" if paths else note))


if __name__ == "__main__":
    main()
