"""hostembed.SGD: torch.optim.SGD, whose update of a hostembed table runs
in place in host memory (the same bits as torch's CPU step on a sparse
gradient)."""
import torch

from .._core.ops import update as update_ops
from ..io import validate as _validate
from .base import HostStep, refuse_differentiable


class SGD(HostStep, torch.optim.SGD):
    """torch.optim.SGD with the same signature; a hostembed table's step is
    ``w -= lr * g`` on the gradient's rows, done in place by the core (the
    same bits as torch's CPU step on a sparse gradient).

    For host tables, momentum and weight_decay must be 0 (ValueError
    otherwise): on a sparse gradient torch's momentum buffer keeps every
    row ever touched and decays and applies all of them at every step, and
    weight decay adds the whole dense weight to the gradient, so either
    turns each step into a pass over every row touched so far — the
    opposite of what a sparse table is for. (For a per-row adaptive step,
    use RowWiseAdagrad or SparseAdam.) Other parameters take them as usual.

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables and any other parameters. Put parameters that need
            momentum or weight decay in a group of their own.
        lr (float or Tensor, optional): the learning rate, >= 0 (ValueError
            otherwise; a Tensor lr must have one element). Default: ``1e-3``
        momentum (float, optional): the momentum factor, >= 0 (ValueError
            otherwise); must be 0 in a group with hostembed tables
            (ValueError), see above. Default: ``0``
        dampening (float, optional): dampening for momentum; with momentum 0
            (as host tables have it) it changes nothing. Default: ``0``
        weight_decay (float, optional): weight decay (L2 penalty), >= 0
            (ValueError otherwise); must be 0 in a group with hostembed
            tables (ValueError), see above. Default: ``0``
        nesterov (bool, optional): enables Nesterov momentum; as torch's, it
            needs a momentum > 0 and zero dampening (ValueError otherwise),
            so not in a group with hostembed tables. Default: ``False``
        maximize (bool, optional): keyword-only: maximize the objective with
            respect to the params, instead of minimizing (host tables too:
            ``w += lr * g``). Default: ``False``
        foreach (bool, optional): keyword-only: whether torch's foreach
            implementation steps the other parameters (None: torch's choice,
            foreach on CUDA); host tables are always updated by the core.
            Default: None
        differentiable (bool, optional): keyword-only: whether autograd goes
            through torch's step of the other parameters; not in a group
            with hostembed tables, which the core updates in place
            (ValueError). Default: ``False``
        fused (bool, optional): keyword-only: True applies each hostembed
            table's update in backward, from the lookup's output gradient
            (the same bits, no ``weight.grad``; step() after each backward,
            as :class:`SparseAdam`'s ``fused``), and keeps torch's meaning
            for the other parameters (torch's fused implementation; not with
            ``foreach=True`` or ``differentiable=True``, RuntimeError). A
            table already updated in backward by another fused optimizer
            raises ValueError. Default: None (not fused)
    """

    _name = "SGD"

    def _check_group(self, group, where):
        _validate.check_torch_group(self, group, where)

    def _check_host_group(self, group, where):
        for key in ("momentum", "weight_decay"):
            if group.get(key, 0) != 0:
                raise ValueError(
                    f"{where}: {key}={group[key]!r} with a hostembed table: on a sparse gradient torch's SGD "
                    f"{'keeps a momentum buffer of every row ever touched and updates all of them' if key == 'momentum' else 'adds the whole dense weight to the gradient'} "
                    "at every step; hostembed tables take momentum=0 and weight_decay=0 (put other parameters "
                    "in their own group or optimizer)")
        refuse_differentiable(group, where, "SGD")

    def _host_args(self, p, table, group):
        return update_ops.SGD, {}, {"lr": float(group["lr"]), "step": 1, "maximize": bool(group.get("maximize", False))}, {}
