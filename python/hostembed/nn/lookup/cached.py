"""The lookup of a table with a row cache (Embedding(cache_rows=N)): the
batch's unique rows are planned, read from their slots or, where they
bypass the cache, from host memory, and expanded to the ids' positions;
backward is the uncached one (the gradient's rows summed per unique id),
and the optimizers' updates go through the cache
(_core.ops.update.sparse_update).

A cache in GPU memory (_cache.GpuRowCache) plans on the GPU: the ids'
dedup there is the only wait of the host, and prefetch(ids) does it (and
the plan, and the moves) for the next batch while this step still runs,
so that the lookup of those ids waits for nothing.

A cache of host records (_cache.RowCache) plans on the CPU. Look-ahead:
prefetch(ids) plans the next batch a step early, while this one's update
is still to come; its fetches that must see that update (rows it changes
in host memory) are done by the lookup of those ids. A lookup of other
ids first completes the planned batch, then plans its own.

Eager only (a graph break under torch.compile): planning changes the
cache on every call, which a traced graph cannot express."""
from typing import NamedTuple

import torch

from ..._cache.gpu_cache import GpuRowCache
from ..._core import fused as _fused
from ..._core.ids import check_ids, prepare_ids
from ..._core.ops import common as common_ops, cpu as cpu_ops, gpu as gpu_ops


class _Planned(NamedTuple):
    ids: torch.Tensor
    dedup: object
    unique: torch.Tensor
    inverse: torch.Tensor
    plan: object


class _PlannedOnDevice(NamedTuple):
    ids: torch.Tensor       # as given, and a copy: a lookup of the same ids takes the plan
    version: int
    copy: torch.Tensor
    padding_idx: int
    dedup: tuple            # gpu_ops.gpu_dedup's
    plan: object            # the cache's CachePlanOnDevice


def plan_ahead(table, ids, padding_idx=-1) -> None:
    """Embedding.prefetch for a cached table: the batch of `ids` planned,
    its fetches started (on the CPU planner: those waiting for this step's
    update excepted)."""
    finish_planned(table)
    cache = table.cache
    if isinstance(cache, GpuRowCache):
        check_ids(ids)
        with torch.cuda.device(cache.device):
            dedup, plan = _dedup_and_plan(table, ids, cache.device, padding_idx)
        table.planned = _PlannedOnDevice(ids, ids._version, ids.detach().clone(), padding_idx, dedup, plan)
        return
    ids = prepare_ids(ids).clone()  # the caller may refill its tensor before the lookup
    dedup, unique, inverse = cpu_ops.dedup_ids(ids, table.num_rows)
    with table.lock:
        table.planned = _Planned(ids, dedup, unique, inverse, cache.plan(unique))


def _dedup_and_plan(table, ids, device, padding_idx):
    """(gpu_dedup's outputs, the plan) of the batch of ids through a GPU
    cache: the dedup waits for the device once (the unique count sizes
    the batch; a bad id raises IndexError here, before anything is
    planned), the plan and its moves are queued on the stream."""
    cache = table.cache
    dedup = gpu_ops.gpu_dedup(table, ids, device, padding_idx)
    cache.host_waits += 1
    unique, (num_unique, _) = dedup[1], dedup[5]
    with table.lock:
        plan = cache.plan_batch(unique, num_unique)
    return dedup, plan


def _device_batch(table, ids, device, padding_idx):
    """The planned batch if it is these ids, else a new one."""
    planned, table.planned = table.planned, None
    if isinstance(planned, _PlannedOnDevice) and planned.padding_idx == padding_idx \
            and planned.ids.shape == ids.shape and planned.ids.dtype == ids.dtype:
        if planned.ids is ids and ids._version == planned.version and ids.device.type != "cpu":
            same = True  # comparing GPU ids would wait for the device
        else:
            if ids.device.type != "cpu" or planned.copy.device.type != "cpu":
                table.cache.host_waits += 1
            same = torch.equal(planned.copy, ids.to(planned.copy.device))
        if same:
            table.prefetch_outcome = "taken: planned ahead"
            return planned.dedup, planned.plan
    return _dedup_and_plan(table, ids, device, padding_idx)


def finish_planned(table):
    """The batch planned ahead, its waiting fetches done, or None."""
    planned, table.planned = table.planned, None
    if isinstance(planned, _Planned):
        with table.lock:
            table.cache.finish(planned.plan)
        return planned
    return None


def _batch(table, ids):
    """(dedup, unique, inverse, plan) of the lookup of `ids`: the batch
    planned ahead if it is these ids, else planned now."""
    planned = finish_planned(table)
    # A plan made for GPU records has no ids (plan_ahead): records moved to
    # host memory since then leave it untaken.
    if planned is not None and planned.ids is not None and planned.ids.shape == ids.shape \
            and torch.equal(planned.ids, ids):
        table.prefetch_outcome = "taken: planned ahead"
        return planned.dedup, planned.unique, planned.inverse, planned.plan
    dedup, unique, inverse = cpu_ops.dedup_ids(ids, table.num_rows)
    return dedup, unique, inverse, _plan_now(table, unique)


