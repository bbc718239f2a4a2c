"""The tables of docs/results.md drawn from the rows of clients/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Calc, Cell, Col, Fig, Label, Row, Table, contender, fixed, spreads, times, verdict

TABLES = {}

# --- dlrm_step.py, ctr_adam.py, state_quality.py ---

# The embedding part of a DLRM-style step: dlrm_step.py.
DLRM_TORCH = "torch"
DLRM_OTHERS = [("plain swap", "swap (torch's optimizer)"), ("hostembed, 4 calls", "hostembed, 4 calls"),
               ("collection", "collection"), ("collection, `fused=True`", "collection fused")]
DLRM_OPTIMIZERS = [("SGD", "SGD"), ("Adagrad", "Adagrad"), ("row-wise Adagrad", "RowWiseAdagrad")]


def _dlrm_col(header, name):
    """ms a step, and torch's ms over it: 0.57 (0.96x)."""
    mine = Fig("step_time_median", fixed(2), contender(name))
    torch_ms = Fig("step_time_median", where=contender(DLRM_TORCH))
    return Col(header, [mine, " (", Calc(lambda t, c: t / c, times(2), (torch_ms, mine)), ")"])


TABLES["dlrm-step"] = Table(
    where={"benchmark": "dlrm_step", "folder": "cpu-2026-11-29-xeon"},
    labels=[("optimizer", "---"), ("ids", "---"), ("bags per table", "---:")],
    cols=[Col("torch", [Fig("step_time_median", fixed(2), contender(DLRM_TORCH))])]
    + [_dlrm_col(header, name) for header, name in DLRM_OTHERS],
    rows=[Row([label, {"uniform": "uniform", "zipf": "Zipf"}[ids], f"{bags:,}"],
              {"workload.optimizer": optimizer, "workload.ids": ids, "workload.bags": bags},
              cells={1: Cell(["-"])} if optimizer == "RowWiseAdagrad" else {})  # torch has no row-wise Adagrad
          for label, optimizer in DLRM_OPTIMIZERS for ids in ("uniform", "zipf") for bags in (128, 2048, 16384)])

# Does compact optimizer state hold model quality: state_quality.py --models cf,dlrm,deepfm.
SQ_MODELS = [("collaborative filtering", "cf"), ("DLRM-style", "dlrm"), ("DeepFM-shaped", "deepfm")]
SQ_FORMS = [  # (label, state_quality.py's form)
    ("float32 / bfloat16", "bf16_state"), ("float32 / bfloat16, stochastic rounding", "bf16_state_sr"),
    ("float32 / float16", "f16_state"), ("float32 / 8-bit", "int8"),
    ("float32 / 8-bit, stochastic rounding", "int8_sr"), ("float32 / row-wise exp_avg_sq", "rowwise"),
    ("float32 / 8-bit exp_avg, row-wise exp_avg_sq", "int8_rowwise"),
    ("bfloat16 / float32 (the table's own cost)", "bf16_table"), ("bfloat16 / 8-bit", "bf16_table_int8"),
    ("bfloat16 / 8-bit exp_avg, row-wise exp_avg_sq", "bf16_table_int8_rowwise"),
    # bitsandbytes' Adam8bit ("bnb_adam8bit", against torch's dense Adam) is not a row: the
    # committed run's machine had no bitsandbytes.
]


SQ_DIFFERENCE = [Fig("auc_difference", lambda v: f"{v:+.4f}"), " ",
                 Calc(lambda d, t: d / t, verdict, (Fig("auc_difference"), Fig("auc_tolerance")))]
SQ_SPREAD = Calc(lambda hi, lo: hi - lo, fixed(4), (Fig("auc_max"), Fig("auc_min")))
SQ_REFERENCE = [Fig("auc_mean", fixed(4)), " (", SQ_SPREAD, ")"]

TABLES["state-quality"] = Table(
    where={"benchmark": "state_quality", "folder": "cpu-2026-11-29-xeon"},
    labels=[("table / moments", "---")],
    cols=[Col(header, SQ_DIFFERENCE, where={"workload.model": model}) for header, model in SQ_MODELS],
    rows=[Row(["float32 / float32: mean AUC (spread)"], contender("fp32"),
              cells={i: Cell(SQ_REFERENCE) for i in range(len(SQ_MODELS))})]
    # A form whose loss became non-finite has no AUC (a blank cell; its rows
    # say how many seeds diverged: "diverged_runs").
    + [Row([label], contender(form)) for label, form in SQ_FORMS])

