"""The lookup of a table with a row cache (Embedding(cache_rows=N)): the
batch's unique rows are planned (_cache.RowCache), read from their slots
or, where they bypass the cache, from host memory, and expanded to the
ids' positions; backward is the uncached one (the gradient's rows summed
per unique id), and the optimizers' updates go through the cache
(_ops.sparse_update).

Look-ahead: prefetch(ids) plans the next batch a step early, while this
one's update is still to come; its fetches that must see that update (rows
it changes in host memory) are done by the lookup of those ids. A lookup
of other ids first completes the planned batch, then plans its own.

Eager only (a graph break under torch.compile): planning changes the
cache on every call, which a traced graph cannot express."""
from typing import NamedTuple

import torch

from . import _ops
from ._ids import prepare_ids


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
    ids = prepare_ids(ids).clone()  # the caller may refill its tensor before the lookup
    dedup, unique, inverse = _ops.dedup_ids(ids, table.num_rows)
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
    if planned is not None and planned.ids.shape == ids.shape and torch.equal(planned.ids, ids):
        table.prefetch_outcome = "taken: planned ahead"
        return planned.dedup, planned.unique, planned.inverse, planned.plan
    dedup, unique, inverse = _ops.dedup_ids(ids, table.num_rows)
    with table.lock:
        plan = table.cache.plan(unique)
        table.cache.finish(plan)
    return dedup, unique, inverse, plan


class _CachedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, table, device):
        dedup, unique, inverse, plan = _batch(table, ids)
        with table.lock:
            rows = table.cache.rows(plan, unique)
        out = rows[inverse].view(*ids.shape, table.dim)
        ctx.dedup, ctx.table = dedup, table
        _ops._lookup_setup(ctx, (weight, ids, padding_idx, None, None, scale_grad_by_freq, sparse), out)
        return out if device.type == "cpu" else out.to(device)

    @staticmethod
    def backward(ctx, grad_out):
        return _ops._lookup_backward(ctx, grad_out)[:5] + (None, None)


@torch.compiler.disable
def lookup(module, ids):
    """module.weight[ids] through the module's table's row cache."""
    if module.max_norm is not None:
        raise RuntimeError(f"{module._get_name()}: max_norm renorms rows in host memory at each lookup, which a "
                           "row cache cannot do; set max_norm=None or build the module without cache_rows")
    table = module._table
    ids = prepare_ids(ids)
    padding = -1 if module.padding_idx is None else module.padding_idx
    return _CachedLookup.apply(module._parameters["weight"], ids, padding, module.scale_grad_by_freq, module.sparse,
                               table, module.output_device)
