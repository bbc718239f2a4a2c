"""hostembed.Adagrad: torch.optim.Adagrad, whose update of a hostembed
table runs torch's sparse-gradient branch in place in host memory."""
import torch

from .._core.ops import update as update_ops
from .._core.table import table_of
from .._core.table_files import fill_state
from ..io import validate as _validate
from .base import HostStep, non_negative, owned_state, refuse_differentiable
from .compact_state import CODE_DTYPES, StateForm, check_saved, scale_key

_SUM_SCALE = scale_key("sum")


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

    The keyword-only ``state_dtype`` and ``state_rounding`` hold for the
    whole optimizer: they are in ``defaults`` and in every param group, and
    a param group that asks another value raises ValueError.

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables and any other parameters.
        lr (float or Tensor, optional): the learning rate, >= 0 (ValueError
            otherwise). Default: ``1e-2``
        lr_decay (float, optional): the learning rate decay, >= 0
            (ValueError otherwise): step t uses
            ``lr / (1 + (t - 1) * lr_decay)``. Default: ``0``
        weight_decay (float, optional): weight decay (L2 penalty), >= 0
            (ValueError otherwise); must be 0 in a group with hostembed
            tables (ValueError), see above. Default: ``0``
        initial_accumulator_value (float, optional): the initial value of
            the sum of squares of gradients (``sum``), >= 0 (ValueError
            otherwise). Default: ``0``
        eps (float, optional): the term added to the denominator to improve
            numerical stability, >= 0 (ValueError otherwise).
            Default: ``1e-10``
        foreach (bool, optional): whether torch's foreach implementation
            steps the other parameters (None: torch's choice, foreach on
            CUDA); host tables are always updated by the core.
            Default: None
        maximize (bool, optional): keyword-only: maximize the objective with
            respect to the params, instead of minimizing (host tables too).
            Default: ``False``
        differentiable (bool, optional): keyword-only: whether autograd goes
            through torch's step of the other parameters; not in a group
            with hostembed tables, which the core updates in place
            (ValueError). Default: ``False``
        fused (bool, optional): keyword-only: True applies each hostembed
            table's update in backward, from the lookup's output gradient
            (the same bits, no ``weight.grad``; step() after each backward,
            as :class:`SparseAdam`'s ``fused``), and keeps torch's meaning
            for the other parameters (torch's fused CPU implementation). A
            table already updated in backward by another fused optimizer
            raises ValueError. Default: None (not fused)
        state_dtype (torch.dtype, optional): keyword-only; hostembed tables
            only: keeps ``sum`` in torch.float32 (torch's Adagrad exactly),
            torch.bfloat16, torch.float16, or torch.int8 (uint8 codes of its
            square root and a float32 ``sum_scale`` per 256 columns of a
            row); the strings and None as :class:`SparseAdam`'s
            ``state_dtype`` (ValueError for anything else).
            Default: ``torch.float32``
        state_rounding (str, optional): keyword-only: how updated compact
            ``sum`` values are stored: rounded to ``"nearest"`` or
            ``"stochastic"`` (unbiased), as :class:`SparseAdam`'s (ValueError
            for any other). Default: ``"nearest"``
    """

    _name = "Adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, state_dtype=torch.float32,
                 state_rounding="nearest"):
        self._form = StateForm(state_dtype, state_rounding, "Adagrad")
        self._wide = {"state_dtype": self._form.dtype, "state_rounding": state_rounding}
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
                    "maximize": maximize, "differentiable": differentiable, "fused": fused, **self._wide}
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
        initial = group["initial_accumulator_value"]
        if self._form.compact and initial != 0:
            # A table of one value, in the form (quantized once, as a load).
            value = torch.tensor(float(initial), dtype=torch.float32).expand(table.num_rows)
            state.update(self._form.convert(table, "sum", True, False, value, None))
            return
        state.update(self._form.new(table, "sum", nonnegative=True))
        if initial != 0:
            fill_state(table, state["sum"], initial)

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
        table = table_of(p)
        if table is None:
            super()._check_state(entry, p, where)
            return
        if set(entry) - {_SUM_SCALE} != {"step", "sum"}:
            raise ValueError(f"{where}: expected the keys ['step', 'sum'] (and 'sum_scale' for 8-bit codes), found "
                             f"{sorted(map(repr, entry))}")
        _validate.check_step(entry["step"], where)
        check_saved(entry["sum"], entry.get(_SUM_SCALE), "sum", p, where, per_row_ok=False)

    def load_state_dict(self, state_dict):
        """HostStep's load; a host table's ``sum`` saved in any form (float,
        half or 8-bit) is converted into this optimizer's form."""
        # (torch's load alone serves a float state into float32 state)
        saved = {p: entry for p, entry in self._saved_host_state(state_dict)
                 if self._form.compact or entry["sum"].dtype in CODE_DTYPES}
        super().load_state_dict(state_dict)
        for p, entry in saved.items():
            state = self.state[p]
            state.pop(_SUM_SCALE, None)
            state.update(self._form.convert(table_of(p), "sum", True, False, entry["sum"], entry.get(_SUM_SCALE)))

    def _saved_host_state(self, state_dict):
        """(parameter, saved entry) of each host table with a saved state,
        before torch's load casts it."""
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict.get("param_groups", []) for i in group.get("params", [])]
        return [(p, state_dict["state"][i]) for p, i in zip(params, saved_ids)
                if table_of(p) is not None and state_dict.get("state", {}).get(i)]

    def _host_args(self, p, table, group):
        state = self.state[p]
        if "sum" not in state:  # a group added after construction
            self._init_state(p, group)
        step = int(state["step"].item() if isinstance(state["step"], torch.Tensor) else state["step"]) + 1
        hyper = {"lr": float(group["lr"]), "eps": float(group["eps"]), "lr_decay": float(group["lr_decay"]),
                 "step": step, "maximize": bool(group.get("maximize", False))}
        record = {"step": torch.tensor(float(step), dtype=torch.float32)}
        if self._form.compact:  # updated in place in its own buffers
            return update_ops.ADAGRAD, {"sum": self._form.core_item(table, state, "sum")}, hyper, record
        total = owned_state(table, state["sum"])
        return update_ops.ADAGRAD, {"sum": total}, hyper, dict(record, sum=total)
