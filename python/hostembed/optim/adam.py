"""Adam over host tables with torch's results: every row, every step, as
torch.optim.Adam and AdamW step a dense gradient, done by the core in one
streaming pass without one (_core/ops/update.py's dense_adam).

table_step is the step of one table; two ways reach it:
* the plain swap: torch.optim.Adam or AdamW itself, through the step hooks
  of torch_optimizers.py (the script unchanged);
* hostembed.Adam and hostembed.AdamW, one optimizer for a whole model:
  the tables by the core, the other parameters by torch's own step, with
  its fused kernel by default (``fused=None`` means fused where torch has
  the kernel for them). They also run closures, which the hooks cannot
  (a closure there means the dense route).
The state is torch's, in optimizer.state: state_dict() loads into
torch.optim.Adam and back.
"""
import torch

from .._core.ops import update as update_ops
from .._core.table import table_of
from ..io import validate as _validate
from .base import HostStep, owned_state, refuse_differentiable, scalar_dtype


def table_step(optimizer, p, table, group, indices, values):
    """torch's Adam/AdamW step of `p` (a host table) from the rows of its
    gradient (indices, values), every other row's gradient zero, with the
    state in optimizer.state[p] as torch keeps it.

    Under a GradScaler, an optimizer whose step takes the scaling (fused
    Adam) carries grad_scale and found_inf for the step: as torch's fused
    kernel does, the step is skipped, its count too, when an inf was found,
    and the gradient divided by grad_scale otherwise."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and float(found_inf) != 0:
        return
    grad_scale = getattr(optimizer, "grad_scale", None)
    if grad_scale is not None:
        values = values / grad_scale.to(device=values.device, dtype=values.dtype)
    amsgrad = bool(group["amsgrad"])
    state = optimizer.state[p]
    if len(state) == 0:
        # As torch's _init_group: a 0-d step, moments shaped like p (here
        # buffers of the table, whose pages are backed as they are written).
        state["step"] = torch.tensor(0.0, dtype=scalar_dtype(bool(group.get("fused"))))
        state["exp_avg"] = table.zeros()
        state["exp_avg_sq"] = table.zeros()
        if amsgrad:
            state["max_exp_avg_sq"] = table.zeros()
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    for key in keys:
        if key not in state:  # amsgrad switched on in a loaded group: torch would fail; start it at zero
            state[key] = table.zeros()
        # A state loaded by load_state_dict is torch's own tensor: copied
        # into a buffer of the table, once.
        state[key] = owned_state(table, state[key])
    step_t = state["step"]
    step = int(step_t.item()) + 1 if isinstance(step_t, torch.Tensor) else int(step_t) + 1
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    update_ops.dense_adam(p, state, indices, values, lr=float(group["lr"]), beta1=beta1,
                          beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                          step=step, decoupled=decoupled, amsgrad=amsgrad, maximize=bool(group["maximize"]),
                          name=type(optimizer).__name__)
    # Counted once the core took the gradient, as torch counts a step.
    if isinstance(step_t, torch.Tensor):
        step_t += 1
    else:
        state["step"] = step


def _fused_by_default(params):
    """torch's fused Adam where it has the kernel for every parameter that
    is not a host table (floating, on a device torch's fused Adam runs on)."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        devices = _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch: no fused CPU kernel to choose
        return None
    dense = [p for p in params if table_of(p) is None]
    if dense and all(p.is_floating_point() and p.device.type in devices for p in dense):
        return True
    return None


class _TableAdam(HostStep):
    """The part Adam and AdamW share: HostStep's step (torch's own step for
    the other parameters, their host gradients hidden from it), with
    table_step as each host table's update."""

    _fused_in_backward = False

    def _check_group(self, group, where):
        _validate.check_torch_group(self, group, where)

    def _check_host_group(self, group, where):
        refuse_differentiable(group, where, self._name)
        for p in group["params"]:
            table = table_of(p) if isinstance(p, torch.Tensor) else None  # a loaded group lists ids
            if table is not None and table.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"{where}: a {table.dtype} hostembed table: {self._name} steps float32 and float64 "
                                 "tables (torch.optim.Adam itself takes half tables, through a dense gradient)")
        if group.get("capturable"):
            raise ValueError(f"{where}: capturable=True does not take hostembed tables (the core updates them on "
                             "the CPU); leave capturable unset")

    def _host_update(self, p, table, group, indices, values):
        table_step(self, p, table, group, indices, values)

    def _host_updates(self, host):
        for p, table, group, (indices, values) in host:
            self._host_update(p, table, group, indices, values)


def _params_list(params):
    """(params as torch takes them, each group's iterable read once into a
    list: a generator cannot be read twice; the parameters themselves, for
    the fused check, unwrapped from named_parameters' (name, p) pairs)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        params = [dict(group, params=[group["params"]] if isinstance(group["params"], torch.Tensor)
                       else list(group["params"])) for group in params]
        flat = [p for group in params for p in group["params"]]
    else:
        flat = params
    return params, [p[1] if isinstance(p, tuple) else p for p in flat]


class Adam(_TableAdam, torch.optim.Adam):
    """torch.optim.Adam with the same signature, state and results (within
    twice torch's own float32 error of a float64 run: torch's CPU sqrt is
    not correctly rounded, the core's is), for a whole model: a hostembed
    table's step by the core over every row without a dense gradient, every
    other parameter by torch's step, fused by default (``fused=None``)
    where torch has the kernel."""

    _name = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, fused=None, **kwargs):
        params, flat = _params_list(params)
        if fused is None and foreach is None and not differentiable and not capturable:
            fused = _fused_by_default(flat)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, **kwargs)


class AdamW(_TableAdam, torch.optim.AdamW):
    """torch.optim.AdamW as hostembed.Adam is torch.optim.Adam."""

    _name = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        params, flat = _params_list(params)
        if fused is None and foreach is None and not differentiable and not capturable:
            fused = _fused_by_default(flat)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)
