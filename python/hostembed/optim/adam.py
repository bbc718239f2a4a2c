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
    where torch has the kernel.

    Host tables must be float32 or float64 (ValueError for half tables:
    ``torch.optim.Adam`` itself takes them, through a dense gradient).

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables and any other parameters.
        lr (float or Tensor, optional): the learning rate, >= 0 (ValueError
            otherwise), as torch's (a Tensor lr as torch takes it).
            Default: ``1e-3``
        betas (Tuple[float, float], optional): the coefficients used for
            computing the running averages of the gradient and of its
            square, each in ``[0, 1)`` (ValueError otherwise). As torch's
            dense Adam, every row's moments decay at every step, rows
            without gradient included. Default: ``(0.9, 0.999)``
        eps (float, optional): the term added to the denominator to improve
            numerical stability, >= 0 (ValueError otherwise).
            Default: ``1e-8``
        weight_decay (float, optional): weight decay (L2 penalty: the weight
            added to the gradient), >= 0 (ValueError otherwise); on a host
            table, every row every step, as torch's. Default: ``0``
        amsgrad (bool, optional): whether to use the AMSGrad variant (a
            ``max_exp_avg_sq`` state, also for host tables).
            Default: ``False``
        foreach (bool, optional): keyword-only: whether torch's foreach
            implementation steps the other parameters (given, it turns off
            the fused default). Default: None
        maximize (bool, optional): keyword-only: maximize the objective with
            respect to the params, instead of minimizing (host tables too).
            Default: ``False``
        capturable (bool, optional): keyword-only: whether torch's step of
            the other parameters may be captured in a CUDA graph; refused
            in a group with hostembed tables, which the core updates on the
            CPU (ValueError). Default: ``False``
        differentiable (bool, optional): keyword-only: whether autograd goes
            through torch's step of the other parameters; refused in a
            group with hostembed tables (ValueError). Default: ``False``
        fused (bool, optional): keyword-only: torch's meaning, for the other
            parameters: whether torch's fused kernel steps them. None (and
            ``foreach``, ``capturable``, ``differentiable`` not set) means
            fused where torch has the kernel for every other parameter
            (floating, on a device torch's fused Adam runs on), torch's
            default otherwise. Host tables are stepped by the core either
            way (not in backward: :class:`SparseAdam`'s ``fused`` does
            that), and skip a step as torch's fused kernel does when a
            GradScaler found an inf. Default: None
        decoupled_weight_decay (bool, optional): keyword-only, through
            ``**kwargs``: any other keyword of the installed torch's Adam
            goes on to it; ``decoupled_weight_decay=True`` makes it AdamW
            (decoupled decay), host tables included. Default: ``False``
    """

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
    """torch.optim.AdamW as hostembed.Adam is torch.optim.Adam.

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables (float32 or float64) and any other parameters.
        lr (float or Tensor, optional): the learning rate, >= 0 (ValueError
            otherwise). Default: ``1e-3``
        betas (Tuple[float, float], optional): the coefficients used for
            computing the running averages of the gradient and of its
            square, each in ``[0, 1)``; every row's moments decay at every
            step, as torch's. Default: ``(0.9, 0.999)``
        eps (float, optional): the term added to the denominator to improve
            numerical stability, >= 0. Default: ``1e-8``
        weight_decay (float, optional): the decoupled weight decay
            coefficient, >= 0: ``w *= 1 - lr * weight_decay`` on every row at
            every step, before the Adam update, as torch's (unlike
            :class:`SparseAdam`'s lazy decay of the rows a step updates).
            Default: ``1e-2``
        amsgrad (bool, optional): whether to use the AMSGrad variant.
            Default: ``False``
        maximize (bool, optional): keyword-only: maximize the objective with
            respect to the params, instead of minimizing.
            Default: ``False``
        foreach (bool, optional): keyword-only: as :class:`Adam`'s.
            Default: None
        capturable (bool, optional): keyword-only: as :class:`Adam`'s
            (refused with hostembed tables). Default: ``False``
        differentiable (bool, optional): keyword-only: as :class:`Adam`'s
            (refused with hostembed tables). Default: ``False``
        fused (bool, optional): keyword-only: as :class:`Adam`'s (None:
            fused where torch has the kernel for the other parameters).
            Default: None
    """

    _name = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        params, flat = _params_list(params)
        if fused is None and foreach is None and not differentiable and not capturable:
            fused = _fused_by_default(flat)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)
