"""Gradient clipping that works with row-sparse embedding gradients.

torch.nn.utils.clip_grad_norm_ failed on sparse gradients (linalg_vector_norm
has no sparse kernel), for torch's own sparse embeddings as well as
hostembed's: importing hostembed registers the kernels torch lacks
(_core/ops/sparse_aten.py), so torch's own clip_grad_norm_, get_total_norm
and clip_grad_value_ take them. This module's clip_grad_norm_ is the same
arithmetic, and also says when a fused table has no gradient to clip. The
norm of a coalesced sparse gradient is the norm of its values (the rows not
present are zero), so clipping needs only its values.
"""
import math

import torch

from .._core import fused as _fused
from .._core.ops import sparse_aten  # noqa: F401  (registers the sparse kernels torch's utilities need)
from .._core.table import table_of


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """``torch.nn.utils.clip_grad_norm_`` for parameters whose gradients may be
    sparse COO tensors (hostembed tables, nn.Embedding(sparse=True)).

    The total norm is taken over every gradient together, as torch does,
    and every gradient is scaled in place by max_norm / (total + 1e-6) when
    that is below 1. A sparse gradient is coalesced first (duplicate rows,
    left by several backward() calls, must be summed before a norm is
    taken). Returns the total norm as a float32 tensor.

    Args:
        parameters (Tensor or iterable of Tensor): the parameters whose
            gradients are clipped (those without a gradient are skipped). A
            table updated in backward by a ``fused=True`` optimizer has no
            gradient to clip: RuntimeError.
        max_norm (float): the largest total norm the gradients keep.
        norm_type (float, optional): the p of the p-norm, as torch's
            (``float("inf")`` for the largest absolute value).
            Default: ``2.0``
        error_if_nonfinite (bool, optional): if True, a total norm that is
            nan or inf raises RuntimeError (nothing is scaled), as torch's.
            Default: ``False``

    Returns:
        Tensor: the total norm of the gradients (viewed as a single
        vector), a float32 tensor on the CPU (0 without any gradient).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    for p in parameters:
        table = table_of(p)
        if table is not None and _fused.optimizer_of(table) is not None:
            # Its update already ran in backward: clipping the others alone
            # would scale a different total than the caller asked for.
            raise RuntimeError(
                f"hostembed.clip_grad_norm_: a table updated by {type(_fused.optimizer_of(table)).__name__}"
                "(fused=True) has no gradient to clip (its update is applied in backward); use fused=False to "
                "clip it, or leave the table out of the clipped parameters")
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not params:
        return torch.tensor(0.0)
    norms = []
    for p in params:
        if p.grad.is_sparse:
            if not p.grad.is_coalesced():
                p.grad = p.grad.coalesce()
            values = p.grad._values()
        else:
            values = p.grad
        norms.append(torch.linalg.vector_norm(values.detach(), norm_type).to(torch.float32).cpu())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            target = p.grad._values() if p.grad.is_sparse else p.grad
            target.mul_(coef.to(device=target.device, dtype=target.dtype))
    return total
