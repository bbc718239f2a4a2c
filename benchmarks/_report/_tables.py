"""The README's results table: one row a workload, hostembed's speed in the
case that favours it and in the one that favours the other side, each
worked out from the rows of the run that measured both (declared here, not
in a group, because it draws on every group)."""
from _report.spec import Across, Calc, Cell, Col, Fig, Label, OverRuns, Row, Table, contender, fixed, lo_hi, times


def _speed(metric, theirs, ours, where=None, fmt=times(2)):
    """Their time over ours in one run (above 1x hostembed is faster)."""
    where = where or {}
    return Calc(lambda t, o: t / o, fmt, (Fig(metric, where={**where, **contender(theirs)}),
                                                     Fig(metric, where={**where, **contender(ours)})))


def _count(field, unit):
    """A workload field as the cell names it: "1,048,576 ids"."""
    return Label(field, lambda v: f"{v:,} {unit}")


def _span(figs):
    """The least and the most of several figures of one run: 1.5-3.0x."""
    return Calc(lambda *v: (min(v), max(v)), lambda lo_hi: f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}x", tuple(figs))


def _row(label, where, favourable, unfavourable):
    """A workload's row; each case is its template, or (template, the case's
    own selection within `where`) where a label names the case's workload."""
    def cell(case):
        parts, own = case if isinstance(case, tuple) else (case, None)
        return Cell(parts, None if own is None else {**where, **own})
    return Row([label], where, cells={0: cell(favourable), 1: cell(unfavourable)})


# One call and one training step: cpu/per_call.py.
PER_CALL = {"benchmark": "per_call", "folder": "cpu-2026-11-29-xeon"}


def _per_call(metric, ids):
    return ([_speed(f"{metric}_median", "torch Embedding", "hostembed Embedding"), " at ", _count("ids", "ids")],
            {"workload.ids": ids})


# Four bag tables as one EmbeddingBagCollection: clients/dlrm_step.py, Zipf ids.
DLRM = {"benchmark": "dlrm_step", "folder": "cpu-2026-11-29-xeon", "workload.ids": "zipf"}


def _dlrm(optimizer, bags, ours="collection fused"):
    return _speed("step_time_median", "torch", ours, {"workload.optimizer": optimizer, "workload.bags": bags})


DLRM_BEST = ([_dlrm("Adagrad", 16384), " Adagrad, ", _dlrm("RowWiseAdagrad", 16384),
              " row-wise Adagrad (against torch's Adagrad), ", _dlrm("SGD", 16384), " SGD, at ",
              _count("bags", "bags")], {"workload.bags": 16384})
DLRM_WORST = ([_dlrm("SGD", 128), " SGD at ", _count("bags", "bags"), "; ",
               _dlrm("SGD", 128, "swap (torch's optimizer)"), " swapped module by module with torch's SGD kept"],
              {"workload.bags": 128})

# DLRM's 26 Criteo tables, the plain swap: cpu/many_tables.py.
MANY = {"benchmark": "many_tables", "folder": "cpu-2026-11-29-xeon", "contender": "hostembed (plain swap)"}


def _many(optimizer):
    return [_span([Fig("speed_vs_torch", where={"workload.optimizer": optimizer, "workload.modules": modules,
                                               "workload.batch": batch})
                   for modules in ("embedding", "bag") for batch in (128, 2048)])]


# A DeepFM-shaped model with torch's Adam kept: clients/ctr_adam.py.
CTR = {"benchmark": "ctr_adam", "folder": "cpu-2026-11-29-xeon"}


def _ctr(batch):
    return ([_speed("step_time_median", "torch_adam", "swap_adam"), " torch's default Adam, ",
             _speed("step_time_median", "torch_adam_fused", "swap_adam"), " its `fused=True` Adam (",
             Label("batch", lambda v: f"batch {v:,}"), ")"], {"workload.batch": batch})


# Row-wise Adagrad against FBGEMM's CPU TBE: cpu/cpu_breadth.py.
BREADTH = {"benchmark": "cpu_breadth", "folder": "cpu-2026-11-29-xeon"}


def _breadth(group, ours):
    plain, fused = (Fig("speed_vs_reference", where={"workload.group": group, "contender": name})
                    for name in (ours, f"{ours}(fused=True)"))
    return [_span([plain, fused])]


# One table over gloo processes against TorchRec: distributed/, two scripts run in turn.
SHARDED = {"benchmark": ("sharded_step", "torchrec_sharded_step"), "folder": "cpu-2026-11-29-xeon"}
TORCHREC = "TorchRec EmbeddingBagCollection, ROW_WISE (FBGEMM fused row-wise Adagrad)"


