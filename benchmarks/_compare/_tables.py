"""The tables of docs/results.md drawn from the rows of _compare/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Col, Fig, Row, Table, contender, fixed, sig, times

TABLES = {}

# --- compare.py ---
# The collaborative-filtering model on the CPU: compare.py (--size default), 2026-11-29.
CPU_COMPARE_ROWS = [  # (label, compare.py's contender, speedup in bold)
    ("1. torch nn.Embedding (CPU) + Adam (dense)", "torch nn.Embedding (CPU) + torch.optim.Adam (dense)", False),
    ("2. torch nn.Embedding(sparse=True) (CPU) + SparseAdam",
     "torch nn.Embedding(sparse=True) (CPU) + torch.optim.SparseAdam", False),
    ("4. hostembed.Embedding + hostembed.SparseAdam", "hostembed.Embedding + hostembed.SparseAdam", True),
    ("5. the same, `SparseAdam(fused=True)`", "hostembed.Embedding + hostembed.SparseAdam(fused=True)", True),
    ("6. torch nn.Embedding (CPU) + Adam(fused=True) (dense)",
     "torch nn.Embedding (CPU) + torch.optim.Adam(fused=True) (dense)", False),
    ("7. hostembed.Embedding + torch.optim.Adam (dense, plain swap)",
     "hostembed.Embedding + torch.optim.Adam (dense, plain swap)", False),
]
TABLES["cpu-compare"] = Table(
    where={"benchmark": "compare", "folder": "cpu-2026-11-29-xeon", "workload.device": "cpu"},
    labels=[("contender", "---")],
    cols=[Col("ms/step", [Fig("step_time_median", sig(3))]),
          Col("speedup", [Fig("speedup_vs_torch_sparse_cpu", times(2))]),
          Col("peak RSS", [Fig("peak_rss", fixed(2), to="GiB")], collapse=True, suffix=" GiB")],
    rows=[Row([label], contender(name), bold=(2,) if bold else ()) for label, name, bold in CPU_COMPARE_ROWS])
