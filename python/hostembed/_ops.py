"""The boundary between Python and the C core: hostembed's custom ops.

This is the only Python code that calls the extension (_C), and the one
place where tensors become addresses. Every op checks what it is handed
(dtype, device, layout, and that a table tensor is exactly the rows of a
live host table of this process, never a view of something else) before
calling the core, whose functions take named arguments only. The table and
its optimizer state go to the core as their HostBuffer objects (never as
addresses), so the core checks every shape against the memory it is given;
ids, gradients and outputs go as addresses of tensors held for the call.

Each op that reads or writes a table's rows or state holds the table's lock
(HostTable.lock) around that work: ops from several Python threads on one
table run one after another, each whole (the core releases the GIL).

The steps that touch a table are torch.library custom ops (namespace
``hostembed``) with fake implementations and registered autograd, so
torch.compile traces a lookup and its backward without breaking the graph.
What has to happen at run time (ordering against GPU work, the fork check,
keeping the gradient on the GPU for the update) happens inside the ops,
never in traced Python.

Adding an op: the core function in csrc/ (or a launcher in cuda/), its
keyword-only binding in binding/, then a custom op here that validates,
takes addresses with _address() and calls it. Modules and optimizers call
the ops, never _C.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _C, _fused
from ._ids import ID_DTYPES
from ._table import DTYPE_CODES, compute_dtype, dtype_name, host_table_of, table_by_handle

CUDA_COMPILED = bool(getattr(_C, "CUDA_COMPILED", False))

HostBuffer = _C.HostBuffer
set_num_threads = _C.set_num_threads
get_num_threads = _C.get_num_threads
empty_cache = _C.empty_cache


def _custom_op(name, mutates_args=()):
    """Registers fn as the torch.library custom op `name` and returns fn
    itself with the op as fn.op. Traced code (torch.compile) calls the op;
    eager code calls fn directly, skipping the dispatcher's Python layers
    (about 50 us a call, measured: a tenth of a small training step)."""
    def wrap(fn):
        fn.op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        return fn
    return wrap


def _eager_autograd(fn, setup_context, backward):
    """An autograd.Function running fn, then the op's own setup_context,
    with a backward calling the plain functions: the eager twin of the op.
    (The classic forward(ctx, ...) form: a separate setup_context makes
    autograd bind the arguments with inspect on every call.)"""
    def forward(ctx, *inputs):
        output = fn(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(f"{fn.__name__}_eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _address(tensor: Tensor) -> int:
    return tensor.data_ptr()


def _ids(ids: Tensor) -> dict:
    """The core's view of a batch of ids: contiguous int64/int32."""
    if ids.dtype not in ID_DTYPES or not ids.is_contiguous():
        raise ValueError(f"hostembed: the core takes contiguous int64/int32 ids, got {ids.dtype}"
                         f"{'' if ids.is_contiguous() else ', not contiguous'}")
    return {"ids": _address(ids), "count": ids.numel(), "ids_int64": ids.dtype == torch.int64}


def _cpu_ids(ids: Tensor) -> dict:
    if ids.device.type != "cpu":
        raise ValueError(f"hostembed: the CPU core takes ids on the CPU, got {ids.device}")
    return _ids(ids)


def _float_rows(tensor: Tensor, count: int, dim: int, device, dtype=torch.float32) -> Tensor:
    """tensor's values as a contiguous [count, dim] matrix of dtype on device."""
    return tensor.to(device=device, dtype=dtype).contiguous().reshape(count, dim)


def scratch(*shape: int, dtype=torch.float32) -> Tensor:
    """An uninitialised CPU tensor of dtype from the core's scratch cache.

    For per-step buffers (lookup outputs, gradient values): when the last
    view of it dies, its pages go back to the cache and the next step of the
    same size reuses them instead of page-faulting a fresh mapping.
    """
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _C.HostBuffer(numel * dtype.itemsize, scratch=True)
    # The buffer may be larger (size classes): the prefix, as a tensor of
    # its own rather than a view (autograd refuses in-place changes of a
    # view that a Function returns, as `out += pos` is).
    storage = torch.frombuffer(buf, dtype=dtype, count=numel).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def weight_grad(indices: Tensor, values: Tensor, num_rows: int, dim: int, sparse: bool, dtype=None) -> Tensor:
    """The table's gradient from its reduced rows, in the table's dtype
    (values are rounded to a half table's dtype once, after the sum):
    row-sparse COO (already coalesced: the indices are unique and
    ascending) or dense."""
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    if sparse:
        return torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, dim), is_coalesced=True,
                                       check_invariants=False)
    return torch.zeros(num_rows, dim, dtype=values.dtype, device=values.device).index_copy_(0, indices, values)


