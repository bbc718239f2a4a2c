"""The tables of docs/results.md drawn from the rows of gpu/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Calc, Cell, Col, Fig, Label, Row, Table, contender, fixed, pct, sig, times

TABLES = {}

# --- compare.py, gpu.py and cache_step.py on a GPU ---
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
    for name, who in pairs:
        parts += [", " if parts else "", f"{name} ", Fig("step_time_mean", fixed(2), where=contender(who))]
    return Cell(parts, where={"workload.published": True})


# On a GPU: compare.py on the H200, every run of 2026-11-25 to -27.
TABLES["gpu-compare"] = Table(
    where={"benchmark": "compare", "workload.device": "cuda", "workload.size": "default"},
    labels=[("tables", "---")],
    cols=[Col(f"ms/step {date[5:]}", [Fig("step_time_median", fixed(2))], where={"date": date})
          for date in CMP_DATES]
    + [Col("GPU memory", [Fig("peak_gpu_memory", fixed(2), to="GiB")], collapse=True, suffix=" GiB")],
    rows=[Row(["the dense part alone"], contender(CMP_DENSE)),
          Row(["torch on the CPU + SparseAdam"], contender(CMP_TORCH_CPU)),
          Row(["torch on the GPU + SparseAdam"], contender(CMP_TORCH_GPU)),
          Row(["hostembed + SparseAdam"], contender(CMP_HOSTEMBED)),
          Row(["its speed against torch on the GPU"], {},
              cells={i: Cell([CMP_SPEED]) for i in range(3)} | {3: Cell([])}),
          Row(["hostembed + SparseAdam(fused=True)"], contender(CMP_FUSED)),
          Row(["hostembed with a GPU row cache, fused"], contender(CMP_CACHED),
              cells={i: Cell([Fig("step_time_median", fixed(2)), " (", Label("cache_fraction", pct(0)), ")"])
                     for i in range(3)})])

# The 60M-row reference workload: gpu.py on the H200, 2026-11-25.
TABLES["gpu-reference"] = Table(
    where={"folder": "h200-2026-11-25"},
    labels=[("update", "---")],
    cols=[Col("ms/step", [Fig("step_time_median", fixed(1))]), Col("forward", [Fig("forward_time", fixed(1))]),
          Col("backward", [Fig("backward_time", fixed(1))]),
          Col("step()", [Fig("optimizer_step_time", fixed(1))])],
    rows=[Row([label], {"benchmark": "gpu", "contender": contender, "workload.rows": 60_000_000})
          for label, contender in GPU_MODES]
    + [Row(["FBGEMM TBE, weights in host memory (published, H100)"],
           {"run": "call2_cache_step", "contender": TBE_UVM},
           cells={0: Cell([Fig("step_time_mean", fixed(2))]), 1: Cell([]), 2: Cell([]), 3: Cell([])})])

# The row cache (NVIDIA H200): cache_step.py --prefetch, 2026-11-26.
TABLES["gpu-row-cache-h200"] = Table(
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
           ("20%", 0.2, None), ("5%", 0.05, None))])
