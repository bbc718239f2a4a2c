"""The CPU ops of a lookup: out = weight[ids] gathered by the core's
threads (or, for a small call, torch's embedding op on the table's weight),
and its backward: a float table's row-sparse gradient a row a position, as
torch's, otherwise the output gradient's rows summed per unique id; the
dedup (unique ids, inverse) EmbeddingBag reads rows by."""
from typing import Optional

import torch
from torch import Tensor

from .. import _C
from .. import fused as _fused
from . import compiled_grad as _compiled_grad
from ..table import DTYPE_CODES, compute_dtype, host_table_of, table_by_handle
from .common import address, applier, cpu_ids_args, custom_op, float_rows, functorch_active, scratch, weight_grad


def unique_ids(ids: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(unique, inverse) of CPU ids, both int64: what
    torch.unique(ids.flatten(), return_inverse=True) gives, from the core's
    radix sort (about 2.5x faster than torch's here). IndexError for an id
    outside [0, num_rows), before anything is returned."""
    return dedup_ids(ids, num_rows)[1:]


def dedup_ids(ids: Tensor, num_rows: int):
    """(the ids' Dedup, unique, inverse): unique_ids, keeping the sort for
    the gradient's reduce."""
    ids = ids.reshape(-1).contiguous()
    dedup = _C.Dedup(**cpu_ids_args(ids), num_rows=num_rows)
    unique = torch.empty(dedup.num_unique, dtype=torch.int64)
    inverse = torch.empty(ids.numel(), dtype=torch.int64)
    dedup.export(unique=address(unique), inverse=address(inverse))
    return dedup, unique, inverse


def rows_at(tensor: Tensor, index: Tensor) -> Tensor:
    """tensor[index] (CPU, along dim 0) in scratch memory: a per-step copy
    of megabytes in a fresh tensor faults its pages in every step (65,536
    rows of 128 floats: 22 ms as tensor[index], 2.4 in scratch, on the
    2-vCPU VM). The same values."""
    out = scratch(index.numel(), *tensor.shape[1:], dtype=tensor.dtype)
    return torch.index_select(tensor, 0, index, out=out)


@custom_op("hostembed::lookup", mutates_args=())
def lookup(weight: Tensor, ids: Tensor, padding_idx: int, max_norm: Optional[float], norm_type: float,
           scale_grad_by_freq: bool, sparse: bool, grad_handle: int = -1) -> Tensor:
    """weight[ids] by the core's threads, on the CPU.

    grad_handle (traced code): the table's HostTable.handle, where its
    row-sparse gradient goes through compiled_grad.take_grad.

    With max_norm the referenced rows are first renormed in place, outside
    autograd, as torch's embedding does. The op does not declare that write:
    declared, torch.compile would copy the whole table to functionalise it.
    padding_idx (-1: none), scale_grad_by_freq and sparse shape backward.
    """
    return lookup_rows(weight, ids, max_norm, norm_type)[0]


def lookup_rows(weight, ids, max_norm, norm_type):
    """(weight[ids], the ids' Dedup when max_norm sorted them, else None,
    the table)."""
    table = host_table_of(weight, "a lookup")
    prefetch, table.prefetch = table.prefetch, None
    if prefetch is not None and max_norm is None:
        out = prefetch.take(weight, ids)
        if out is not None:
            return out, None, table
    ids_args = cpu_ids_args(ids)
    # The table's own buffer: host_table_of checked that weight is exactly it.
    rows = {"table": table.buffer, "num_rows": table.num_rows, "dim": table.dim, "dtype": table.code}
    out = scratch(*ids.shape, table.dim, dtype=table.dtype)
    dedup = None
    if max_norm is not None:
        dedup = _C.Dedup(**ids_args, num_rows=table.num_rows)  # sorts; reads no rows
    with table.lock:
        table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
        if dedup is not None:
            _C.renorm(**rows, dedup=dedup, max_norm=float(max_norm), norm_type=float(norm_type))
            table.rows_changed(ids)
        _C.gather(**rows, **ids_args, out=address(out))
    return out, dedup, table


def checked_table(weight, ids, what):
    """The HostTable of weight (host_table_of), after the core's range check
    of CPU ids: IndexError naming the first id outside the table, as a
    lookup gives."""
    table = host_table_of(weight, what)
    _C.check_ids(**cpu_ids_args(ids), num_rows=table.num_rows)
    return table


def gather_later(weight, ids):
    """(out, gather): gather() fills out with weight[ids] (no autograd, no
    max_norm). Embedding.prefetch runs gather on another thread; all the
    Python work is done here, so that thread holds the GIL only to enter
    the core."""
    table = host_table_of(weight, "a prefetch")
    out = scratch(*ids.shape, table.dim, dtype=table.dtype)
    args = dict(table=table.buffer, num_rows=table.num_rows, dim=table.dim, dtype=table.code, **cpu_ids_args(ids),
                out=address(out))

    def gather():
        with table.lock:
            table.wait_for_gpu_use()
            _C.gather(**args)
    return out, gather


@lookup.op.register_fake
def _(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, grad_handle=-1):
    return weight.new_empty(*ids.shape, weight.shape[1])


@custom_op("hostembed::grad_reduce", mutates_args=())
def grad_reduce(ids: Tensor, grad: Tensor, num_rows: int, padding_idx: int,
                scale_grad_by_freq: bool) -> tuple[Tensor, Tensor]:
    """Sums grad's rows per unique id on the CPU: (indices int64 [k]
    ascending, values [k, D], float64 for a float64 grad, else float32),
    padding_idx (-1: none) left out.
    Deterministic for any thread count; an id outside [0, num_rows) raises
    IndexError before anything is written."""
    return reduce_rows(ids, grad, num_rows, padding_idx, scale_grad_by_freq)


def reduce_rows(ids, grad, num_rows, padding_idx, scale_grad_by_freq, dedup=None, bags=None, rounded=False):
    """grad_reduce, reusing the forward's Dedup of the same ids if given;
    with bags (the lookup's _core.ops.bags.BagBatch, whose ids these are),
    grad has a row per bag, and the core finds each position's bag and
    factor. rounded: the values of a half grad come in its dtype (rounded
    by the core, as weight_grad would round them)."""
    dim = grad.shape[-1]
    ids = ids.reshape(-1).contiguous()
    dtype = compute_dtype(grad.dtype)  # a float64 table's gradient is float64
    # The core widens a half gradient's rows itself.
    rows, args = gradient_rows(grad, ids, dim, bags, grad.dtype if grad.dtype in DTYPE_CODES else dtype)
    if dedup is None:
        dedup = _C.Dedup(**cpu_ids_args(ids), num_rows=num_rows)
    rounded = rounded and rows.dtype != dtype
    indices = torch.empty(dedup.num_unique, dtype=torch.int64)
    values = scratch(dedup.num_unique, dim, dtype=rows.dtype if rounded else dtype)
    written = _C.grad_reduce(dedup=dedup, grad=address(rows), dim=dim, padding_idx=padding_idx,
                             scale_grad_by_freq=scale_grad_by_freq, values=address(values),
                             indices=address(indices), dtype=DTYPE_CODES[rows.dtype], round_sums=rounded, **args)
    if written == dedup.num_unique:
        return indices, values
    return indices[:written].clone(), values[:written].clone()


def gradient_rows(grad, ids, dim, bags, dtype):
    """(grad as contiguous rows of dtype, the core's arguments saying where
    each id's row is): a row per id, or with bags (a BagBatch) a row per
    bag, in the bags' table's dtype, each position's bag and factor made by
    the core from the batch."""
    if bags is None:
        return (float_rows(grad, ids.numel(), dim, "cpu", dtype),
                {"bag_of": 0, "row_weights": 0, "num_bags": 0, "bags": None})
    rows = grad.to(device="cpu", dtype=bags.table.dtype).contiguous().reshape(-1, dim)
    return rows, {"bag_of": 0, "row_weights": 0, "num_bags": rows.shape[0], "bags": bags.args + (0,)}


@grad_reduce.op.register_fake
def _(ids, grad, num_rows, padding_idx, scale_grad_by_freq):
    unique = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty(unique, dtype=torch.int64, device="cpu"),
            torch.empty(unique, grad.shape[-1], dtype=compute_dtype(grad.dtype), device="cpu"))


@custom_op("hostembed::take_grad", mutates_args=())
def take_grad(ids: Tensor, grad: Tensor, handle: int, padding_idx: int, scale_grad_by_freq: bool) -> None:
    """A compiled lookup's backward (compiled_grad): grad's rows summed per
    id, as grad_reduce, for the table `handle`; the sums go to its weight's
    .grad when the backward pass ends."""
    table = table_by_handle(handle, "a compiled lookup's backward")
    indices, values = reduce_rows(ids, grad, table.num_rows, padding_idx, scale_grad_by_freq, rounded=True)
    _compiled_grad.keep(handle, indices, values)


@take_grad.op.register_fake
def _(ids, grad, handle, padding_idx, scale_grad_by_freq):
    return None


# Whether compiled lookups give their table's gradient through take_grad.
COMPILED_GRAD = _compiled_grad.register_effect(take_grad.op)


# The tables whose row-sparse gradient backward leaves a row a position,
# as torch's embedding backward does: the optimizers sum repeated rows in
# their own sort (hostembed's in the update's pass, with no sums written
# out), so a sort here would be paid twice. A half table's gradient is
# summed here, in float32, and rounded once; a distributed table's is
# summed before it is exchanged.
POSITION_GRAD_DTYPES = (torch.float32, torch.float64)


def leaves_positions(table, scale_grad_by_freq):
    """Whether a lookup's row-sparse gradient of `table` keeps a row a
    position (position_rows) rather than a sum a distinct id."""
    return not scale_grad_by_freq and not table.sharded and table.dtype in POSITION_GRAD_DTYPES


def position_rows(ids, grad_out, dim, padding_idx):
    """(indices int64 [n], values [n, dim]): each position's id and
    gradient row, padding_idx's positions left out, as torch's sparse
    embedding backward gives them."""
    indices = ids.reshape(-1).to(torch.int64)
    values = grad_out.reshape(-1, dim).contiguous()
    if padding_idx >= 0:
        keep = indices != padding_idx
        indices, values = indices[keep], values[keep]
    return indices, values


def lookup_setup(ctx, inputs, output):
    weight, ids, padding_idx, _, _, scale_grad_by_freq, sparse = inputs[:7]
    ctx.grad_handle = inputs[7] if len(inputs) > 7 else -1
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(ids)
    ctx.table_shape = tuple(weight.shape)
    ctx.table_dtype = weight.dtype
    ctx.spec = (padding_idx, scale_grad_by_freq, sparse)


def lookup_backward(ctx, grad_out):
    (ids,) = ctx.saved_tensors
    num_rows, dim = ctx.table_shape
    padding_idx, scale_grad_by_freq, sparse = ctx.spec
    grad = None
    rest = (None,) * (ctx.num_inputs - 1)
    if ctx.needs_input_grad[0] and sparse and ctx.grad_handle >= 0 and torch.compiler.is_compiling():
        # No sparse gradient out of a compiled graph: it goes to .grad when
        # the backward pass ends (compiled_grad).
        take_grad.op(ids, grad_out, ctx.grad_handle, padding_idx, scale_grad_by_freq)
        return (None,) + rest
    if ctx.needs_input_grad[0]:
        dedup = getattr(ctx, "dedup", None)
        table = getattr(ctx, "table", None)  # eager only: fused tables are looked up eagerly
        if table is not None and table.fused and _fused.take_gradient(
                table, _fused.CpuGradient(ids, grad_out, padding_idx, scale_grad_by_freq, dedup)):
            return (None,) + rest  # applied when the backward pass ends; no weight.grad
        if torch.compiler.is_compiling():
            indices, values = grad_reduce.op(ids, grad_out, num_rows, padding_idx, scale_grad_by_freq)
        elif sparse and table is not None and leaves_positions(table, scale_grad_by_freq):
            indices, values = position_rows(ids, grad_out, dim, padding_idx)
            return (torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, dim), check_invariants=False),) \
                + rest
        else:  # with max_norm, reusing the forward's sort
            indices, values = reduce_rows(ids, grad_out, num_rows, padding_idx, scale_grad_by_freq, dedup,
                                           rounded=True)
        grad = weight_grad(indices, values, num_rows, dim, sparse, ctx.table_dtype)
    return (grad,) + rest


