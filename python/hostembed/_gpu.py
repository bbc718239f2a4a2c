"""The GPU path of hostembed.Embedding: outputs on the GPU, read straight
from the table in registered host memory.

forward: dedup the ids on the GPU (CUB sort; the one host wait of a lookup,
for the range check and the unique count), max_norm on the unique rows in
place, zero-copy gather of the unique rows, output = rows[inverse].
backward: segment-sum of the output grads per unique id on the GPU, then
weight.grad as on the CPU path.

Where weight.grad lives. autograd requires a parameter's gradient on the
parameter's device, and the weight is a CPU tensor (it aliases host memory),
so weight.grad is a CPU sparse COO tensor: the GPU's [unique, D] sums are
copied once into pinned memory, and backward waits for that copy, since CPU
code (torch.optim.SparseAdam, clipping, inspection) may read weight.grad as
soon as backward returns. When a hostembed.SparseAdam with update="gpu" owns
the weight, the GPU copy of the sums is also kept (a "twin" of weight.grad),
so its update kernel reads the gradient from GPU memory instead of copying
it back; it is used only while weight.grad is exactly what this backward
produced (same buffers, never modified in place), else the CPU core updates
from weight.grad itself.

All work goes on torch's current stream of the output device; allocations
come from torch's caching allocator on that stream, so their reuse is
stream-ordered.
"""
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from ._cuda import order_after_gpu_use, record_gpu_use, resolve_device
from ._host_memory import device_address
from ._ids import check_ids
from ._sparse import row_sparse

# Parameters updated by a hostembed.SparseAdam(update="gpu"): only for them
# does backward keep the GPU twin of weight.grad (it holds GPU memory until
# the step consumes it).
_twin_wanted = WeakIdKeyDictionary()
# Parameter -> _GradTwin of its last backward.
_grad_twins = WeakIdKeyDictionary()


class _GradTwin:
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


def want_grad_twin(param) -> None:
    _twin_wanted[param] = True


def take_grad_twin(param, grad):
    """The GPU twin of grad if grad is exactly what the last GPU backward
    produced for param, else None. Consumed either way."""
    twin = _grad_twins.pop(param, None)
    if twin is None or not twin.matches(grad):
        return None
    return twin


class _Batch:
    """The GPU dedup of one batch (kept for backward)."""

    __slots__ = ("count", "num_unique", "padding_slot", "unique", "offsets", "order", "inverse")


def _dedup(ids, num_rows, padding_idx, device, stream) -> _Batch:
    b = _Batch()
    b.count = count = ids.numel()
    index = device.index
    ws_bytes = _C.cuda_dedup_workspace(count, num_rows, index)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
    b.unique = torch.empty(count, dtype=torch.int64, device=device)
    b.offsets = torch.empty(count + 1, dtype=torch.int64, device=device)
    b.order = torch.empty(count, dtype=torch.int32, device=device)
    b.inverse = torch.empty(count, dtype=torch.int64, device=device)
    b.num_unique, b.padding_slot = _C.cuda_dedup(
        ids.data_ptr(), count, ids.dtype == torch.int64, num_rows, -1 if padding_idx is None else padding_idx,
        workspace.data_ptr(), ws_bytes, b.unique.data_ptr(), b.offsets.data_ptr(), b.order.data_ptr(),
        b.inverse.data_ptr(), index, stream.cuda_stream,
    )
    return b


def lookup(module, ids):
    """module(ids) with outputs on module.output_device (a CUDA device), or
    None when the table is not registered with CUDA (registration warned
    when it failed), for the caller's CPU path."""
    check_ids(ids)
    weight = module.weight
    table = device_address(weight)
    if table is None:
        return None
    device = resolve_device(module.output_device)
    num_rows, dim = weight.shape
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # contiguous(): reshape(-1) is a view wherever it can be, and a 1-D
        # view may be strided (ids[::2]) or expanded (stride 0); the kernels
        # read count packed ids from data_ptr().
        flat = ids.to(device).reshape(-1).contiguous()
        order_after_gpu_use(weight, stream)
        batch = _dedup(flat, num_rows, module.padding_idx, device, stream)
        if module.max_norm is not None:
            # In place before the gather, outside autograd (as torch does).
            _C.cuda_renorm(table, dim, batch.unique.data_ptr(), batch.num_unique, float(module.max_norm),
                           float(module.norm_type), device.index, stream.cuda_stream)
        return _GpuLookup.apply(weight, table, tuple(ids.shape), batch, device, module.scale_grad_by_freq,
                                module.sparse)


