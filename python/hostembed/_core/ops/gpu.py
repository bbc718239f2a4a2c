"""The GPU path's ops: outputs on a GPU, rows read straight from the table
in pinned host memory, gradients summed on the GPU, and SparseAdam's update
by a kernel through the pinned mapping (a GPU row cache's: gpu_cache.py).

forward: dedup the ids on the GPU (CUB sort; the one host wait of a lookup,
for the range check and the unique count), max_norm on the unique rows in
place, a zero-copy gather of the unique rows, out = rows[inverse].
backward: segment-sum of the output gradient per unique id on the GPU,
copied to pinned host memory for weight.grad.
Everything runs on torch's current stream of the device; buffers come from
torch's caching allocator on that stream, so their reuse is stream-ordered.

Where weight.grad lives. autograd requires a parameter's gradient on the
parameter's device, and the weight is a CPU tensor (it aliases host memory),
so weight.grad is a CPU sparse COO tensor: the GPU's [unique, D] sums are
copied once into pinned memory, and backward waits for that copy, since CPU
code (torch.optim.SparseAdam, clipping, inspection) may read weight.grad as
soon as backward returns. When a hostembed.SparseAdam that may update on the
GPU (update="gpu", or "auto" until it has settled on "cpu") owns the weight,
the GPU copy of the sums is kept on the table too (a "twin" of weight.grad,
GradTwin), so the update kernel reads the gradient from GPU memory instead
of copying it back; it is used only while weight.grad is exactly what that
backward produced (same buffers, never modified in place), else the CPU core
updates from weight.grad itself.
"""
from typing import Optional

import torch
from torch import Tensor

from .. import _C
from .. import fused as _fused
from ..table import dtype_name, host_table_of, table_by_handle
from .common import CUDA_COMPILED, address, custom_op, eager_autograd, float_rows, host_copies, ids_args, weight_grad
from .update import check_state, row_gradient


def need_cuda(what):
    if not CUDA_COMPILED:
        raise RuntimeError(f"hostembed: {what} needs the CUDA kernels, and this build has none")


def pinned_rows(table, tensor, device, what):
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


