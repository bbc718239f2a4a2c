"""The eager CPU path of hostembed.EmbeddingBag in "sum" and "mean" modes.

Forward: the core checks the ids' range, and torch's embedding_bag pools
the rows straight from the table (its threads over bags, no sort: outputs
are torch's, bit for bit); the sort of the ids waits for backward, which
needs it. With max_norm the core sorts the ids first, renorms each distinct
row once, and embedding_bag pools the rows it read. Backward: each
position's gradient is its bag's output gradient times its weight
(per_sample_weights, or 1 / the bag's size for a mean, 0 outside every
bag); the core sums those per id with one sort of the ids (the forward's,
with max_norm), reading each bag's gradient row where the position points
(he_reduce_opts.bag_of), so no per-position copy is made: one reduce
straight into the table's row-sparse gradient, or into the fused update.
(torch's own embedding_bag backward into the rows alone took 14.6 ms for
65,536 ids x 128 on 2 cores.)

"max" mode and GPU outputs go through the general path in
embedding_bag.py (the Embedding lookup of the unique ids, then
embedding_bag with its autograd); torch.compile through its traced path
(the lookup of every id, then embedding_bag).
"""
import torch
import torch.nn.functional as F

from ..._core import fused as _fused
from ..._core.ops import common as common_ops, cpu as cpu_ops


class PooledLookup(torch.autograd.Function):

    @staticmethod
    def forward(ctx, weight, ids, offsets, per_sample_weights, mode, include_last_offset, padding_idx, max_norm,
                norm_type, scale_grad_by_freq, sparse):
        num_rows = weight.shape[0]
        if max_norm is None:
            table = cpu_ops.checked_table(weight, ids, "a bag lookup")
            with table.lock:
                table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
                out = F.embedding_bag(ids, weight.detach(), offsets, mode=mode, per_sample_weights=per_sample_weights,
                                      include_last_offset=include_last_offset,
                                      padding_idx=padding_idx if padding_idx >= 0 else None)
            dedup, inverse, rows = None, None, None
        else:
            dedup, unique, inverse = cpu_ops.dedup_ids(ids, num_rows)
            rows, _, table = cpu_ops.lookup_rows(weight, unique, max_norm, norm_type)
            out = F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=per_sample_weights,
                                  include_last_offset=include_last_offset,
                                  padding_idx=padding_row(unique, padding_idx))
        ctx.table, ctx.dedup, ctx.table_shape = table, dedup, tuple(weight.shape)
        ctx.spec = (mode, include_last_offset, padding_idx, scale_grad_by_freq, sparse)
        ctx.save_for_backward(ids, offsets, per_sample_weights, inverse, rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ids, offsets, per_sample_weights, inverse, rows = ctx.saved_tensors
        mode, include_last_offset, padding_idx, scale_grad_by_freq, sparse = ctx.spec
        num_rows, dim = ctx.table_shape
        dtype = ctx.table.state_dtype  # the core's: the weights in the table's compute dtype
        bag_of, counted, bags = positions(ids, offsets, include_last_offset, padding_idx, dtype)
        row_weights = gradient_weights(bag_of, counted, bags, per_sample_weights, mode, dtype)
        grad_out = grad_out.contiguous()
        if grad_out.shape[0] == 0:  # no bags: every position's gradient is 0
            grad_out = grad_out.new_zeros(1, dim)
        weights_grad = None
        if ctx.needs_input_grad[3]:
            # d out[b] / d w[p] = <grad_out[b], row of ids[p]>: 0 outside
            # every bag and at padding, as torch gives.
            looked_up = ctx.table.tensor.index_select(0, ids) if rows is None else rows.index_select(0, inverse)
            weights_grad = (grad_out.index_select(0, bag_of) * looked_up).sum(1)
            if counted is not None:
                weights_grad.mul_(counted)
        grad = None
        if ctx.needs_input_grad[0]:
            table, pooling = ctx.table, _fused.Pooling(bag_of, row_weights)
            if not (table.fused and _fused.take_gradient(table, _fused.CpuGradient(
                    ids, grad_out, padding_idx, scale_grad_by_freq, ctx.dedup, pooling))):
                indices, values = cpu_ops.reduce_rows(ids, grad_out, num_rows, padding_idx, scale_grad_by_freq,
                                                    ctx.dedup, pooling, rounded=True)
                grad = common_ops.weight_grad(indices, values, num_rows, dim, sparse, ctx.table.dtype)
        return (grad, None, None, weights_grad) + (None,) * 7


def padding_row(unique, padding_idx):
    """Where padding_idx (-1: none) is among the sorted unique ids, or None."""
    if padding_idx < 0 or unique.numel() == 0:
        return None
    at = int(torch.searchsorted(unique, padding_idx))
    return at if at < unique.numel() and int(unique[at]) == padding_idx else None


def positions(ids, offsets, include_last_offset, padding_idx, dtype=torch.float32):
    """(bag_of, counted, bags): each position's bag; which positions count
    (a 0/1 float mask, None: all), 0 for those in no bag (after the last
    one, with include_last_offset; every position when there are no bags,
    which point at bag 0) and for padding (the reduce leaves padding_idx out
    anyway, and a mean does not count it); the number of bags."""
    count = ids.numel()
    starts = offsets[:-1] if include_last_offset else offsets
    if starts.numel() == 0:
        return torch.zeros(count, dtype=torch.int64), torch.zeros(count, dtype=dtype), 0
    # Each bag's start marks the position where the bag index steps up (an
    # empty bag's start coincides with the next one: a step of 2): a
    # cumulative sum, several times faster than repeat_interleave here.
    # offsets[0] is 0, so no position comes before the first bag.
    marks = torch.zeros(count + 1, dtype=torch.int64)
    marks.index_add_(0, starts.to(torch.int64), torch.ones(starts.numel(), dtype=torch.int64))
    bag_of = torch.cumsum(marks[:count], 0).sub_(1)
    covered = int(offsets[-1]) if include_last_offset else count
    counted = None
    if covered < count:
        # Positions after the last bag: bag_of points at it, the weight is 0.
        counted = torch.zeros(count, dtype=dtype)
        counted[:covered] = 1
    if padding_idx >= 0:
        not_padding = (ids != padding_idx).to(dtype)
        counted = not_padding if counted is None else counted * not_padding
    return bag_of, counted, starts.numel()


def gradient_weights(bag_of, counted, bags, per_sample_weights, mode, dtype=torch.float32):
    """Each position's gradient factor (None: all 1): its per-sample weight,
    or 1 / its bag's counted size for a mean, times the `counted` mask."""
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.to(dtype)
        weights = per_sample_weights if counted is None else per_sample_weights * counted
    elif mode == "mean" and bags:
        counted = torch.ones(bag_of.numel(), dtype=dtype) if counted is None else counted
        size = torch.zeros(bags, dtype=dtype).index_add_(0, bag_of, counted)
        weights = counted / size.clamp_(min=1).index_select(0, bag_of)
    else:
        weights = counted
    return None if weights is None else weights.contiguous()
