"""The CPU path of hostembed.Embedding: the core's threads gather rows into
host memory; outputs go to another device with one copy."""
import torch

from ..._core.ids import ID_DTYPES, prepare_ids
from ..._core.ops import cpu as cpu_ops


def lookup(module, ids, scale_grad_by_freq=None):
    """module.weight[ids] (autograd through the core's lookup op), with the
    module's options; scale_grad_by_freq overrides the module's."""
    if scale_grad_by_freq is None:
        scale_grad_by_freq = module.scale_grad_by_freq
    # _parameters, not module.weight: forward checked the weight already
    # (the attribute's own checks cost as much as a small gather).
    args = (module._parameters["weight"], prepare_ids(ids), padding_of(module), max_norm_of(module),
            float(module.norm_type), scale_grad_by_freq, module._sparse_gradient())
    if module._table.fused:
        out = cpu_ops.fused_embedding_lookup(*args)
    else:
        out = cpu_ops.embedding_lookup(*args, grad_handle=module._table.handle)
    if module.output_device.type != "cpu":
        out = out.to(module.output_device)
    return out


def small_lookup(module, ids):
    """module(ids) through torch's own embedding op when the call is a
    small plain one (a float32 table; CPU outputs; no row cache, fused
    update or prefetch; cpu_ops.torch_op_serves with TORCH_OP_MAX_IDS),
    else None for the module's full path, which decides everything else. The module's
    checks and the lookup's in one pass: through the full path's layers a
    call of 128 ids cost twice torch's op."""
    table = module._table
    if not isinstance(ids, torch.Tensor) or not ids.is_cpu or ids.dtype not in ID_DTYPES or table.cache is not None \
            or table.fused or table.dtype != torch.float32 or table.prefetch is not None \
            or module._output_device.type != "cpu" or torch.compiler.is_compiling():
        return None
    weight = module._parameters["weight"]
    sparse = module._sparse_gradient()
    if not cpu_ops.torch_op_serves(ids.numel(), cpu_ops.TORCH_OP_MAX_IDS, module.max_norm,
                                   weight.requires_grad and torch.is_grad_enabled(), module.scale_grad_by_freq, sparse):
        return None
    table.check_process()
    if not table.views(weight):  # replaced: the full path adopts it
        return None
    return cpu_ops.torch_op_lookup(weight, ids if ids.is_contiguous() else ids.contiguous(), padding_of(module),
                                   sparse, table)


def padding_of(module):
    return -1 if module.padding_idx is None else module.padding_idx


def max_norm_of(module):
    return None if module.max_norm is None else float(module.max_norm)