@custom_op("hostembed::gpu_lookup", mutates_args=())
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
    need_cuda("a GPU lookup")
    table = host_table_of(weight, "a GPU lookup")
    base = pinned_rows(table, weight, device, "a GPU lookup")
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
            _C.cuda_renorm(**rows_of, rows=address(unique), count=num_unique, max_norm=float(max_norm),
                           norm_type=float(norm_type), **where)
        # dtype spelled out: the kernels write float32 whatever
        # torch.get_default_dtype() says.
        rows = torch.empty(num_unique, dim, dtype=torch.float32, device=device)
        _C.cuda_gather(**rows_of, rows=address(unique), count=num_unique, out=address(rows), **where)
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
    info = _C.cuda_dedup(**ids_args(flat), num_rows=table.num_rows, padding_idx=padding_idx,
                         workspace=address(workspace), workspace_bytes=ws_bytes, unique=address(unique),
                         offsets=address(offsets), order=address(order), inverse=address(inverse),
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


@custom_op("hostembed::gpu_grad_reduce", mutates_args=())
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
    need_cuda("a GPU backward")
    table = table_by_handle(table_handle, "a GPU backward")
    indices, values = gpu_reduce(table, grad, unique, offsets, order, inverse, info, scale_grad_by_freq)
    indices_cpu, values_cpu = host_copies(indices, values)
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
            rows = float_rows(grad, count, dim, device)
            ws_bytes = _C.cuda_grad_reduce_workspace(count=count, num_unique=num_unique, dim=dim,
                                                     device=device.index)
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
            _C.cuda_grad_reduce(
                grad=address(rows), dim=dim, count=count, unique=address(unique), offsets=address(offsets),
                order=address(order), inverse=address(inverse), num_unique=num_unique,
                padding_slot=padding_slot, scale_grad_by_freq=scale_grad_by_freq, workspace=address(workspace),
                workspace_bytes=ws_bytes, values=address(values), indices=address(indices),
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


def table_gradient(table, table_handle, grad_out, saved, scale_grad_by_freq, sparse, shape, reduce):
    """weight's gradient from a GPU lookup's output gradient, summed per
    unique id on the GPU (saved: gpu_dedup's unique, offsets, order,
    inverse and [num_unique, padding_slot]); None when a fused table's
    optimizer took the sums (table: eager only, else None)."""
    unique, offsets, order, inverse, info = saved
    if table is not None and table.fused and _fused.optimizer_of(table) is not None:
        # Summed here, on this node's stream, where grad_out is ready.
        indices, values = gpu_reduce(table, grad_out, unique, offsets, order, inverse, info, scale_grad_by_freq)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(values.device))
        if _fused.take_gradient(table, _fused.GpuGradient(indices, values, ready)):
            return None  # applied when the backward pass ends; no weight.grad
    indices, values = reduce(table_handle, grad_out, unique, offsets, order, inverse, info, scale_grad_by_freq)
    return weight_grad(indices, values, *shape, sparse)


def gradient_of_ids(table, grad_out, ids, padding_idx, scale_grad_by_freq, sparse):
    """table_gradient for output gradient grad_out of a lookup of ids that
    kept no GPU dedup (a row cache of host records): the ids deduplicated
    on grad_out's GPU, then summed as the uncached GPU path sums them."""
    device = grad_out.device
    with torch.cuda.device(device):
        _, unique, offsets, order, inverse, (num_unique, padding_slot) = gpu_dedup(table, ids, device, padding_idx)
        info = torch.tensor([num_unique, padding_slot], dtype=torch.int64)
        return table_gradient(table, table.handle, grad_out, (unique, offsets, order, inverse, info),
                              scale_grad_by_freq, sparse, (table.num_rows, table.dim), gpu_grad_reduce)


def _gpu_lookup_backward(reduce, eager):
    def backward(ctx, grad_out, *unused):
        grad = None
        if ctx.needs_input_grad[0]:
            # Fused tables are looked up eagerly (fused_embedding_gpu_lookup).
            table = table_by_handle(ctx.table_handle, "a GPU backward") if eager else None
            grad = table_gradient(table, ctx.table_handle, grad_out, ctx.saved_tensors, *ctx.spec, ctx.table_shape,
                                  reduce)
            if grad is None:
                return (None,) * 9
        return grad, None, None, None, None, None, None, None, None
    return backward


gpu_lookup.op.register_autograd(_gpu_lookup_backward(gpu_grad_reduce.op, False), setup_context=_gpu_lookup_setup)
_gpu_lookup_eager = eager_autograd(gpu_lookup, _gpu_lookup_setup, _gpu_lookup_backward(gpu_grad_reduce, True))


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


@custom_op("hostembed::gpu_sparse_adam_", mutates_args=("weight", "exp_avg", "exp_avg_sq"))
def gpu_sparse_adam_(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, indices: Tensor, values: Tensor,
                     lr: float, beta1: float, beta2: float, eps: float, step: int, maximize: bool,
                     weight_decay: float = 0.0) -> None:
    """SparseAdam's update by a kernel on values' GPU, through the pinned
    mapping of the table and its state (pinned here on first use), with
    the gradient rows already in GPU memory. Complete when it returns."""
    need_cuda("a GPU update")
    table = host_table_of(weight, "SparseAdam")
    check_state(table, exp_avg, exp_avg_sq)
    device = values.device
    if device.type != "cuda" or indices.device != device:
        raise RuntimeError(f"hostembed: a GPU update needs the gradient's indices and values on one GPU, got "
                           f"{indices.device} and {device}")
    indices, values = row_gradient(table, indices, values, device)
    w, m, v = (pinned_rows(table, t, device, "SparseAdam") for t in (weight, exp_avg, exp_avg_sq))
    with table.lock, torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # After any GPU work on the rows (a gather on another stream).
        table.order_after_gpu_use(stream)
        table.rows_changed(None)
        _C.cuda_sparse_adam(weight=w, exp_avg=m, exp_avg_sq=v, num_rows=table.num_rows, dim=table.dim,
                            indices=address(indices), values=address(values), nnz=indices.numel(), lr=lr,
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


class GradTwin:
    """weight.grad's rows on the GPU, and how to recognise that weight.grad."""

    __slots__ = ("indices", "values", "device", "num_rows", "nnz", "indices_ptr", "values_ptr", "_keep")

    def __init__(self, indices, values, indices_cpu, values_cpu, num_rows):
        self.indices, self.values, self.device = indices, values, values.device
        self.num_rows, self.nnz = num_rows, indices.numel()
        self.indices_ptr, self.values_ptr = indices_cpu.data_ptr(), values_cpu.data_ptr()
        # The storages, not the tensors: a held tensor would make autograd
        # clone the gradient when it stores it (it reuses values only when
        # nothing else refers to them), while holding the storages keeps the
        # addresses from being reused by another gradient.
        self._keep = (indices_cpu.untyped_storage(), values_cpu.untyped_storage())

    def matches(self, grad) -> bool:
        # autograd stores a new sparse tensor around our indices and values,
        # at version 0; an in-place change of it or of its values (clipping)
        # bumps the version, which the two copies would no longer share.
        return (grad.is_sparse and grad.sparse_dim() == 1 and grad._version == 0
                and grad.shape[0] == self.num_rows and grad._nnz() == self.nnz
                and grad._indices().data_ptr() == self.indices_ptr and grad._values().data_ptr() == self.values_ptr
                and grad._values().dtype == torch.float32)


def take_grad_twin(table, grad):
    """The GPU twin of grad if grad is exactly what the table's last GPU
    backward produced, else None. Consumed either way (it holds GPU memory)."""
    twin, table.grad_twin = table.grad_twin, None
    if twin is None or not twin.matches(grad):
        return None
    return twin