# ---- unique ids of a batch (EmbeddingBag looks up each distinct row once)

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
    dedup = _C.Dedup(**_cpu_ids(ids), num_rows=num_rows)
    unique = torch.empty(dedup.num_unique, dtype=torch.int64)
    inverse = torch.empty(ids.numel(), dtype=torch.int64)
    dedup.export(unique=_address(unique), inverse=_address(inverse))
    return dedup, unique, inverse


# ---- CPU lookup: out = weight[ids]; backward sums the rows per unique id

@_custom_op("hostembed::lookup", mutates_args=())
def lookup(weight: Tensor, ids: Tensor, padding_idx: int, max_norm: Optional[float], norm_type: float,
           scale_grad_by_freq: bool, sparse: bool) -> Tensor:
    """weight[ids] by the core's threads, on the CPU.

    With max_norm the referenced rows are first renormed in place, outside
    autograd, as torch's embedding does. The op does not declare that write:
    declared, torch.compile would copy the whole table to functionalise it.
    padding_idx (-1: none), scale_grad_by_freq and sparse shape backward.
    """
    return _lookup_rows(weight, ids, max_norm, norm_type)[0]


def _lookup_rows(weight, ids, max_norm, norm_type):
    """(weight[ids], the ids' Dedup when max_norm sorted them, else None,
    the table)."""
    table = host_table_of(weight, "a lookup")
    prefetch, table.prefetch = table.prefetch, None
    if prefetch is not None and max_norm is None:
        out = prefetch.take(weight, ids)
        if out is not None:
            return out, None, table
    ids_args = _cpu_ids(ids)
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
        _C.gather(**rows, **ids_args, out=_address(out))
    return out, dedup, table


def gather_later(weight, ids):
    """(out, gather): gather() fills out with weight[ids] (no autograd, no
    max_norm). Embedding.prefetch runs gather on another thread; all the
    Python work is done here, so that thread holds the GIL only to enter
    the core."""
    table = host_table_of(weight, "a prefetch")
    out = scratch(*ids.shape, table.dim, dtype=table.dtype)
    args = dict(table=table.buffer, num_rows=table.num_rows, dim=table.dim, dtype=table.code, **_cpu_ids(ids),
                out=_address(out))

    def gather():
        with table.lock:
            table.wait_for_gpu_use()
            _C.gather(**args)
    return out, gather


@lookup.op.register_fake
def _(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
    return weight.new_empty(*ids.shape, weight.shape[1])


@_custom_op("hostembed::grad_reduce", mutates_args=())
def grad_reduce(ids: Tensor, grad: Tensor, num_rows: int, padding_idx: int,
                scale_grad_by_freq: bool) -> tuple[Tensor, Tensor]:
    """Sums grad's rows per unique id on the CPU: (indices int64 [k]
    ascending, values [k, D], float64 for a float64 grad, else float32),
    padding_idx (-1: none) left out.
    Deterministic for any thread count; an id outside [0, num_rows) raises
    IndexError before anything is written."""
    return _reduce_rows(ids, grad, num_rows, padding_idx, scale_grad_by_freq)


def _reduce_rows(ids, grad, num_rows, padding_idx, scale_grad_by_freq, dedup=None, pooling=None, rounded=False):
    """grad_reduce, reusing the forward's Dedup of the same ids if given;
    with pooling (a bag's _fused.Pooling), grad has a row per bag. rounded:
    the values of a half grad come in its dtype (rounded by the core, as
    weight_grad would round them)."""
    dim = grad.shape[-1]
    ids = ids.reshape(-1).contiguous()
    dtype = compute_dtype(grad.dtype)  # a float64 table's gradient is float64
    # The core widens a half gradient's rows itself.
    rows, bags, _weights = _gradient_rows(grad, ids, dim, pooling, grad.dtype if grad.dtype in DTYPE_CODES else dtype)
    if dedup is None:
        dedup = _C.Dedup(**_cpu_ids(ids), num_rows=num_rows)
    rounded = rounded and rows.dtype != dtype
    indices = torch.empty(dedup.num_unique, dtype=torch.int64)
    values = scratch(dedup.num_unique, dim, dtype=rows.dtype if rounded else dtype)
    written = _C.grad_reduce(dedup=dedup, grad=_address(rows), dim=dim, padding_idx=padding_idx,
                             scale_grad_by_freq=scale_grad_by_freq, values=_address(values),
                             indices=_address(indices), dtype=DTYPE_CODES[rows.dtype], round_sums=rounded, **bags)
    if written == dedup.num_unique:
        return indices, values
    return indices[:written].clone(), values[:written].clone()


def _gradient_rows(grad, ids, dim, pooling, dtype):
    """(grad as contiguous rows of dtype, the core's pooling arguments, the
    row weights they point at, to keep until the call): a row per id, or
    with pooling a row per bag, each id's bag and weight checked here for
    shape and by the core for range (the weights converted to dtype's
    compute dtype, which the sums are in)."""
    if pooling is None:
        return (_float_rows(grad, ids.numel(), dim, "cpu", dtype), {"bag_of": 0, "row_weights": 0, "num_bags": 0},
                None)
    bag_of, weights = pooling.bag_of, pooling.row_weights
    if bag_of.dtype != torch.int64 or bag_of.shape != (ids.numel(),) or not bag_of.is_contiguous() or (
            weights is not None and (not weights.is_floating_point() or weights.shape != bag_of.shape)):
        raise ValueError(f"hostembed: a bag gradient takes contiguous int64 bag_of and floating-point "
                         f"row_weights of {ids.numel()} entries, got {bag_of.dtype} {list(bag_of.shape)} and "
                         f"{None if weights is None else (weights.dtype, list(weights.shape))}")
    if weights is not None:
        weights = weights.to(compute_dtype(dtype)).contiguous()
    rows = grad.to(device="cpu", dtype=dtype).contiguous().reshape(-1, dim)
    return rows, {"bag_of": _address(bag_of), "row_weights": 0 if weights is None else _address(weights),
                  "num_bags": rows.shape[0]}, weights


@grad_reduce.op.register_fake
def _(ids, grad, num_rows, padding_idx, scale_grad_by_freq):
    unique = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty(unique, dtype=torch.int64, device="cpu"),
            torch.empty(unique, grad.shape[-1], dtype=compute_dtype(grad.dtype), device="cpu"))


