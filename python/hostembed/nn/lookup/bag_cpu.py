"""The eager CPU path of hostembed.EmbeddingBag in "sum" and "mean" modes,
for one table (PooledLookup) or many in one call (PooledTables, the
forward of hostembed.EmbeddingBagCollection).

A call of at most TORCH_OP_MAX_BAG_IDS ids on a float32 table goes
through torch's own embedding_bag on the table's weight, after
the core's checks (small_bags for the plain forms, pooled_lookup for the
rest): torch's C++ autograd node, the same bits.

Otherwise forward: the core pools each bag's rows straight from the table
into the output (_core/ops/bags.py: range check, then threads over all
bags, no sort); with max_norm the core sorts the ids first, renorms each
distinct row once, and torch's embedding_bag pools the rows it read.
Backward: each position's gradient is its bag's output gradient times its
share (per_sample_weights, or 1 / the bag's size for a mean, 0 for
padding); the core sums those per id with one sort of the ids (the
forward's, with max_norm), reading each bag's gradient row where the
position points (he_reduce_opts.bag_of), so no per-position copy is made:
one reduce straight into the table's row-sparse gradient, or into the
fused update.

A table with a row cache of host records: the batch's distinct rows from
the cache, pooled by the core as from the table (PooledRows).

"max" mode and GPU outputs go through the general path in
embedding_bag.py (the Embedding lookup of the unique ids, then
embedding_bag with its autograd); torch.compile through its traced path
(the lookup of every id, then embedding_bag).
"""
import torch
import torch.nn.functional as F

from ..._core import fused as _fused
from ..._core.ops import bags as bag_ops, common as common_ops, cpu as cpu_ops
from ..._core.ids import ID_DTYPES
from ..._core.table import HostTable
from . import bag_input


