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