def _lookup_setup(ctx, inputs, output):
    weight, ids, padding_idx, _, _, scale_grad_by_freq, sparse = inputs
    ctx.save_for_backward(ids)
    ctx.table_shape = tuple(weight.shape)
    ctx.table_dtype = weight.dtype
    ctx.spec = (padding_idx, scale_grad_by_freq, sparse)


def _lookup_backward(ctx, grad_out):
    (ids,) = ctx.saved_tensors
    num_rows, dim = ctx.table_shape
    padding_idx, scale_grad_by_freq, sparse = ctx.spec
    grad = None
    if ctx.needs_input_grad[0]:
        dedup = getattr(ctx, "dedup", None)
        table = getattr(ctx, "table", None)  # eager only: fused tables are looked up eagerly
        if table is not None and table.fused and _fused.take_gradient(
                table, _fused.CpuGradient(ids, grad_out, padding_idx, scale_grad_by_freq, dedup)):
            return (None,) * 7  # applied when the backward pass ends; no weight.grad
        if torch.compiler.is_compiling():
            indices, values = grad_reduce.op(ids, grad_out, num_rows, padding_idx, scale_grad_by_freq)
        else:  # with max_norm, reusing the forward's sort
            indices, values = _reduce_rows(ids, grad_out, num_rows, padding_idx, scale_grad_by_freq, dedup,
                                           rounded=True)
        grad = weight_grad(indices, values, num_rows, dim, sparse, ctx.table_dtype)
    return grad, None, None, None, None, None, None


lookup.op.register_autograd(_lookup_backward, setup_context=_lookup_setup)