class _GpuLookup(torch.autograd.Function):
    """out = weight[ids] on the GPU; backward reduces rows per unique id there."""

    @staticmethod
    def forward(ctx, weight, table, ids_shape, batch, device, scale_grad_by_freq, sparse):
        num_rows, dim = weight.shape
        stream = torch.cuda.current_stream(device)
        # dtype spelled out: the kernels write float32 whatever
        # torch.get_default_dtype() says.
        rows = torch.empty(batch.num_unique, dim, dtype=torch.float32, device=device)
        _C.cuda_gather(table, dim, batch.unique.data_ptr(), batch.num_unique, rows.data_ptr(), device.index,
                       stream.cuda_stream)
        record_gpu_use(weight, stream)
        out = rows.index_select(0, batch.inverse)
        ctx.batch, ctx.device, ctx.table_shape = batch, device, (num_rows, dim)
        ctx.scale_grad_by_freq, ctx.sparse = scale_grad_by_freq, sparse
        ctx.weight_ref = weakref.ref(weight)
        return out.view(*ids_shape, dim)

    @staticmethod
    def backward(ctx, grad_out):
        none = (None,) * 6
        if not ctx.needs_input_grad[0]:
            return (None,) + none
        # The engine runs this on its thread for the gradient's device, but
        # say so: the kernels and torch's allocations below must agree on it.
        with torch.cuda.device(ctx.device):
            return (_GpuLookup._grad_weight(ctx, grad_out),) + none

    @staticmethod
    def _grad_weight(ctx, grad_out):
        b, device = ctx.batch, ctx.device
        num_rows, dim = ctx.table_shape
        stream = torch.cuda.current_stream(device)
        kept = b.num_unique - (b.padding_slot >= 0)
        indices = torch.empty(kept, dtype=torch.int64, device=device)
        values = torch.empty(kept, dim, dtype=torch.float32, device=device)
        if b.count:
            grad = grad_out.to(device=device, dtype=torch.float32).contiguous().view(-1, dim)
            ws_bytes = _C.cuda_grad_reduce_workspace(b.count, b.num_unique, dim, device.index)
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
            _C.cuda_grad_reduce(
                grad.data_ptr(), dim, b.count, b.unique.data_ptr(), b.offsets.data_ptr(), b.order.data_ptr(),
                b.inverse.data_ptr(), b.num_unique, b.padding_slot, ctx.scale_grad_by_freq, workspace.data_ptr(),
                ws_bytes, values.data_ptr(), indices.data_ptr(), device.index, stream.cuda_stream,
            )
        # weight.grad lives on the CPU (see the module docstring). Pinned
        # staging from torch's caching host allocator: a per-step buffer
        # reused step after step, unlike the table, for which pin_memory()
        # is never used. Its power-of-two rounding costs at most one extra
        # gradient's worth of pinned memory.
        indices_cpu = torch.empty(kept, dtype=torch.int64, pin_memory=True)
        values_cpu = torch.empty(kept, dim, dtype=torch.float32, pin_memory=True)
        if kept:
            indices_cpu.copy_(indices, non_blocking=True)
            values_cpu.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
        weight = ctx.weight_ref()
        if ctx.sparse:
            if weight is not None and weight in _twin_wanted:
                _grad_twins[weight] = _GradTwin(indices, values, indices_cpu, values_cpu, num_rows)
            return row_sparse(indices_cpu, values_cpu, num_rows)
        grad_weight = torch.zeros(num_rows, dim, dtype=torch.float32)
        grad_weight.index_copy_(0, indices_cpu, values_cpu)
        return grad_weight
