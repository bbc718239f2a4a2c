"""The GPU path of hostembed.Embedding: outputs on the GPU, rows read
straight from the table in pinned host memory (the ops, and where
weight.grad lives, are in _core/ops/gpu.py)."""
from ..._core.cuda import resolve_device
from ..._core.ids import check_ids
from ..._core.ops import gpu as gpu_ops
from .cpu import max_norm_of, padding_of


def lookup(module, ids, scale_grad_by_freq=None):
    """As cpu.lookup, with outputs on the module's GPU."""
    if scale_grad_by_freq is None:
        scale_grad_by_freq = module.scale_grad_by_freq
    check_ids(ids)
    lookup_fn = gpu_ops.fused_embedding_gpu_lookup if module._table.fused else gpu_ops.embedding_gpu_lookup
    return lookup_fn(module.weight, module._table.handle, ids, resolve_device(module.output_device),
                     padding_of(module), max_norm_of(module), float(module.norm_type), scale_grad_by_freq,
                     module._sparse_gradient())
