"""hostembed.Adagrad: torch.optim.Adagrad, whose update of a hostembed
table runs torch's sparse-gradient branch in place in host memory."""
import torch

from .._core.ops import update as update_ops
from .._core.table import table_of
from ..io import validate as _validate
from .base import HostStep, non_negative, owned_state, refuse_differentiable


class Adagrad(HostStep, torch.optim.Adagrad):
    """torch.optim.Adagrad with the same signature, state keys (``step``, a
    float32 0-d tensor, and ``sum``) and numerics: for a hostembed table,
    the core runs torch's sparse-gradient branch in place, in one pass
    (``sum += g*g; w -= clr * g / (sqrt(sum) + eps)`` on the gradient's
    rows, ``clr = lr / (1 + (step - 1) * lr_decay)``): the same ``sum``
    bits as torch's CPU step, the weights within an ulp (torch's
    vectorised sqrt is not always correctly rounded).

    As torch does, the state is made at construction: a host table's
    ``sum`` is a buffer of the table in host memory, whose pages are backed
    as rows are first written (all at once when initial_accumulator_value
    is not 0). weight_decay must be 0 for host tables (torch's Adagrad
    raises for it with any sparse gradient).
    """

    _name = "Adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        # torch's __init__ would allocate each state with full_like(p): a
        # second full table in ordinary memory for a host table. Its checks,
        # then Optimizer's __init__, then the state made where it belongs.
        for key, value in (("learning rate", lr), ("lr_decay value", lr_decay), ("weight_decay value", weight_decay),
                           ("initial_accumulator_value value", initial_accumulator_value),
                           ("epsilon value", eps)):
            if not 0.0 <= value:
                raise ValueError(f"Invalid {key}: {value}")
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                    "initial_accumulator_value": initial_accumulator_value, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable, "fused": fused}
        torch.optim.Optimizer.__init__(self, params, defaults)
        if fused:
            # torch's own constructor does this for its fused path.
            self._need_device_dtype_check_for_fused = True
            self._step_supports_amp_scaling = True
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p, group):
        state = self.state[p]
        table = table_of(p)
        if table is None:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                           memory_format=torch.preserve_format)
            return
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        total = table.zeros()
        if group["initial_accumulator_value"] != 0:
            total.fill_(group["initial_accumulator_value"])
        state["sum"] = total

    def _check_group(self, group, where):
        _validate.require_keys(group, ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"), where)
        for key in ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"):
            non_negative(group, key, where)
        for key in ("maximize", "differentiable"):
            _validate.flag(group, key, where)

    def _check_host_group(self, group, where):
        if group.get("weight_decay", 0) != 0:
            raise ValueError(f"{where}: weight_decay={group['weight_decay']!r} with a hostembed table: torch's "
                             "Adagrad does not take weight decay with sparse gradients (it raises at step()); "
                             "use weight_decay=0 for host tables")
        refuse_differentiable(group, where, "Adagrad")

    def _check_state(self, entry, p, where):
        super()._check_state(entry, p, where)
        if table_of(p) is not None and set(entry) != {"step", "sum"}:
            raise ValueError(f"{where}: expected the keys ['step', 'sum'], found {sorted(map(repr, entry))}")

    def _host_args(self, p, table, group):
        state = self.state[p]
        if "sum" not in state:  # a group added after construction
            self._init_state(p, group)
        total = owned_state(table, state["sum"])
        step = int(state["step"].item() if isinstance(state["step"], torch.Tensor) else state["step"]) + 1
        hyper = {"lr": float(group["lr"]), "eps": float(group["eps"]), "lr_decay": float(group["lr_decay"]),
                 "step": step, "maximize": bool(group.get("maximize", False))}
        return update_ops.ADAGRAD, {"sum": total}, hyper, {"sum": total,
                                                      "step": torch.tensor(float(step), dtype=torch.float32)}