def _sharded(procs):
    args = tuple(Fig("step_time_median", where={"contender": who, "workload.procs": procs})
                 for who in (TORCHREC, "hostembed.distributed.ShardedEmbedding"))
    return ([Across(lambda t, o: t / o, times(1), args), " on ",
             Label("procs", lambda v: f"{v:,} process{'es' if v != 1 else ''}")],
            {"workload.procs": procs})


# The collaborative-filtering model with outputs on an H200: compare.py, every run of 2026-11-25 to -27.
GPU_COMPARE = {"benchmark": "compare", "workload.device": "cuda", "workload.size": "default"}
TORCH_GPU = "torch nn.Embedding(sparse=True) (GPU) + torch.optim.SparseAdam"
HOSTEMBED = "hostembed.Embedding + hostembed.SparseAdam"
H200_SPEED = _speed("step_time_median", TORCH_GPU, HOSTEMBED)


def _gpu_memory(who):
    return OverRuns(max, fixed(2), Fig("peak_gpu_memory", where=contender(who), to="GiB"))


H200_BEST = [OverRuns(max, times(2), H200_SPEED), " (the best of its runs), with ", _gpu_memory(HOSTEMBED),
             " GiB of GPU memory against ", _gpu_memory(TORCH_GPU)]
H200_WORST = [OverRuns(min, times(2), H200_SPEED), " (the worst of its runs)"]

# A table on disk in a memory limit: disk/disk_table.py, 2026-11-28.
DISK = {"benchmark": "disk_table", "folder": "cpu-2026-11-28", "run": ("disk_table", "disk_table_run2")}


def _disk(optimizer, ids):
    """In-memory step over on-disk step, the least and the most of the runs."""
    speed = _speed("step_time_median", "hostembed, table in memory", "hostembed, table on disk",
                   {"workload.optimizer": optimizer, "workload.ids": ids})
    return OverRuns(lo_hi, lambda v: f"{v[0]:.2g}-{v[1]:.2g}x", speed)


TABLES = {"readme-results": Table(
    where={},
    labels=[("workload", "---")],
    cols=[Col(header, [], align="---") for header in ("speed, favourable case", "speed, unfavourable case")],
    rows=[
        _row("one lookup + backward of a 2M x 64 `Embedding`, uniform ids", PER_CALL,
             _per_call("forward_backward_time", 1048576), _per_call("forward_backward_time", 512)),
        _row("a training step of the same table, hostembed's `SparseAdam` against torch's", PER_CALL,
             _per_call("step_time", 1048576), _per_call("step_time", 512)),
        _row("4 bag tables (2M-100K x 64) as one `EmbeddingBagCollection`, `fused=True`, Zipf ids", DLRM,
             DLRM_BEST, DLRM_WORST),
        _row("DLRM's 26 Criteo tables (D=16), plain swap, the script's optimizer kept (batches 128 and 2,048)",
             MANY, ["Adagrad "] + _many("adagrad"), ["SGD "] + _many("sgd")),
        _row("DeepFM-shaped model (2.7M-row tables), `torch.optim.Adam` kept, plain swap", CTR, _ctr(256), _ctr(2048)),
        _row("row-wise Adagrad, 1M x 128, 65,536 Zipf ids (bags of 16), against FBGEMM's CPU TBE", BREADTH,
             _breadth("RowWiseAdagrad", "hostembed RowWiseAdagrad") + [" on rows"],
             _breadth("EmbeddingBag(sum) + row-wise Adagrad", "hostembed EmbeddingBag + RowWiseAdagrad")
             + [" in bags"]),
        _row("collaborative-filtering model (4M + 1M x 64, SparseAdam), outputs on an NVIDIA H200, against torch "
             "with its tables on the GPU", GPU_COMPARE, H200_BEST, H200_WORST),
        _row("one 2M x 128 table over 1, 2, 4 gloo processes, row-wise Adagrad, against TorchRec's row-wise sharding",
             SHARDED, _sharded(4), _sharded(1)),
        _row("a 4M x 128 table on disk in a 2 GiB memory limit (1 GiB cache, 16,384 Zipf(1.05) ids a step), "
             "against the same table in memory", DISK,
             [_disk("rowwise_adagrad", "zipf"), " row-wise Adagrad"],
             [_disk("sparse_adam", "zipf"), " SparseAdam; uniform ids, the disk's random I/O rate: ",
              _disk("sparse_adam", "uniform")]),
    ])}
