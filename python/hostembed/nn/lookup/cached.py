"""The lookup of a table with a row cache (Embedding(cache_rows=N)): the
batch's unique rows are planned (_cache.RowCache), read from their slots
or, where they bypass the cache, from host memory, and expanded to the
ids' positions; backward is the uncached one (the gradient's rows summed
per unique id), and the optimizers' updates go through the cache
(_core.ops.update.sparse_update).

Look-ahead: prefetch(ids) plans the next batch a step early, while this
one's update is still to come; its fetches that must see that update (rows
it changes in host memory) are done by the lookup of those ids. A lookup
of other ids first completes the planned batch, then plans its own.

Eager only (a graph break under torch.compile): planning changes the
cache on every call, which a traced graph cannot express."""
from typing import NamedTuple

import torch

from ..._core import fused as _fused
from ..._core.ids import check_ids, prepare_ids
from ..._core.ops import common as common_ops, cpu as cpu_ops, gpu as gpu_ops


class _Planned(NamedTuple):
    ids: torch.Tensor
    dedup: object
    unique: torch.Tensor
    inverse: torch.Tensor
    plan: object


def plan_ahead(table, ids) -> None:
    """Embedding.prefetch for a cached table: the batch of `ids` planned,
    its fetches started (those waiting for this step's update excepted)."""
    finish_planned(table)
    cache = table.cache
    if cache.device.type == "cuda":
        # The lookup dedups on the GPU and takes a plan made for the same
        # distinct rows (_gpu_plan): only those are needed, found on the
        # GPU too rather than by a dedup of the whole batch on the CPU. An
        # id outside the table raises IndexError in the planner.
        check_ids(ids)
        unique = torch.unique(ids.to(cache.device)).to("cpu", torch.int64)
        with table.lock:
            table.planned = _Planned(None, None, unique, None, cache.plan(unique))
        return
    ids = prepare_ids(ids).clone()  # the caller may refill its tensor before the lookup
    dedup, unique, inverse = cpu_ops.dedup_ids(ids, table.num_rows)
    with table.lock:
        table.planned = _Planned(ids, dedup, unique, inverse, cache.plan(unique))


def finish_planned(table):
    """The batch planned ahead, its waiting fetches done, or None."""
    planned, table.planned = table.planned, None
    if planned is not None:
        with table.lock:
            table.cache.finish(planned.plan)
    return planned


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


def _gpu_plan(table, unique):
    """The plan of a GPU lookup whose distinct rows are `unique` (CPU): the
    one made ahead for the same rows, else a new one."""
    planned = finish_planned(table)
    if planned is not None and torch.equal(planned.unique, unique):
        table.prefetch_outcome = "taken: planned ahead"
        return planned.plan
    return _plan_now(table, unique)


class _CachedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, table, device):
        dedup, unique, inverse, plan = _batch(table, ids)
        with table.lock:
            rows = table.cache.rows(plan, unique)
        out = rows[inverse].view(*ids.shape, table.dim)
        ctx.dedup, ctx.table = dedup, table
        cpu_ops.lookup_setup(ctx, (weight, ids, padding_idx, None, None, scale_grad_by_freq, sparse), out)
        return out if device.type == "cpu" else out.to(device)

    @staticmethod
    def backward(ctx, grad_out):
        return cpu_ops.lookup_backward(ctx, grad_out)[:5] + (None, None)


class _CachedGpuLookup(torch.autograd.Function):
    """A lookup with GPU outputs through a cache whose records are in GPU
    memory: the ids' dedup and the gradient's sums run on the GPU (the
    uncached GPU path's kernels, the same bits), only the distinct rows go
    to the planner on the CPU, hits are read from the records, and the
    rows that bypass the cache come from host memory."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, table, device):
        cache = table.cache
        with torch.cuda.device(device):
            count, unique, offsets, order, inverse, (num_unique, padding_slot) = gpu_ops.gpu_dedup(
                table, ids, device, padding_idx)
            unique_host = unique[:num_unique].cpu()
            plan = _gpu_plan(table, unique_host)
            with table.lock:
                rows = cache.rows(plan, unique_host)
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
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(values.device))
            if _fused.take_gradient(table, _fused.GpuGradient(indices, values, ready)):
                return (None,) * 7
        # weight.grad on the CPU, as autograd requires; the sums' GPU copy
        # is kept for the update of the records (_core/ops/gpu.py's GradTwin).
        table.twin_wanted = True
        indices, values = gpu_ops.gpu_grad_reduce(table.handle, grad_out, unique, offsets, order, inverse, info,
                                               scale_grad_by_freq)
        grad = common_ops.weight_grad(indices, values, table.num_rows, table.dim, sparse)
        return grad, None, None, None, None, None, None


@torch.compiler.disable
def lookup(module, ids):
    """module.weight[ids] through the module's table's row cache."""
    if module.max_norm is not None:
        raise RuntimeError(f"{module._get_name()}: max_norm renorms rows in host memory at each lookup, which a "
                           "row cache cannot do; set max_norm=None or build the module without cache_rows")
    table = module._table
    padding = -1 if module.padding_idx is None else module.padding_idx
    if table.cache.device.type == "cuda":
        check_ids(ids)
        return _CachedGpuLookup.apply(module._parameters["weight"], ids, padding, module.scale_grad_by_freq,
                                      module._sparse_gradient(), table, table.cache.device)
    ids = prepare_ids(ids)
    return _CachedLookup.apply(module._parameters["weight"], ids, padding, module.scale_grad_by_freq,
                               module._sparse_gradient(), table, module.output_device)