class PooledLookup(torch.autograd.Function):
    """One table's bags (pooled_lookup calls it): apply(weight, ids,
    offsets, per_sample_weights, (mode, include_last_offset, padding_idx,
    max_norm, norm_type, scale_grad_by_freq, sparse)); the options in one
    argument, since autograd walks every argument of every call."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, per_sample_weights, options):
        out, ctx.batch, ctx.dedup, ctx.rows, ctx.inverse = pooled(weight, ids, offsets, per_sample_weights, options)
        ctx.spec = options[5:]  # scale_grad_by_freq, sparse
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad, weights_grad = bag_gradient(ctx.batch, grad_out, ctx.needs_input_grad[0], ctx.needs_input_grad[3],
                                          *ctx.spec, ctx.dedup, ctx.rows, ctx.inverse)
        return grad, None, None, weights_grad, None


_pooled_lookup = common_ops.applier(PooledLookup)


# A bag lookup of at most this many ids runs through torch's own
# embedding_bag on the table's weight: no Python autograd Function, and
# torch's pooling kernel (FBGEMM's) is as fast as the core's or faster.
# Above it the core's backward pays: torch's copies each bag's gradient
# row out once per position for the optimizer to sort and sum, the core
# sums them per id reading each bag's row in place. Measured (2 threads,
# 2026-11-27): per_call.py's table (2M x 64, bags of 4, uniform), forward
# + backward through torch's op / the core: 153 / 228 us at 2,048 ids,
# 320 / 580 at 8,192, 657 / 863 at 32,768; but a whole SparseAdam step of
# cpu_breadth.py's bags (65,536 Zipf ids, 16 a bag, 1M x 128) took 13.7
# and 23.5 ms through torch's op against 9.6 and 7.5 through the core;
# dlrm_step.py's 2,048 bags of 4 (8,192 ids a table) step at the same
# speed either way.
TORCH_OP_MAX_BAG_IDS = 8192


def pooled_lookup(weight, ids, offsets, per_sample_weights, options):
    """The pooled bags of one table (PooledLookup's arguments), with
    autograd where a gradient can flow, through torch's own embedding_bag
    up to TORCH_OP_MAX_BAG_IDS ids (bag_ops.torch_op_pool: the same bits)."""
    tracing = torch.jit.is_tracing()
    grad = torch.is_grad_enabled() and (weight.requires_grad or (
        per_sample_weights is not None and per_sample_weights.requires_grad))
    mode, include_last_offset, padding_idx, max_norm, _, scale_grad_by_freq, sparse = options
    if cpu_ops.torch_op_serves(ids.numel(), TORCH_OP_MAX_BAG_IDS, max_norm, grad, scale_grad_by_freq, sparse):
        batch = bag_ops.BagBatch(weight, ids, offsets, include_last_offset, per_sample_weights, padding_idx,
                                 mode == "mean")
        try:
            out = bag_ops.torch_op_pool(batch, weight, per_sample_weights, sparse)
        except ValueError:  # torch's error for offsets the core refuses
            bag_input.check_offsets([batch])
            raise
        if out is not None:
            return out
    if tracing or grad:
        return _pooled_lookup(weight, ids, offsets, per_sample_weights, options)
    return pooled(weight, ids, offsets, per_sample_weights, options)[0]


def small_bags(module, input, offsets, per_sample_weights):
    """module(input, offsets, per_sample_weights) through torch's own
    embedding_bag (bag_ops.torch_op_bags) when the call is a small plain
    one (a 1-D input with int64 offsets, or a 2-D one; sum or mean; a
    float32 table; CPU outputs; no row cache, fused update or
    include_last_offset; cpu_ops.torch_op_serves with
    TORCH_OP_MAX_BAG_IDS), else None for the module's full path, which
    decides and checks everything else. The module's checks and the lookup's in one
    pass: their layers cost more than torch's op on a bag of one id a
    sample, as DLRM's script calls 26 tables."""
    table = module._table
    if not isinstance(input, torch.Tensor) or not input.is_cpu or input.dtype not in ID_DTYPES \
            or module.mode not in ("sum", "mean") or module.include_last_offset or table.cache is not None \
            or table.dtype != torch.float32 or table.fused or module._output_device.type != "cpu" \
            or torch.compiler.is_compiling():
        return None
    weight = module._parameters["weight"]
    sparse = module._sparse_gradient()
    grad = torch.is_grad_enabled() and (weight.requires_grad or (
        per_sample_weights is not None and per_sample_weights.requires_grad))
    if not cpu_ops.torch_op_serves(input.numel(), TORCH_OP_MAX_BAG_IDS, module.max_norm, grad,
                                   module.scale_grad_by_freq, sparse):
        return None
    if input.dim() == 1:
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or not offsets.is_cpu \
                or offsets.dtype != torch.int64 or not offsets.is_contiguous():
            return None
    elif input.dim() != 2 or offsets is not None or input.is_nested or input.shape[1] == 0:
        return None  # (bags of no id: torch's embedding_bag refuses them, the full path takes them)
    if per_sample_weights is not None and (module.mode != "sum" or per_sample_weights.shape != input.shape
                                           or per_sample_weights.dtype != torch.float32
                                           or not per_sample_weights.is_cpu):
        return None
    table.check_process()
    if not table.views(weight):  # replaced: the full path adopts it
        return None
    try:
        return bag_ops.torch_op_bags(table, weight, input if input.is_contiguous() else input.contiguous(), offsets,
                                     per_sample_weights, module.mode == "mean", False,
                                     -1 if module.padding_idx is None else module.padding_idx, sparse)
    except ValueError:  # offsets the core refuses: the full path raises torch's error
        return None


def pooled(weight, ids, offsets, per_sample_weights, options):
    """(the pooled bags, their BagBatch, and with max_norm the ids' Dedup,
    the distinct rows read, each id's among them)."""
    mode, include_last_offset, padding_idx, max_norm, norm_type, _, _ = options
    batch = bag_ops.BagBatch(weight, ids, offsets, include_last_offset, per_sample_weights, padding_idx,
                             mode == "mean")
    if max_norm is None:
        (out,) = pool([batch])
        return out, batch, None, None, None
    dedup, unique, inverse = cpu_ops.dedup_ids(ids, weight.shape[0])
    rows, _, _ = cpu_ops.lookup_rows(weight, unique, max_norm, norm_type)
    out = F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=per_sample_weights,
                          include_last_offset=include_last_offset, padding_idx=padding_row(unique, padding_idx))
    return out, batch, dedup, rows, inverse


class PooledTables(torch.autograd.Function):
    """Many tables' bags (sum or mean, no max_norm) pooled by one call of
    the core (pooled_tables calls it); backward gives each table its
    gradient as PooledLookup does. apply(specs, *weights,
    *per_sample_weights): specs holds a (ids, offsets, include_last_offset,
    padding_idx, mean, scale_grad_by_freq, sparse, table) per table, each
    weight checked to be its table's rows (HostTableModule._prepare_weight)
    by the caller."""

    @staticmethod
    def forward(ctx, specs, *tensors):
        count = len(specs)
        ctx.batches = table_batches(specs, tensors[:count], tensors[count:])
        ctx.specs = [spec[5:7] for spec in specs]
        return tuple(pool(ctx.batches))

    @staticmethod
    def backward(ctx, *grad_outs):
        count = len(ctx.batches)
        grads, weights_grads = [None] * count, [None] * count
        for k, (batch, grad_out, spec) in enumerate(zip(ctx.batches, grad_outs, ctx.specs)):
            needs_weight, needs_weights = ctx.needs_input_grad[1 + k], ctx.needs_input_grad[1 + count + k]
            if grad_out is not None and (needs_weight or needs_weights):
                grads[k], weights_grads[k] = bag_gradient(batch, grad_out, needs_weight, needs_weights, *spec)
        return (None, *grads, *weights_grads)


