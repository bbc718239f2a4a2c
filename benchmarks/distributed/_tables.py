"""The tables of docs/results.md drawn from the rows of distributed/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
from _report import Col, Fig, Row, Table, contender, fixed, none_if_zero

TABLES = {}

# --- sharded_step.py, torchrec_sharded_step.py ---
# One table over several processes (CPU, gloo): sharded_step.py --optimizer RowWiseAdagrad and
# torchrec_sharded_step.py, alternated, 2026-11-29.
SHARDED, SHARED = "hostembed.distributed.ShardedEmbedding", "hostembed.distributed.SharedEmbedding"
TORCHREC = "TorchRec EmbeddingBagCollection, ROW_WISE (FBGEMM fused row-wise Adagrad)"


def _step(header, who):
    """ms a step of one contender, each run's (the scripts alternated)."""
    return Col(header, [Fig("step_time_median", fixed(1))], where=contender(who), join=", ")


def _both(metric, fmt, to):
    return [Fig(metric, fmt, contender(SHARDED), to), " / ", Fig(metric, fmt, contender(SHARED), to)]


TABLES["sharded-step"] = Table(
    where={"benchmark": ("sharded_step", "torchrec_sharded_step"), "folder": "cpu-2026-11-29-xeon",
           "workload.optimizer": "RowWiseAdagrad"},
    labels=[("processes", "---:")],
    cols=[_step("hostembed, plain table", "plain hostembed.Embedding"), _step("sharded", SHARDED),
          _step("shared", SHARED), _step("TorchRec, row-wise", TORCHREC),
          Col("MB sent a step: sharded / shared", _both("bytes_sent", none_if_zero(fixed(1), "0"), "MB"),
              where={"benchmark": "sharded_step"}, join=", ", collapse=True),
          Col("memory of all processes (PSS): sharded / shared", _both("pss_all_processes", fixed(2), "GiB"),
              where={"benchmark": "sharded_step"}, join=", ", collapse=True, suffix=" GiB"),
          Col("TorchRec's peak RSS, all processes", [Fig("peak_rss_all_processes", fixed(2), to="GiB")],
              where=contender(TORCHREC), join=", ", collapse=True, suffix=" GiB")],
    rows=[Row([str(procs)], {"workload.procs": procs}) for procs in (1, 2, 4)])
