"""The GPU path of hostembed.Embedding: outputs on the GPU, rows read
straight from the table in pinned host memory (the ops are in _ops.py).

Where weight.grad lives. autograd requires a parameter's gradient on the
parameter's device, and the weight is a CPU tensor (it aliases host memory),
so weight.grad is a CPU sparse COO tensor: the GPU's [unique, D] sums are
copied once into pinned memory, and backward waits for that copy, since CPU
code (torch.optim.SparseAdam, clipping, inspection) may read weight.grad as
soon as backward returns. When a hostembed.SparseAdam that may update on the
GPU (update="gpu", or "auto" until it has settled on "cpu") owns the weight,
the GPU copy of the sums is kept on the table too (a "twin" of weight.grad),
so the update kernel reads the gradient from GPU memory instead of copying
it back; it is used only while weight.grad is exactly what that backward
produced (same buffers, never modified in place), else the CPU core updates
from weight.grad itself.
"""
import torch

from . import _ops
from ._cuda import resolve_device
from ._ids import check_ids
from ._lookup_cpu import _max_norm, _padding


def lookup(module, ids, scale_grad_by_freq=None):
    """As _lookup_cpu.lookup, with outputs on the module's GPU."""
    if scale_grad_by_freq is None:
        scale_grad_by_freq = module.scale_grad_by_freq
    check_ids(ids)
    lookup_fn = _ops.fused_embedding_gpu_lookup if module._table.fused else _ops.embedding_gpu_lookup
    return lookup_fn(module.weight, module._table.handle, ids, resolve_device(module.output_device),
                     _padding(module), _max_norm(module), float(module.norm_type), scale_grad_by_freq,
                     module.sparse)


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
