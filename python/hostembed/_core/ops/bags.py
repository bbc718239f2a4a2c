"""EmbeddingBag's CPU ops: the bags of one or many tables pooled straight
from their tables in one call of the core (sum or mean, per-sample
weights, padding_idx), and backward's view of a batch (each position's bag
and gradient factor)."""
import torch
from torch import Tensor

from .. import _C
from ..ids import ID_DTYPES
from ..table import DTYPE_CODES, compute_dtype, host_table_of
from .common import address, cpu_ids_args, functorch_active, holding, scratch


class BagBatch:
    """One table's bags, checked for shape and dtype and held (with the
    tensors the core reads) until the call; its ids range-checked by pool().

    ids: flat CPU ids; offsets: each bag's start (int32 or int64), as
    torch's embedding_bag takes them: with include_last_offset one more
    entry, the end of the last bag (ids past it are in no bag), else the
    last bag ends with the ids; checked by the core (ValueError).
    per_sample_weights: [ids] of the table's dtype, or None."""

    __slots__ = ("table", "ids", "offsets", "include_last_offset", "weights", "num_bags", "padding_idx", "mean",
                 "args")

    def __init__(self, weight: Tensor, ids: Tensor, offsets: Tensor, include_last_offset: bool,
                 per_sample_weights, padding_idx: int, mean: bool, what: str = "a bag lookup", table=None):
        # table: weight's HostTable, when the caller has just checked that
        # weight is exactly its rows (HostTableModule._prepare_weight).
        self.table = table = host_table_of(weight, what) if table is None else table
        if offsets.dtype != torch.int64 or not offsets.is_contiguous():  # (a no-op .to() costs ~1 us)
            offsets = offsets.to(torch.int64).contiguous()
        self.offsets = offsets
        if include_last_offset and offsets.numel() and 0 <= int(offsets[-1]) < ids.numel():
            # The ids after the last offset are in no bag: never read, never
            # checked, no gradient (an end past the ids is the core's error).
            end = int(offsets[-1])
            ids = ids[:end]
            per_sample_weights = None if per_sample_weights is None else per_sample_weights[:end]
        self.ids = ids if ids.is_contiguous() else ids.contiguous()
        self.include_last_offset = include_last_offset
        self.num_bags = max(offsets.numel() - include_last_offset, 0)
        # Detached: the core reads the values; autograd keeps the tensor.
        self.weights = None if per_sample_weights is None else per_sample_weights.detach().to(
            compute_dtype(table.dtype)).contiguous()
        self.padding_idx, self.mean = padding_idx, mean
        ids = self.ids
        if not ids.is_cpu or ids.dtype not in ID_DTYPES:
            cpu_ids_args(ids)  # its error
        self.args = (table.buffer, table.num_rows, table.dim, DTYPE_CODES[table.dtype], address(ids), ids.numel(),
                     ids.dtype == torch.int64, address(offsets), offsets.numel(), include_last_offset,
                     0 if self.weights is None else address(self.weights), padding_idx, mean)


def pool(batches: list) -> list:
    """Each batch's pooled bags, [num_bags, dim] of its table's dtype, by one
    call of the core (threads over every table's bags). IndexError naming
    the first bad id (and its table, for several) before any output is
    written; ValueError for offsets that do not start at 0, decrease, or
    pass the ids' end."""
    outs = [scratch(b.num_bags, b.table.dim, dtype=b.table.dtype) for b in batches]
    with holding({id(b.table): b.table for b in batches}.values()):
        _C.pool_bags(batches=[b.args + (address(out),) for b, out in zip(batches, outs)])
    return outs


def torch_op_pool(batch: BagBatch, weight: Tensor, per_sample_weights, sparse: bool):
    """torch_op_bags of a BagBatch (its ids after the last offset dropped).
    per_sample_weights: as the caller has it (autograd's tensor), the
    batch's own being a detached copy."""
    count = batch.ids.numel()
    if per_sample_weights is not None and per_sample_weights.numel() != count:
        per_sample_weights = per_sample_weights[:count]
    return torch_op_bags(batch.table, weight, batch.ids, batch.offsets, per_sample_weights, batch.mean,
                         batch.include_last_offset, batch.padding_idx, sparse)


def torch_op_bags(table, weight: Tensor, ids: Tensor, offsets, per_sample_weights, mean: bool,
                  include_last_offset: bool, padding_idx: int, sparse: bool):
    """The bags pooled by torch's embedding_bag on the table's weight (a
    CPU tensor over its rows, checked by the caller to be exactly them),
    with torch's C++ autograd node, or None where pool() must run: the
    table not float32 (the core sums a half table's gradient in float32),
    fused (its backward queues the update), distributed, or a functorch
    transform active. The same bits as pool() (but for a bag of one id,
    whose row comes back as it is: a -0.0 stays -0.0, where a sum from
    zero gives +0.0), whose checks run first (the core's ValueError and
    IndexError, before any row is read). ids:
    contiguous CPU int64/int32, 1-D with int64 offsets (contiguous; the ids
    past the last offset, with include_last_offset, dropped), or 2-D (bags
    of a fixed size) with offsets None."""
    if table.dtype != torch.float32 or table.fused or table.sharded or functorch_active():
        return None
    singles = _C.check_bags(ids=ids.data_ptr(), count=ids.numel(), ids_int64=ids.dtype == torch.int64,
                            offsets=0 if offsets is None else offsets.data_ptr(),
                            num_offsets=0 if offsets is None else offsets.numel(), num_rows=table.num_rows)
    if offsets is None:
        singles = ids.shape[1] == 1 and ids.numel() > 0
    with table.lock:  # no update of the rows from another thread meanwhile
        if table.last_gpu_use is not None:
            table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
        if singles and per_sample_weights is None and padding_idx < 0:
            # Bags of one id each (DLRM's): the rows themselves, and their
            # gradient, by torch's embedding op at a third of
            # embedding_bag's cost (3.6 us against 11 at 128 bags).
            return torch.nn.functional.embedding(ids.reshape(-1), weight, sparse=sparse)
        return torch.nn.functional.embedding_bag(
            ids, weight, offsets, mode="mean" if mean else "sum", sparse=sparse,
            per_sample_weights=per_sample_weights, include_last_offset=include_last_offset,
            padding_idx=None if padding_idx < 0 else padding_idx)


def positions(batch: BagBatch):
    """(bag_of, row_weights or None): each position's bag (int64) and its
    share of that bag's gradient in the table's compute dtype: the
    per-sample weight, or 1 / the bag's counted size for a mean, 0 for
    padding (None: every share is 1)."""
    count = batch.ids.numel()
    bag_of = torch.empty(count, dtype=torch.int64)
    weights = torch.empty(count, dtype=compute_dtype(batch.table.dtype))
    wrote = _C.bag_positions(batch=batch.args + (0,), bag_of=address(bag_of), weights=address(weights))
    return bag_of, weights if wrote else None
