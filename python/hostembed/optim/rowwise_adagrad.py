"""hostembed.RowWiseAdagrad: Adagrad with one accumulator per row for
hostembed tables (torch's Adagrad for the other parameters)."""
import torch
from torch.optim import adagrad as torch_adagrad

from .._core import fused as _fused
from .._core.ops import update as update_ops
from .._core.table import table_of
from ..io import validate as _validate
from .base import HostStep, non_negative, owned_state, scalar_dtype


class RowWiseAdagrad(HostStep, torch.optim.Optimizer):
    """Adagrad with one accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD,
    without weight decay) for hostembed tables: its state is 4 bytes a row
    instead of Adam's 8 bytes an element. On the gradient's rows:

        row_sum += mean(g * g over the row)
        w       -= lr / (sqrt(row_sum) + eps) * g

    in the table's compute dtype (float32; float64 for a float64 table),
    the squares summed in 8 lanes (column j in lane j mod 8, each lane in
    column order, the lanes then added as ((0+1)+(2+3))+((4+5)+(6+7))),
    then divided by the row's length
    (``maximize`` negates g). State keys: ``step`` (an int, the steps
    taken) and ``row_sum`` (a tensor of that dtype, of shape
    [num_embeddings], made at the first step; pages backed as rows are
    first written). Other parameters (a whole model's dense layers) get
    torch.optim.Adagrad's step with the same lr, eps,
    initial_accumulator_value and maximize, in its state layout (``step``,
    ``sum``).

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables and any other parameters.
        lr (float, optional): the learning rate, a number >= 0 (ValueError
            otherwise; not a Tensor). Default: ``1e-2``
        eps (float, optional): the term added to the denominator to improve
            numerical stability, >= 0 (ValueError otherwise).
            Default: ``1e-10``
        initial_accumulator_value (float, optional): the initial value of
            each row's ``row_sum`` (and of torch's ``sum`` for the other
            parameters), >= 0 (ValueError otherwise). Default: ``0.0``
        maximize (bool, optional): keyword-only: maximize the objective with
            respect to the params, instead of minimizing (g negated); a
            non-bool raises TypeError. Default: ``False``
        fused (bool, optional): keyword-only: True applies each hostembed
            table's update in backward, from the lookup's output gradient
            (the same bits, no ``weight.grad``; step() after each backward,
            as :class:`SparseAdam`'s ``fused``); the other parameters are
            stepped by step() as usual. A table already updated in backward
            by another fused optimizer raises ValueError; a non-bool raises
            TypeError. Default: ``False``
    """

    _name = "RowWiseAdagrad"

    def __init__(self, params, lr=1e-2, eps=1e-10, initial_accumulator_value=0.0, *, maximize=False, fused=False):
        for key, value in (("learning rate", lr), ("epsilon value", eps),
                           ("initial_accumulator_value value", initial_accumulator_value)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value:
                raise ValueError(f"Invalid {key}: {value!r}")
        for key, value in (("maximize", maximize), ("fused", fused)):
            if not isinstance(value, bool):
                raise TypeError(f"RowWiseAdagrad: {key} must be a bool, got {value!r}")
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value,
                                  "maximize": maximize, "fused": fused})

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        tables = [t for t in map(table_of, group["params"]) if t is not None]
        try:
            if group["fused"] and tables:
                _fused.register(self, tables, self._name)
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group, where):
        _validate.require_keys(group, ("lr", "eps", "initial_accumulator_value"), where)
        for key in ("lr", "eps", "initial_accumulator_value"):
            non_negative(group, key, where)
        _validate.flag(group, "maximize", where)

    def _check_host_group(self, group, where):
        pass

    def _torch_step(self):
        """torch's Adagrad for the parameters that are not host tables (their
        gradients are the only ones left visible)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                    state["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                                   memory_format=torch.preserve_format)
            if params:
                torch_adagrad.adagrad(params, [p.grad for p in params], [self.state[p]["sum"] for p in params],
                                      [self.state[p]["step"] for p in params],
                                      has_sparse_grad=any(p.grad.is_sparse for p in params), lr=group["lr"],
                                      weight_decay=0.0, lr_decay=0.0, eps=group["eps"], maximize=group["maximize"])

    def _check_state(self, entry, p, where):
        if table_of(p) is None:
            super()._check_state(entry, p, where)
            if set(entry) != {"step", "sum"}:
                raise ValueError(f"{where}: expected the keys ['step', 'sum'], found {sorted(map(repr, entry))}")
            return
        if set(entry) != {"step", "row_sum"}:
            raise ValueError(f"{where}: expected the keys ['row_sum', 'step'], found {sorted(map(repr, entry))}")
        _validate.check_step(entry["step"], where)
        value = entry["row_sum"]
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided or not value.is_floating_point() \
                or value.is_meta or value.is_complex():
            raise TypeError(f"{where}: 'row_sum' must be a real floating tensor, found "
                            f"{_validate.describe(value)}")
        if tuple(value.shape) != (p.shape[0],):
            raise _validate.DoesNotFit(f"{where}: state 'row_sum' has shape {list(value.shape)}, expected "
                                       f"[{p.shape[0]}] (one value per row)")

    def _host_args(self, p, table, group):
        state = self.state.get(p)  # not self.state[p]: a defaultdict would add an entry
        if state:
            row_sum = owned_state(table, state["row_sum"].to(table.state_dtype), per_row=True)
            step = state["step"]
            step = int(step.item() if isinstance(step, torch.Tensor) else step)
        else:
            row_sum, step = table.zeros(per_row=True), 0
            if group["initial_accumulator_value"] != 0:
                row_sum.fill_(group["initial_accumulator_value"])
        hyper = {"lr": float(group["lr"]), "eps": float(group["eps"]), "step": step + 1,
                 "maximize": bool(group["maximize"])}
        return update_ops.ROWWISE_ADAGRAD, {"row_sum": row_sum}, hyper, {"step": step + 1, "row_sum": row_sum}