class _LookupEager(torch.autograd.Function):
    """The lookup op's eager twin (see _custom_op); it keeps a max_norm
    forward's sort of the ids for backward, which then sorts nothing."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
        out, ctx.dedup, ctx.table = _lookup_rows(weight, ids, max_norm, norm_type)
        _lookup_setup(ctx, (weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse), out)
        return out

    backward = staticmethod(_lookup_backward)


def embedding_lookup(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
    """weight[ids] on the CPU, differentiable (see lookup)."""
    args = (weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    return lookup.op(*args) if torch.compiler.is_compiling() else _LookupEager.apply(*args)


@torch.compiler.disable
def fused_embedding_lookup(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
    """embedding_lookup of a fused table: always eager (a graph break under
    torch.compile), since its backward queues the update with autograd's
    engine (_fused.py), which a compiled backward cannot do."""
    return _LookupEager.apply(weight, ids, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


# ---- the optimizer update on the CPU

# Optimizer kinds of the core (include/he_optim.h).
ADAM, SGD, ADAGRAD, ROWWISE_ADAGRAD = 0, 1, 2, 3
_OPTIMIZER_NAMES = {ADAM: "SparseAdam", SGD: "SGD", ADAGRAD: "Adagrad", ROWWISE_ADAGRAD: "RowWiseAdagrad"}


def sparse_update(kind: int, weight: Tensor, state, indices: Tensor, values: Tensor, *, lr: float, step: int,
                  maximize: bool, beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0,
                  lr_decay: float = 0.0, weight_decay: float = 0.0) -> None:
    """Optimizer `kind`'s update of rows `indices` with gradient rows
    `values`, in place, by the core's threads. Repeated indices are summed
    first; an index outside the table raises before anything is written.
    state: the optimizer's state tensors by name, in the core's order, each
    a buffer of the weight's table (HostTable.zeros). A table with a row
    cache updates its cached rows in their records (_cache.RowCache)."""
    name = _OPTIMIZER_NAMES[kind]
    table = host_table_of(weight, name)
    # A cache in GPU memory takes a gradient on the GPU as it is.
    device = values.device if table.cache is not None and table.cache.device == values.device else "cpu"
    indices, values = _row_gradient(table, indices, values, device, name)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, lr_decay=lr_decay, step=step, maximize=maximize,
                 weight_decay=weight_decay)
    if table.cache is not None:
        # Checked before the cache writes its records (update_rows checks
        # the host part only after them).
        for key, tensor in state.items():
            table.buffer_of(tensor, f"{name}'s {key}")
        with table.lock:
            table.cache.update(kind, state, indices, values, **hyper)
        return
    with table.lock:
        update_rows(kind, table, state, indices, values, **hyper)


def optimizer_name(kind: int) -> str:
    return _OPTIMIZER_NAMES[kind]


def sum_repeated_rows(table, indices: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """(distinct indices, ascending; their values summed in position order,
    as the core's update sums repeated rows) of a row-sparse gradient on
    the CPU."""
    return _reduce_rows(indices, values, table.num_rows, -1, False)


def records_adam_update(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, slots: Tensor, values: Tensor, *,
                        lr: float, step: int, maximize: bool, beta1: float, beta2: float, eps: float,
                        weight_decay: float = 0.0, lr_decay: float = 0.0) -> None:
    """SparseAdam's update of a GPU row cache's records (_cache.RowCache):
    weight, exp_avg and exp_avg_sq [slots, dim] float32 on one GPU, rows
    `slots` (distinct, in range: the planner's) with gradient rows
    `values`, by the GPU kernel, on the current stream."""
    _need_cuda("a row cache's GPU update")
    device = weight.device
    dim = weight.shape[1]
    for name, tensor in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("weight", weight)):
        if tensor.device != device or tensor.dtype != torch.float32 or not tensor.is_contiguous() \
                or tensor.shape != weight.shape:
            raise RuntimeError(f"hostembed: a row cache's {name} records must be contiguous float32 "
                               f"{list(weight.shape)} on {device}, got {list(tensor.shape)} {tensor.dtype} on "
                               f"{tensor.device}")
    slots = slots.to(device=device, dtype=torch.int64).contiguous()
    values = values.to(device=device, dtype=torch.float32).contiguous()
    if values.shape != (slots.numel(), dim):
        raise RuntimeError(f"hostembed: {slots.numel()} slots need [{slots.numel()}, {dim}] gradient rows, got "
                           f"{list(values.shape)}")
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        _C.cuda_sparse_adam_records(weight=_address(weight), exp_avg=_address(exp_avg),
                                    exp_avg_sq=_address(exp_avg_sq), dim=dim, slots=_address(slots),
                                    values=_address(values), nnz=slots.numel(), lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, step=step, maximize=maximize, weight_decay=weight_decay,
                                    device=device.index, stream=stream.cuda_stream)


def update_rows(kind: int, table, state, indices: Tensor, values: Tensor, *, lr: float, step: int, maximize: bool,
                beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0, lr_decay: float = 0.0,
                weight_decay: float = 0.0) -> None:
    """sparse_update of `table` (a HostTable) by the core, its arguments
    checked (or, from a row cache, split from checked ones); the caller
    holds table.lock."""
    name = _OPTIMIZER_NAMES[kind]
    buffers = tuple(table.buffer_of(tensor, f"{name}'s {key}") for key, tensor in state.items())
    table.wait_for_gpu_use()  # a GPU gather may still be reading rows this writes
    _C.sparse_update(kind=kind, weight=table.buffer, state=buffers, num_rows=table.num_rows, dim=table.dim,
                     indices=_address(indices), values=_address(values), nnz=indices.numel(), lr=lr,
                     beta1=beta1, beta2=beta2, eps=eps, lr_decay=lr_decay, step=step, maximize=maximize,
                     weight_decay=weight_decay, dtype=table.code, values_dtype=DTYPE_CODES[values.dtype],
                     stochastic_rounding=table.stochastic_rounding, seed=table.seed)
    table.rows_changed(indices)


@_custom_op("hostembed::sparse_adam_", mutates_args=("weight", "exp_avg", "exp_avg_sq"))
def sparse_adam_(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, indices: Tensor, values: Tensor, lr: float,
                 beta1: float, beta2: float, eps: float, step: int, maximize: bool,
                 weight_decay: float = 0.0) -> None:
    """torch.optim.SparseAdam's update (sparse_update of ADAM), an op that
    torch.compile can trace."""
    _check_state(host_table_of(weight, "SparseAdam"), exp_avg, exp_avg_sq)
    sparse_update(ADAM, weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, indices, values, lr=lr,
                  beta1=beta1, beta2=beta2, eps=eps, step=step, maximize=maximize, weight_decay=weight_decay)


def _row_gradient(table, indices, values, device, name="SparseAdam"):
    """A row-sparse gradient's (indices, values) as the core reads them:
    int64 [nnz] and [nnz, dim] in the table's dtype or compute dtype
    (HostTable.gradient_dtype), contiguous, on `device`. Refuses any
    other shape (a values tensor with the right number of elements but
    another shape would otherwise be read as rows) before the core runs."""
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(
            f"hostembed: {name} needs the gradient's row indices as a 1-D int64 (or int32) tensor, got a "
            f"{list(indices.shape)} {indices.dtype} tensor"
        )
    nnz = indices.numel()
    if values.dim() != 2 or tuple(values.shape) != (nnz, table.dim) or not values.is_floating_point():
        raise RuntimeError(
            f"hostembed: {name} needs the gradient's values as a floating-point [{nnz}, {table.dim}] tensor "
            f"(one row per index of a [{table.num_rows}, {table.dim}] table), got a {list(values.shape)} "
            f"{values.dtype} tensor"
        )
    indices = indices.to(device=device, dtype=torch.int64).contiguous()
    values = values.to(device=device, dtype=table.gradient_dtype(values.dtype)).contiguous()
    return indices, values


@sparse_adam_.op.register_fake
def _(weight, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, step, maximize, weight_decay=0.0):
    return None


def adam_update(*args, **hyper):
    """sparse_adam_ (the op under torch.compile)."""
    return (sparse_adam_.op if torch.compiler.is_compiling() else sparse_adam_)(*args, **hyper)


def fused_adam_update(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, gradient, *, lr: float, beta1: float,
                      beta2: float, eps: float, step: int, maximize: bool, weight_decay: float = 0.0) -> None:
    """A CPU lookup's backward and SparseAdam's update in one pass of the
    core (the fused mode, _fused.py): gradient is the lookup's
    _fused.CpuGradient. The same bits as grad_reduce then sparse_adam_.
    Eager only."""
    table = host_table_of(weight, "SparseAdam")
    _check_state(table, exp_avg, exp_avg_sq)
    sparse_update_fused(ADAM, weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, gradient, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, step=step, maximize=maximize, weight_decay=weight_decay)


def sparse_update_fused(kind: int, weight: Tensor, state, gradient, *, lr: float, step: int, maximize: bool,
                        beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0, lr_decay: float = 0.0,
                        weight_decay: float = 0.0) -> None:
    """sparse_update of optimizer `kind` from a CPU lookup's output gradient
    (_fused.CpuGradient) in one pass: each id's gradient rows summed and
    handed to its row update, the same bits as grad_reduce then
    sparse_update. Eager only (the fused mode, _fused.py)."""
    name = _OPTIMIZER_NAMES[kind]
    table = host_table_of(weight, name)
    if table.cache is not None:
        # Rows in records and rows in host memory: the unfused reduce,
        # then the cache's update (the same bits).
        indices, values = reduce_to_host(table, gradient)
        sparse_update(kind, weight, state, indices, values, lr=lr, step=step, maximize=maximize, beta1=beta1,
                      beta2=beta2, eps=eps, lr_decay=lr_decay, weight_decay=weight_decay)
        return
    buffers = tuple(table.buffer_of(tensor, f"{name}'s {key}") for key, tensor in state.items())
    ids = gradient.ids.reshape(-1).contiguous()
    rows, bags, _weights = _gradient_rows(gradient.grad, ids, table.dim, gradient.pooling,
                                          table.gradient_dtype(gradient.grad.dtype))
    dedup = gradient.dedup
    if dedup is None:
        dedup = _C.Dedup(**_cpu_ids(ids), num_rows=table.num_rows)
    with table.lock:
        table.wait_for_gpu_use()  # a GPU gather may still be reading rows this writes
        _C.sparse_update_fused(dedup=dedup, grad=_address(rows), padding_idx=gradient.padding_idx,
                               scale_grad_by_freq=gradient.scale_grad_by_freq, kind=kind, weight=table.buffer,
                               state=buffers, num_rows=table.num_rows, dim=table.dim, lr=lr, beta1=beta1,
                               beta2=beta2, eps=eps, lr_decay=lr_decay, step=step, maximize=maximize,
                               weight_decay=weight_decay, dtype=table.code, grad_dtype=DTYPE_CODES[rows.dtype],
                               stochastic_rounding=table.stochastic_rounding, seed=table.seed, **bags)
        table.rows_changed(ids)


def reduce_to_host(table, gradient):
    """A fused table's lookup gradient (_fused.CpuGradient or GpuGradient)
    reduced as its unfused backward would: (indices, values) on the CPU."""
    if isinstance(gradient, _fused.CpuGradient):
        indices, values = _reduce_rows(gradient.ids, gradient.grad, table.num_rows, gradient.padding_idx,
                                       gradient.scale_grad_by_freq, gradient.dedup, gradient.pooling, rounded=True)
        # Rounded to the table's dtype, as each lookup's weight.grad is.
        return indices, values.to(table.dtype)
    indices, values = gradient.wait()
    return indices.cpu(), values.cpu()


def _check_state(table, *state):
    for tensor in state:
        if not (tensor.dtype == table.state_dtype and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tuple(tensor.shape) == (table.num_rows, table.dim)):
            raise RuntimeError(
                f"hostembed: optimizer state for a [{table.num_rows}, {table.dim}] table must be a contiguous "
                f"{dtype_name(table.state_dtype)} CPU tensor of that shape, got a {list(tensor.shape)} {tensor.dtype} "
                f"tensor on {tensor.device}"
            )


# ---- the GPU path: outputs on a GPU, rows read from the pinned table
#
# forward: dedup the ids on the GPU (CUB sort; the one host wait of a
# lookup, for the range check and the unique count), max_norm on the unique
# rows in place, a zero-copy gather of the unique rows, out = rows[inverse].
# backward: segment-sum of the output gradient per unique id on the GPU,
# copied to pinned host memory for weight.grad (see _lookup_gpu.py).
# Everything runs on torch's current stream of the device; buffers come from
# torch's caching allocator on that stream, so their reuse is stream-ordered.

def _need_cuda(what):
    if not CUDA_COMPILED:
        raise RuntimeError(f"hostembed: {what} needs the CUDA kernels, and this build has none")


def _pinned_rows(table, tensor, device, what):
    """The registered HostBuffer that tensor (the rows, or optimizer state)
    is; the kernels reach it through its device address. They read float32
    only: other tables take the CPU path (the modules send them there)."""
    if table.dtype != torch.float32:
        raise RuntimeError(f"hostembed: {what}: the GPU kernels take float32 tables, this one is "
                           f"{dtype_name(table.dtype)}")
    buf = table.pinned_buffer(tensor, device, what)
    if buf is None:
        raise RuntimeError(f"hostembed: {what}: the host buffer is not pinned for the GPU (CUDA refused it)")
    return buf


@_custom_op("hostembed::gpu_lookup", mutates_args=())
def gpu_lookup(weight: Tensor, table_handle: int, ids: Tensor, device: torch.device, padding_idx: int,
               max_norm: Optional[float], norm_type: float, scale_grad_by_freq: bool,
               sparse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """weight[ids] on `device`, read straight from the pinned table.

    Returns the output and what backward needs: the batch's unique ids,
    their offsets into `order` (positions sorted by id), the inverse map
    (position -> unique slot) and, on the CPU, [num_unique, padding_slot].
    Like the CPU op, max_norm renorms the rows in place, undeclared.
    table_handle names weight's table for the backward (HostTable.handle).
    """
    _need_cuda("a GPU lookup")
    table = host_table_of(weight, "a GPU lookup")
    base = _pinned_rows(table, weight, device, "a GPU lookup")
    dim = table.dim
    rows_of = {"table": base, "num_rows": table.num_rows, "dim": dim}
    with table.lock, torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        table.order_after_gpu_use(stream)
        where = {"device": device.index, "stream": stream.cuda_stream}
        count, unique, offsets, order, inverse, (num_unique, padding_slot) = gpu_dedup(table, ids, device,
                                                                                      padding_idx)
        if max_norm is not None:
            # In place before the gather, outside autograd (as torch does).
            table.rows_changed(None)
            _C.cuda_renorm(**rows_of, rows=_address(unique), count=num_unique, max_norm=float(max_norm),
                           norm_type=float(norm_type), **where)
        # dtype spelled out: the kernels write float32 whatever
        # torch.get_default_dtype() says.
        rows = torch.empty(num_unique, dim, dtype=torch.float32, device=device)
        _C.cuda_gather(**rows_of, rows=_address(unique), count=num_unique, out=_address(rows), **where)
        table.record_gpu_use(stream)
        # Written through a view into a tensor of its own: the output must
        # not be a view (see scratch).
        out = torch.empty(*ids.shape, dim, dtype=torch.float32, device=device)
        torch.index_select(rows, 0, inverse, out=out.view(count, dim))
    info = torch.tensor([num_unique, padding_slot], dtype=torch.int64)
    return out, unique, offsets, order, inverse, info


def gpu_dedup(table, ids, device, padding_idx):
    """The GPU dedup of a batch of ids, on the current stream of `device`
    (the caller's): (count, unique, offsets, order, inverse, (num_unique,
    padding_slot)), unique[:num_unique] the distinct ids ascending. An id
    outside the table raises IndexError before anything is written."""
    # contiguous(): reshape(-1) is a view wherever it can be, and a 1-D
    # view may be strided (ids[::2]) or expanded (stride 0); the kernels
    # read count packed ids.
    flat = ids.to(device).reshape(-1).contiguous()
    count = flat.numel()
    stream = torch.cuda.current_stream(device)
    ws_bytes = _C.cuda_dedup_workspace(count=count, num_rows=table.num_rows, device=device.index)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
    unique = torch.empty(count, dtype=torch.int64, device=device)
    offsets = torch.empty(count + 1, dtype=torch.int64, device=device)
    order = torch.empty(count, dtype=torch.int32, device=device)
    inverse = torch.empty(count, dtype=torch.int64, device=device)
    info = _C.cuda_dedup(**_ids(flat), num_rows=table.num_rows, padding_idx=padding_idx,
                         workspace=_address(workspace), workspace_bytes=ws_bytes, unique=_address(unique),
                         offsets=_address(offsets), order=_address(order), inverse=_address(inverse),
                         device=device.index, stream=stream.cuda_stream)
    return count, unique, offsets, order, inverse, info


@gpu_lookup.op.register_fake
def _(weight, table_handle, ids, device, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse):
    count = ids.numel()
    return (torch.empty(*ids.shape, weight.shape[1], dtype=torch.float32, device=device),
            torch.empty(count, dtype=torch.int64, device=device),
            torch.empty(count + 1, dtype=torch.int64, device=device),
            torch.empty(count, dtype=torch.int32, device=device),
            torch.empty(count, dtype=torch.int64, device=device),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@_custom_op("hostembed::gpu_grad_reduce", mutates_args=())
def gpu_grad_reduce(table_handle: int, grad: Tensor, unique: Tensor, offsets: Tensor, order: Tensor, inverse: Tensor,
                    info: Tensor, scale_grad_by_freq: bool) -> tuple[Tensor, Tensor]:
    """Sums the output gradient per unique id on the GPU in a fixed order
    (no atomics), and returns the sums in pinned host memory: (indices
    [k], values [k, D]), padding_idx's row left out. weight.grad lives on
    the CPU because the weight does (autograd requires it), so backward
    waits for that copy. When the table's optimizer may update on the GPU,
    the GPU copy is kept on the table too (a "twin" of weight.grad). The
    table comes as a handle: a saved weight would make autograd refuse a
    backward after any in-place change of the table (an optimizer step)."""
    _need_cuda("a GPU backward")
    from ._lookup_gpu import GradTwin

    table = table_by_handle(table_handle, "a GPU backward")
    device, dim = unique.device, table.dim
    indices, values = gpu_reduce(table, grad, unique, offsets, order, inverse, info, scale_grad_by_freq)
    kept = indices.numel()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # Pinned staging from torch's caching host allocator: a per-step
        # buffer reused step after step, unlike the table, for which
        # pin_memory() is never used. Its power-of-two rounding costs at
        # most one extra gradient's worth of pinned memory.
        indices_cpu = torch.empty(kept, dtype=torch.int64, pin_memory=True)
        values_cpu = torch.empty(kept, dim, dtype=torch.float32, pin_memory=True)
        if kept:
            indices_cpu.copy_(indices, non_blocking=True)
            values_cpu.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
    table.grad_twin = GradTwin(indices, values, indices_cpu, values_cpu, table.num_rows) if table.twin_wanted \
        else None
    return indices_cpu, values_cpu


def gpu_reduce(table, grad, unique, offsets, order, inverse, info, scale_grad_by_freq):
    """The GPU backward's sums per unique id, left on the GPU: (indices [k],
    values [k, D]) on torch's current stream, padding_idx's row left out."""
    device, dim = unique.device, table.dim
    num_unique, padding_slot = info.tolist()
    count = inverse.numel()
    kept = num_unique - (padding_slot >= 0)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        indices = torch.empty(kept, dtype=torch.int64, device=device)
        values = torch.empty(kept, dim, dtype=torch.float32, device=device)
        if count:
            rows = _float_rows(grad, count, dim, device)
            ws_bytes = _C.cuda_grad_reduce_workspace(count=count, num_unique=num_unique, dim=dim,
                                                     device=device.index)
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
            _C.cuda_grad_reduce(
                grad=_address(rows), dim=dim, count=count, unique=_address(unique), offsets=_address(offsets),
                order=_address(order), inverse=_address(inverse), num_unique=num_unique,
                padding_slot=padding_slot, scale_grad_by_freq=scale_grad_by_freq, workspace=_address(workspace),
                workspace_bytes=ws_bytes, values=_address(values), indices=_address(indices),
                device=device.index, stream=stream.cuda_stream)
    return indices, values


@gpu_grad_reduce.op.register_fake
def _(table_handle, grad, unique, offsets, order, inverse, info, scale_grad_by_freq):
    kept = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty(kept, dtype=torch.int64, device="cpu"),
            torch.empty(kept, grad.shape[-1], dtype=torch.float32, device="cpu"))


def _gpu_lookup_setup(ctx, inputs, output):
    weight, table_handle, _, _, _, _, _, scale_grad_by_freq, sparse = inputs
    _, unique, offsets, order, inverse, info = output
    ctx.save_for_backward(unique, offsets, order, inverse, info)
    ctx.spec = (scale_grad_by_freq, sparse)
    ctx.table_shape = tuple(weight.shape)
    ctx.table_handle = table_handle
    # Only `out` is differentiable: no zero gradients for the index outputs.
    ctx.set_materialize_grads(False)


def _gpu_lookup_backward(reduce, eager):
    def backward(ctx, grad_out, *unused):
        unique, offsets, order, inverse, info = ctx.saved_tensors
        scale_grad_by_freq, sparse = ctx.spec
        num_rows, dim = ctx.table_shape
        grad = None
        if ctx.needs_input_grad[0]:
            # Fused tables are looked up eagerly (fused_embedding_gpu_lookup).
            table = table_by_handle(ctx.table_handle, "a GPU backward") if eager else None
            if table is not None and table.fused and _fused.optimizer_of(table) is not None:
                # Summed here, on this node's stream, where grad_out is ready.
                indices, values = gpu_reduce(table, grad_out, unique, offsets, order, inverse, info,
                                             scale_grad_by_freq)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(values.device))
                if _fused.take_gradient(table, _fused.GpuGradient(indices, values, ready)):
                    return (None,) * 9  # applied when the backward pass ends; no weight.grad
            indices, values = reduce(ctx.table_handle, grad_out, unique, offsets, order, inverse, info,
                                     scale_grad_by_freq)
            grad = weight_grad(indices, values, num_rows, dim, sparse)
        return grad, None, None, None, None, None, None, None, None
    return backward


gpu_lookup.op.register_autograd(_gpu_lookup_backward(gpu_grad_reduce.op, False), setup_context=_gpu_lookup_setup)
_gpu_lookup_eager = _eager_autograd(gpu_lookup, _gpu_lookup_setup, _gpu_lookup_backward(gpu_grad_reduce, True))


def embedding_gpu_lookup(weight, table_handle, ids, device, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse):
    """weight[ids] on a GPU, differentiable (see gpu_lookup); returns the output only."""
    args = (weight, table_handle, ids, device, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    outputs = gpu_lookup.op(*args) if torch.compiler.is_compiling() else _gpu_lookup_eager.apply(*args)
    return outputs[0]


@torch.compiler.disable
def fused_embedding_gpu_lookup(weight, table_handle, ids, device, padding_idx, max_norm, norm_type,
                               scale_grad_by_freq, sparse):
    """embedding_gpu_lookup of a fused table: always eager (see
    fused_embedding_lookup)."""
    return _gpu_lookup_eager.apply(weight, table_handle, ids, device, padding_idx, max_norm, norm_type,
                                   scale_grad_by_freq, sparse)[0]


@_custom_op("hostembed::gpu_sparse_adam_", mutates_args=("weight", "exp_avg", "exp_avg_sq"))
def gpu_sparse_adam_(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, indices: Tensor, values: Tensor,
                     lr: float, beta1: float, beta2: float, eps: float, step: int, maximize: bool,
                     weight_decay: float = 0.0) -> None:
    """SparseAdam's update by a kernel on values' GPU, through the pinned
    mapping of the table and its state (pinned here on first use), with
    the gradient rows already in GPU memory. Complete when it returns."""
    _need_cuda("a GPU update")
    table = host_table_of(weight, "SparseAdam")
    _check_state(table, exp_avg, exp_avg_sq)
    device = values.device
    if device.type != "cuda" or indices.device != device:
        raise RuntimeError(f"hostembed: a GPU update needs the gradient's indices and values on one GPU, got "
                           f"{indices.device} and {device}")
    indices, values = _row_gradient(table, indices, values, device)
    w, m, v = (_pinned_rows(table, t, device, "SparseAdam") for t in (weight, exp_avg, exp_avg_sq))
    with table.lock, torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # After any GPU work on the rows (a gather on another stream).
        table.order_after_gpu_use(stream)
        table.rows_changed(None)
        _C.cuda_sparse_adam(weight=w, exp_avg=m, exp_avg_sq=v, num_rows=table.num_rows, dim=table.dim,
                            indices=_address(indices), values=_address(values), nnz=indices.numel(), lr=lr,
                            beta1=beta1, beta2=beta2, eps=eps, step=step, maximize=maximize,
                            weight_decay=weight_decay, device=device.index,
                            stream=stream.cuda_stream)
        # Done when step() returns, as any optimizer on CPU tensors:
        # state_dict(), torch.save and CPU reads of the weight see the
        # update. The next lookup waits for its dedup anyway, so this wait
        # mostly moves that one earlier.
        table.record_gpu_use(stream).synchronize()


@gpu_sparse_adam_.op.register_fake
def _(weight, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, step, maximize, weight_decay=0.0):
    return None


def gpu_adam_update(*args, **hyper):
    """gpu_sparse_adam_ (the op under torch.compile)."""
    return (gpu_sparse_adam_.op if torch.compiler.is_compiling() else gpu_sparse_adam_)(*args, **hyper)