lookup.op.register_autograd(lookup_backward, setup_context=lookup_setup)


class _LookupEager(torch.autograd.Function):
    """The lookup op's eager twin (see custom_op); it keeps a max_norm
    forward's sort of the ids for backward, which then sorts nothing."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
        out, ctx.dedup, ctx.table = lookup_rows(weight, ids, max_norm, norm_type)
        lookup_setup(ctx, (weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse), out)
        return out

    backward = staticmethod(lookup_backward)


_lookup_eager = applier(_LookupEager)


# A call of at most this many ids runs through torch's own embedding op on
# the table's weight (a CPU tensor over the table's memory): torch's C++
# autograd node makes its row-sparse gradient, which hostembed's
# optimizers take as they take the core's (they sum repeated rows). Below
# it the core's threads and dedup do not pay for a Python autograd
# Function's fixed cost; above it they do. benchmarks/cpu/per_call.py's
# SparseAdam step (2M x 64, uniform ids, 2 threads, 2026-11-26): torch's
# op ahead at 2,048 ids (348 us against 405), the two within 11% at 8,192
# and level at 16,384 and 65,536 (README, One lookup call).
TORCH_OP_MAX_IDS = 8192


def torch_op_serves(count: int, limit: int, max_norm, grad: bool, scale_grad_by_freq: bool, sparse: bool) -> bool:
    """Whether a lookup of `count` ids may run through torch's own op (the
    table and the module permitting): at most `limit` ids, no max_norm (the
    core renorms), not traced, and with a gradient a sparse one not scaled
    by frequency (torch's sparse backward has no correct
    scale_grad_by_freq, pytorch/pytorch#190063, and its dense one sums in
    another order than the core)."""
    return count <= limit and max_norm is None and not (grad and (scale_grad_by_freq or not sparse)) \
        and not torch.jit.is_tracing()


def torch_op_lookup(weight, ids, padding_idx, sparse, table=None):
    """weight[ids] by torch's embedding op, or None where the core's lookup
    must run: the table not float32 (the core sums a half table's gradient
    in float32), a prefetch waiting for this call, a distributed table, a
    functorch transform (the core's Function refuses it in torch's words,
    whatever the call's size). table: weight's HostTable, when the caller
    has just checked that weight is exactly its rows; ids contiguous."""
    if table is None:
        table = host_table_of(weight, "a lookup")
    if table.dtype != torch.float32 or table.prefetch is not None or table.sharded or functorch_active():
        return None
    if not ids.is_cpu:
        cpu_ids_args(ids)  # its error
    # hostembed's IndexError, before any read (the ids contiguous int64 or
    # int32, as the callers made them; not cpu_ids_args, whose checks they
    # did and whose dict costs a tenth of a small call).
    _C.check_ids(ids=ids.data_ptr(), count=ids.numel(), ids_int64=ids.dtype == torch.int64,
                 num_rows=table.num_rows)
    with table.lock:  # no update of the rows from another thread meanwhile
        if table.last_gpu_use is not None:
            table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
        return torch.nn.functional.embedding(ids, weight, None if padding_idx < 0 else padding_idx, sparse=sparse)


def embedding_lookup(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, grad_handle=-1):
    """weight[ids] on the CPU, differentiable (see lookup); a small call
    through torch's own op (TORCH_OP_MAX_IDS), with the same output and
    gradient. grad_handle: see lookup (traced code only)."""
    args = (weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if torch.compiler.is_compiling():
        return lookup.op(*args, grad_handle if COMPILED_GRAD else -1)
    grad = weight.requires_grad and torch.is_grad_enabled()
    if torch_op_serves(ids.numel(), TORCH_OP_MAX_IDS, max_norm, grad, scale_grad_by_freq, sparse):
        out = torch_op_lookup(weight, ids, padding_idx, sparse)
        if out is not None:
            return out
    if not grad and not torch.jit.is_tracing():
        # Nothing to record: the autograd Function's own cost (about 15 us
        # a call) would be most of a small lookup's.
        return lookup_rows(weight, ids, max_norm, norm_type)[0]
    return _lookup_eager(*args)


@torch.compiler.disable
def fused_embedding_lookup(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
    """embedding_lookup of a fused table: always eager (a graph break under
    torch.compile), since its backward queues the update with autograd's
    engine (_core/fused.py), which a compiled backward cannot do."""
    return _lookup_eager(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