def _plan_now(table, unique):
    with table.lock:
        plan = table.cache.plan(unique)
        table.cache.finish(plan)
    return plan


class _CachedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, table, device):
        dedup, unique, inverse, plan = _batch(table, ids)
        with table.lock:
            rows = table.cache.rows(plan, unique)
        if device.type == "cpu":
            out = cpu_ops.rows_at(rows, inverse).view(*ids.shape, table.dim)
        else:
            # Expanded straight into pinned memory, then one asynchronous
            # copy (torch's pinned allocator keeps the block until it is done).
            staged = torch.empty((inverse.numel(), table.dim), dtype=rows.dtype, pin_memory=True)
            torch.index_select(rows, 0, inverse, out=staged)
            out = staged.view(*ids.shape, table.dim).to(device, non_blocking=True)
        ctx.dedup, ctx.table = dedup, table
        cpu_ops.lookup_setup(ctx, (weight, ids, padding_idx, None, None, scale_grad_by_freq, sparse), out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        table = ctx.table
        if grad_out.is_cuda and table.kernels_read_it:
            # Summed on the GPU as the uncached GPU path sums them (hot rows
            # in chunks, which round differently from the core's straight
            # sums): the cache then keeps the uncached table's bits.
            (ids,) = ctx.saved_tensors
            padding_idx, scale_grad_by_freq, sparse = ctx.spec
            grad = gpu_ops.gradient_of_ids(table, grad_out, ids, padding_idx, scale_grad_by_freq, sparse) \
                if ctx.needs_input_grad[0] else None
            return (grad,) + (None,) * 6
        # Outputs copied to a GPU from rows the core read: the uncached
        # table sums their gradient on the CPU too.
        return cpu_ops.lookup_backward(ctx, grad_out.cpu())[:5] + (None, None)


class _CachedGpuLookup(torch.autograd.Function):
    """A lookup with GPU outputs through a cache in GPU memory: the ids'
    dedup and the gradient's sums run on the GPU (the uncached GPU path's
    kernels, the same bits), the batch is planned there, hits are read from
    the records and the rows that bypass the cache over the mapping."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, table, device):
        cache = table.cache
        with torch.cuda.device(device):
            dedup, plan = _device_batch(table, ids, device, padding_idx)
            count, unique, offsets, order, inverse, (num_unique, padding_slot) = dedup
            with table.lock:
                rows = cache.gather(plan, unique, num_unique)
            out = torch.empty(*ids.shape, table.dim, dtype=torch.float32, device=device)
            torch.index_select(rows, 0, inverse, out=out.view(count, table.dim))
        info = torch.tensor([num_unique, padding_slot], dtype=torch.int64)
        ctx.save_for_backward(unique, offsets, order, inverse, info)
        ctx.table, ctx.spec = table, (scale_grad_by_freq, sparse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        unique, offsets, order, inverse, info = ctx.saved_tensors
        scale_grad_by_freq, sparse = ctx.spec
        table = ctx.table
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        if table.fused and _fused.optimizer_of(table) is not None:
            indices, values = gpu_ops.gpu_reduce(table, grad_out, unique, offsets, order, inverse, info,
                                              scale_grad_by_freq)
            _note_distinct(table, indices)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(values.device))
            if _fused.take_gradient(table, _fused.GpuGradient(indices, values, ready)):
                return (None,) * 7
        # weight.grad on the CPU, as autograd requires; the sums' GPU copy
        # is kept for the update of the records (_core/ops/gpu.py's GradTwin).
        table.twin_wanted = True
        indices, values = gpu_ops.gpu_grad_reduce(table.handle, grad_out, unique, offsets, order, inverse, info,
                                               scale_grad_by_freq)
        if table.grad_twin is not None:
            _note_distinct(table, table.grad_twin.indices)
        grad = common_ops.weight_grad(indices, values, table.num_rows, table.dim, sparse)
        return grad, None, None, None, None, None, None


def _note_distinct(table, indices):
    if isinstance(table.cache, GpuRowCache):
        table.cache.note_distinct(indices)


@torch.compiler.disable
def lookup(module, ids, scale_grad_by_freq=None, device=None):
    """module.weight[ids] through the module's table's row cache, with the
    module's options (scale_grad_by_freq overrides its own; device, the
    output's, for a cache of host records)."""
    if module.max_norm is not None:
        raise RuntimeError(f"{module._get_name()}: max_norm renorms rows in host memory at each lookup, which a "
                           "row cache cannot do; set max_norm=None or build the module without cache_rows")
    table = module._table
    padding = -1 if module.padding_idx is None else module.padding_idx
    if scale_grad_by_freq is None:
        scale_grad_by_freq = module.scale_grad_by_freq
    if isinstance(table.cache, GpuRowCache):
        check_ids(ids)
        return _CachedGpuLookup.apply(module._parameters["weight"], ids, padding, scale_grad_by_freq,
                                      module._sparse_gradient(), table, table.cache.device)
    ids = prepare_ids(ids)
    return _CachedLookup.apply(module._parameters["weight"], ids, padding, scale_grad_by_freq,
                               module._sparse_gradient(), table, module.output_device if device is None else device)