_pooled_tables = common_ops.applier(PooledTables)


def pooled_tables(specs, weights, sample_weights):
    """Each table's pooled bags (PooledTables' arguments), with autograd
    where a gradient can flow."""
    if torch.jit.is_tracing() or torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (*weights, *sample_weights)):
        return _pooled_tables(specs, *weights, *sample_weights)
    return pool(table_batches(specs, weights, sample_weights))


def table_batches(specs, weights, sample_weights):
    return [bag_ops.BagBatch(w, ids, offsets, last, psw, padding_idx, mean, table=table)
            for w, psw, (ids, offsets, last, padding_idx, mean, _, _, table) in zip(weights, sample_weights, specs)]


def pool(batches):
    """bag_ops.pool, with torch's error for offsets the core refuses."""
    try:
        return bag_ops.pool(batches)
    except ValueError:
        bag_input.check_offsets(batches)
        raise


def bag_gradient(batch, grad_out, needs_weight, needs_weights, scale_grad_by_freq, sparse, dedup=None, rows=None,
                 inverse=None):
    """(the table's gradient or None, per_sample_weights' gradient or None)
    of one batch of bags, or None for the table's when a fused optimizer
    took it (the update runs when the backward pass ends). rows / inverse:
    the distinct rows a max_norm forward pooled, and each id's among them."""
    table, ids, padding_idx = batch.table, batch.ids, batch.padding_idx
    grad_out = grad_out.contiguous()
    if grad_out.shape[0] == 0:  # no bags: every position's gradient is 0
        grad_out = grad_out.new_zeros(1, table.dim)
    # The core finds each position's bag and factor for the table's
    # gradient (fused or not) from the batch.
    fused = needs_weight and table.fused and _fused.take_gradient(
        table, _fused.CpuGradient(ids, grad_out, padding_idx, scale_grad_by_freq, dedup, batch))
    weights_grad = None
    if needs_weights:
        bag_of, _ = bag_ops.positions(batch)
        # d out[b] / d w[p] = <grad_out[b], row of ids[p]>: 0 outside
        # every bag and at padding, as torch gives.
        looked_up = table.tensor.index_select(0, ids) if rows is None else rows.index_select(0, inverse)
        weights_grad = (grad_out.index_select(0, bag_of) * looked_up).sum(1)
        if padding_idx >= 0:
            weights_grad.masked_fill_(ids == padding_idx, 0)
        if batch.num_bags == 0:  # every position is in no bag
            weights_grad.zero_()
    grad = None
    if needs_weight and not fused:
        # Summed per id here, unlike an Embedding's gradient (cpu_ops.
        # leaves_positions): a row a position would be each bag's gradient
        # row copied out per position, which the reduce reads in place.
        indices, values = cpu_ops.reduce_rows(ids, grad_out, table.num_rows, padding_idx, scale_grad_by_freq, dedup,
                                              batch, rounded=True)
        grad = common_ops.weight_grad(indices, values, table.num_rows, table.dim, sparse, table.dtype)
    return grad, weights_grad


class PooledRows(torch.autograd.Function):
    """Bags pooled by the core from `rows`, a batch's distinct rows (as a
    row cache hands them), the ids given as their indices among them
    (`inverse`): the bits of pooling from the whole table, forward and
    backward, since the core sums each id's positions in position order
    and the renumbering keeps both. apply(rows, per_sample_weights,
    inverse, offsets, (mode, include_last_offset, padding_idx among the
    rows or -1, scale_grad_by_freq)); the rows' gradient is dense."""

    @staticmethod
    def forward(ctx, rows, per_sample_weights, inverse, offsets, options):
        mode, include_last_offset, padding, scale_grad_by_freq = options
        # The core pools from a table it owns: the rows, copied into one.
        table = HostTable(rows.shape[0], rows.shape[1], dtype=rows.dtype, first_touch=False)
        table.tensor.copy_(rows)
        batch = bag_ops.BagBatch(table.tensor, inverse, offsets, include_last_offset, per_sample_weights, padding,
                                 mode == "mean")
        (out,) = pool([batch])
        ctx.batch, ctx.table, ctx.scale_grad_by_freq = batch, table, scale_grad_by_freq
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad, weights_grad = bag_gradient(ctx.batch, grad_out, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                          ctx.scale_grad_by_freq, False)
        return grad, weights_grad, None, None, None


def padding_row(unique, padding_idx):
    """Where padding_idx (-1: none) is among the sorted unique ids, or None."""
    if padding_idx < 0 or unique.numel() == 0:
        return None
    at = int(torch.searchsorted(unique, padding_idx))
    return at if at < unique.numel() and int(unique[at]) == padding_idx else None
