"""The CPU path of hostembed.Embedding: the core's threads gather rows into
host memory; outputs go to another device with one copy."""
from ..._core.ids import prepare_ids
from ..._core.ops import cpu as cpu_ops


def lookup(module, ids, scale_grad_by_freq=None):
    """module.weight[ids] (autograd through the core's lookup op), with the
    module's options; scale_grad_by_freq overrides the module's."""
    if scale_grad_by_freq is None:
        scale_grad_by_freq = module.scale_grad_by_freq
    lookup_fn = cpu_ops.fused_embedding_lookup if module._table.fused else cpu_ops.embedding_lookup
    # _parameters, not module.weight: forward checked the weight already
    # (the attribute's own checks cost as much as a small gather).
    out = lookup_fn(module._parameters["weight"], prepare_ids(ids), padding_of(module), max_norm_of(module), float(module.norm_type),
                    scale_grad_by_freq, module._sparse_gradient())
    if module.output_device.type != "cpu":
        out = out.to(module.output_device)
    return out


def padding_of(module):
    return -1 if module.padding_idx is None else module.padding_idx


def max_norm_of(module):
    return None if module.max_norm is None else float(module.max_norm)
