"""The tables of docs/results.md drawn from the rows of cpu/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Col, Fig, Row, Table, contender, fixed, none_if_zero, pct, sig, times

TABLES = {}

# --- cpu_step.py, per_call.py, many_tables.py ---
STEP_PER_CALL_FOLDER = "cpu-2026-11-29-xeon"


def _ms(v):
    """ms/step as the page writes them: 19.3, 700.3, 3,248."""
    return f"{v:,.0f}" if v >= 1000 else f"{v:,.1f}"


# One training step on the CPU: cpu_step.py. (label, cpu_step.py's contender)
CPU_STEP_CONTENDERS = [
    ("hostembed.Embedding + hostembed.SparseAdam", "hostembed.Embedding + hostembed.SparseAdam"),
    ("the same, `SparseAdam(fused=True)`", "hostembed.Embedding + hostembed.SparseAdam(fused=True)"),
    ("fused, and `emb.prefetch` of the next batch",
     "hostembed.Embedding + hostembed.SparseAdam(fused=True) + prefetch"),
    ("torch nn.Embedding(sparse=True) + torch.optim.SparseAdam",
     "torch.nn.Embedding(sparse=True) + torch.optim.SparseAdam"),
    ("torch nn.Embedding + torch.optim.Adam (dense, default)", "torch.nn.Embedding + torch.optim.Adam"),
    ("torch nn.Embedding + torch.optim.Adam(fused=True)", "torch.nn.Embedding + torch.optim.Adam(fused=True)"),
    ("torch nn.Embedding + DeepSpeedCPUAdam", "torch.nn.Embedding + DeepSpeedCPUAdam"),
    ("hostembed.Embedding + torch.optim.Adam (plain swap: dense Adam, torch's results)",
     "hostembed.Embedding + torch.optim.Adam (plain swap)"),
]

TABLES["cpu-step"] = Table(
    where={"benchmark": "cpu_step", "folder": STEP_PER_CALL_FOLDER},
    labels=[("contender", "---")],
    cols=[Col("ms/step (median)", [Fig("step_time_median", _ms)]),
          Col("speedup", [Fig("speed_vs_torch_sparse_adam", times(2))]),
          # A contender's peak alone (cpu_step.py's run_group), the same from run to run: written once.
          Col("peak RSS", [Fig("peak_rss", fixed(1), to="GiB"), " GiB"], collapse=True)],
    rows=[Row([label], contender(name)) for label, name in CPU_STEP_CONTENDERS])

# One lookup call (CPU): per_call.py; a row an ids-per-call size.
PER_CALL_SIZES = (512, 8192, 65536, 1048576)
PER_CALL_CONTENDERS = [("torch Embedding", "torch Embedding"), ("hostembed Embedding", "hostembed Embedding"),
                       ("hostembed, core path", "hostembed Embedding, core path"),
                       ("torch EmbeddingBag (bags of 4)", "torch EmbeddingBag (bags of 4)"),
                       ("hostembed EmbeddingBag (bags of 4)", "hostembed EmbeddingBag (bags of 4)")]

TABLES["per-call"] = Table(
    where={"benchmark": "per_call", "folder": STEP_PER_CALL_FOLDER},
    labels=[("ids per call", "---:")],
    cols=[Col(header, [Fig("forward_backward_time_median", fixed(0)), " / ",
                       Fig("forward_no_grad_time_median", fixed(0))], where=contender(name))
          for header, name in PER_CALL_CONTENDERS],
    rows=[Row([f"{size:,}"], {"workload.ids": size}) for size in PER_CALL_SIZES])

TABLES["per-call-step"] = Table(
    where={"benchmark": "per_call", "folder": STEP_PER_CALL_FOLDER},
    labels=[("ids per call", "---:")],
    cols=[Col(header, [Fig("step_time_median", fixed(0))], where=contender(name)) for header, name in (
        ("training step: torch", "torch Embedding"), ("hostembed", "hostembed Embedding"),
        ("hostembed, core path", "hostembed Embedding, core path"))],
    rows=[Row([f"{size:,}"], {"workload.ids": size}) for size in PER_CALL_SIZES])

# Many small lookups a step: many_tables.py, once with --optimizer sgd, once adagrad.
MANY_TORCH, MANY_SWAP = "torch's modules", "hostembed (plain swap)"


def _many_tables_cols():
    cols = []
    for optimizer, name in (("sgd", "SGD"), ("adagrad", "Adagrad")):
        where = {"workload.optimizer": optimizer}
        cols += [Col(f"{name}: torch", [Fig("step_time_median", fixed(2))], where={**where, **contender(MANY_TORCH)}),
                 Col("hostembed", [Fig("step_time_median", fixed(2))], where={**where, **contender(MANY_SWAP)}),
                 Col("speed-up", [Fig("speed_vs_torch", times(2))], where={**where, **contender(MANY_SWAP)})]
    return cols


TABLES["many-tables"] = Table(
    where={"benchmark": "many_tables", "folder": STEP_PER_CALL_FOLDER},
    labels=[("modules, batch", "---")],
    cols=_many_tables_cols(),
    rows=[Row([label], {"workload.modules": modules, "workload.batch": batch}) for label, modules, batch in (
        ("`Embedding` a field (pytorch-fm), 128", "embedding", 128), ("`Embedding` a field, 2,048", "embedding", 2048),
        ("`EmbeddingBag` a table, bags of 1 (DLRM), 128", "bag", 128), ("`EmbeddingBag` a table, 2,048", "bag", 2048))])


# --- cpu_breadth.py, load_save.py ---
BREADTH_LOAD_FOLDER = "cpu-2026-11-29-xeon"

# Optimizers, EmbeddingBag and half tables on the CPU: cpu_breadth.py. A
# group: (its label, cpu_breadth.py's group, its contenders: (label, name)),
# the checked one first, then its fused twin, then the reference.
BREADTH_GROUPS = [
    (label, group, [(ours, checked), ("`fused=True`", fused), (f"reference: {reference}", reference)])
    for label, group, ours, checked, fused, reference in [
        ("SGD", "SGD", "hostembed.SGD", "hostembed SGD", "hostembed SGD(fused=True)", "torch SGD"),
        ("Adagrad", "Adagrad", "hostembed.Adagrad", "hostembed Adagrad", "hostembed Adagrad(fused=True)",
         "torch Adagrad"),
        ("row-wise Adagrad", "RowWiseAdagrad", "hostembed.RowWiseAdagrad", "hostembed RowWiseAdagrad",
         "hostembed RowWiseAdagrad(fused=True)", "FBGEMM TBE, EXACT_ROWWISE_ADAGRAD"),
        ("SparseAdam", "SparseAdam", "hostembed.SparseAdam", "hostembed SparseAdam",
         "hostembed SparseAdam(fused=True)", "torch SparseAdam"),
        ("EmbeddingBag (sum), SparseAdam", "EmbeddingBag(sum)", "hostembed.EmbeddingBag + SparseAdam",
         "hostembed EmbeddingBag + SparseAdam", "hostembed EmbeddingBag + SparseAdam(fused=True)",
         "torch EmbeddingBag + SparseAdam"),
        ("EmbeddingBag (sum), row-wise Adagrad", "EmbeddingBag(sum) + row-wise Adagrad",
         "hostembed.EmbeddingBag + RowWiseAdagrad", "hostembed EmbeddingBag + RowWiseAdagrad",
         "hostembed EmbeddingBag + RowWiseAdagrad(fused=True)", "FBGEMM TBE (SUM), EXACT_ROWWISE_ADAGRAD"),
        *[(f"{dtype} table, SparseAdam", f"{dtype} table", "hostembed.SparseAdam",
           f"hostembed SparseAdam, {dtype} table", f"hostembed SparseAdam, {dtype} table(fused=True)",
           f"torch SparseAdam, {dtype} table") for dtype in ("bfloat16", "float16")]]]


def _breadth_rows():
    rows = []
    for label, group, contenders in BREADTH_GROUPS:
        for i, (name_label, name) in enumerate(contenders):
            rows.append(Row([label if i == 0 else "", name_label], {"workload.group": group, **contender(name)}))
    return rows


TABLES["cpu-breadth"] = Table(
    where={"benchmark": "cpu_breadth", "folder": BREADTH_LOAD_FOLDER},
    labels=[("group", "---"), ("contender", "---")],
    cols=[Col("ms/step", [Fig("step_time_median", fixed(1))]),
          Col("vs reference", [Fig("speed_vs_reference", times(2))], collapse=True),
          Col("vs hostembed SparseAdam", [Fig("speed_vs_hostembed_sparse_adam", times(2))], collapse=True),
          Col("of copy bandwidth", [Fig("copy_bandwidth_share", pct(0))], collapse=True),
          Col("optimizer state", [Fig("state_size", none_if_zero(sig(2, " MiB"), "0"), to="MiB")], collapse=True),
          Col("peak RSS added", [Fig("peak_rss_added", fixed(0), to="MiB"), " MiB"], collapse=True)],
    rows=_breadth_rows())

# Loading and saving a 4 GiB table: load_save.py. A load case: (its label,
# load_save.py's case, cache state, the peak column in bold).
LOAD_CASES = [
    ("torch.load + nn.Embedding.load_state_dict", "torch.load", "warm", True),
    ("torch.load(mmap=True) + meta nn.Embedding + assign=True, then one pass over the rows", "torch mmap", "warm",
     False),
    ("hostembed from_pretrained .pt", "hostembed .pt", "warm", True),
    ("hostembed from_pretrained .safetensors", "hostembed .safetensors", "warm", False),
    ("hostembed from_pretrained .npy", "hostembed .npy", "warm", False),
    ("hostembed from_pretrained float16 .safetensors", "hostembed .safetensors fp16", "warm", False),
    ("torch.load + nn.Embedding.load_state_dict", "torch.load", "cold", False),
    ("torch.load(mmap=True) + meta + assign=True, then one pass", "torch mmap", "cold", False),
    ("hostembed from_pretrained .pt", "hostembed .pt", "cold", False),
    ("hostembed from_pretrained .safetensors", "hostembed .safetensors", "cold", False),
    ("hostembed from_pretrained .npy", "hostembed .npy", "cold", False),
    ("hostembed from_pretrained float16 .safetensors", "hostembed .safetensors fp16", "cold", False),
]

TABLES["load-save-load"] = Table(
    where={"benchmark": "load_save", "folder": BREADTH_LOAD_FOLDER},
    labels=[("load", "---"), ("cache", "---")],
    cols=[Col("wall s", [Fig("load_time_median", fixed(2))]),
          Col("of which allocating the table", [Fig("allocate_time", fixed(2))]),
          Col("read file s", [Fig("file_read_time_median", fixed(2))]),
          Col("x read", [Fig("time_vs_read", fixed(1))]),
          Col("x read, allocation excluded", [Fig("time_vs_read_without_allocation", fixed(2))]),
          Col("peak RSS / bytes loaded", [Fig("peak_rss_of_loaded", fixed(2))])],
    rows=[Row([label, cache], {**contender(case), "workload.cache": cache}, bold=(7,) if bold else ())
          for label, case, cache, bold in LOAD_CASES])

TABLES["load-save-save"] = Table(
    where={"benchmark": "load_save", "folder": BREADTH_LOAD_FOLDER},
    labels=[("save", "---")],
    cols=[Col("wall s", [Fig("save_time_median", fixed(1))]),
          Col("GB/s", [Fig("save_rate", fixed(2))]),
          Col("x plain write", [Fig("time_vs_plain_write", fixed(2))]),
          Col("extra peak RSS", [Fig("peak_rss_added", none_if_zero(sig(2, " MiB"), "0"), to="MiB")])],
    rows=[Row([label], contender(name)) for label, name in (
        ("plain `os.write` of the same bytes + fsync", "plain write"),
        ("`hostembed.save` (temporary name, no CRC, fsync, rename)", "hostembed.save"),
        ("`torch.save` with its defaults + fsync", "torch.save"))])


# --- state_step.py ---
STATE_FORMS = [  # (label, state_step.py's form, bold)
    ("float32 / float32 (torch's SparseAdam state)", "fp32", False), ("float32 / bfloat16", "bf16_state", False),
    ("float32 / 8-bit", "int8", False), ("float32 / float32 exp_avg, row-wise exp_avg_sq", "rowwise", False),
    ("float32 / 8-bit exp_avg, row-wise exp_avg_sq", "int8_rowwise", False),
    ("bfloat16 / float32", "bf16_table", False), ("bfloat16 / 8-bit", "bf16_int8", True),
    ("bfloat16 / 8-bit exp_avg, row-wise exp_avg_sq", "bf16_int8_rowwise", True),
]

UNFUSED, FUSED = {"workload.fused": False}, {"workload.fused": True}

# Compact optimizer state (CPU): state_step.py, 2026-11-28.
TABLES["state-step"] = Table(
    where={"benchmark": "state_step", "folder": "cpu-2026-11-28"},
    labels=[("table / moments", "---")],
    cols=[Col("bytes a parameter (RSS / allocated)", [Fig("bytes_per_parameter_rss", fixed(2)), " / ",
                                                      Fig("bytes_per_parameter_allocated", fixed(2))]),
          Col("step ms", [Fig("step_time_median", fixed(2))], where=UNFUSED),
          Col("x float32", [Fig("speed_vs_fp32", times(2))], where=UNFUSED),
          Col("`fused=True` ms", [Fig("step_time_median", fixed(2))], where=FUSED),
          Col("x float32", [Fig("speed_vs_fp32", times(2))], where=FUSED),
          Col("weight + state bytes a step", [Fig("weight_and_state_traffic", fixed(1), to="MB"), " MB"])],
    rows=[Row([label], contender(form), bold=(0, 1) if bold else ()) for label, form, bold in STATE_FORMS])