# Adam on a click-through-rate model: ctr_adam.py, one run at batch 2048 and one at 256.
CTR_TORCH, CTR_FUSED = "torch_adam", "torch_adam_fused"
CTR_CONTENDERS = [  # (label, ctr_adam.py's contender)
    ("torch `nn.Embedding` + `torch.optim.Adam` (as written)", CTR_TORCH),
    ("the same, `Adam(fused=True)`", CTR_FUSED), ("the same, DeepSpeedCPUAdam", "deepspeed_adam"),
    ("plain swap, `torch.optim.Adam` unchanged", "swap_adam"), ("plain swap, `Adam(fused=True)`", "swap_adam_fused"),
    ("`hostembed.SparseAdam(model.parameters())` (lazy)", "sparse_adam"),
]
CTR_BATCHES = (2048, 256)


def _ctr_speed(base, name):
    """base's ms a step over name's, in one run."""
    return Calc(lambda b, c: b / c, fixed(2), (Fig("step_time_median", where=contender(base)),
                                               Fig("step_time_median", where=contender(name))))


def _ctr_row(label, name):
    """A contender's row: its ms a step and the speed columns at each batch
    (the speeds select the run's torch rows, so their cells select by batch
    alone)."""
    cells = {}
    for k, batch in enumerate(CTR_BATCHES):
        for j, base in ((1, CTR_TORCH), (2, CTR_FUSED)):
            cells[3 * k + j] = Cell([_ctr_speed(base, name)], where={"workload.batch": batch})
    return Row([label], contender(name), cells=cells)


TABLES["ctr-adam"] = Table(
    where={"benchmark": "ctr_adam", "folder": "cpu-2026-11-29-xeon"},
    labels=[("contender", "---")],
    cols=[col for batch in CTR_BATCHES for col in (
        Col(f"batch {batch}: ms/step", [Fig("step_time_median", fixed(1))], where={"workload.batch": batch}),
        Col("x torch Adam", []), Col("x fused Adam", []))]
    + [Col("peak RSS added", [Fig("peak_rss_added", fixed(1), to="GiB")], collapse=True, suffix=" GiB"),
       Col("held-out AUC (batch)", [Fig("auc", fixed(4)), " (", Label("batch", fixed(0)), ")"])],
    rows=[_ctr_row(label, name) for label, name in CTR_CONTENDERS])

# --- state_quality.py's knowledge graphs, lm_step.py ---
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

# Compact state on real knowledge graphs: state_quality.py --models kg_*, 2026-11-28.
TABLES["state-quality-kg"] = Table(
    where={"benchmark": "state_quality", "folder": "cpu-2026-11-28"},
    labels=[("table / moments", "---")],
    cols=[Col(name, [Calc(lambda d, t: d / t, spreads, (Fig("mrr_difference"), Fig("mrr_tolerance")))],
              where={"workload.model": model}) for name, model in KG_DATASETS],
    rows=[Row(["float32 / float32: mean MRR (spread)"], contender("fp32"),
              cells={i: Cell([Fig("mrr_mean", fixed(4)), " (",
                              Calc(lambda hi, lo: hi - lo, fixed(4), (Fig("mrr_max"), Fig("mrr_min"))), ")"])
                     for i in range(3)})]
    + [Row([label], contender(form)) for label, form in KG_FORMS])

# A language model's token table (CPU): lm_step.py --hidden 64 --tokens 1024, 2026-11-28.
TABLES["lm-step"] = Table(
    where={"benchmark": "lm_step", "folder": "cpu-2026-11-28"},
    labels=[("vocabulary", "---:"), ("tie", "---")],
    cols=[Col("torch ms/step", [Fig("step_time_median", fixed(1))], where={"contender": LM_TORCH}),
          Col("hostembed ms/step", [Fig("step_time_median", fixed(1))], where={"contender": LM_HOSTEMBED}),
          Col("speed vs torch", [Fig("speed_vs_torch", times(2))], where={"contender": LM_HOSTEMBED}),
          Col("weight + gradient + AdamW state of the table, torch", LM_SIZES, align="---",
              where={"contender": LM_TORCH}),
          Col("hostembed", LM_SIZES, align="---", where={"contender": LM_HOSTEMBED})],
    rows=[Row([f"{vocab:,}", "tied" if tied else "untied"], {"workload.vocab": vocab, "workload.tied": tied})
          for vocab in (50257, 256000) for tied in (True, False)])
