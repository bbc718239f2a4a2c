"""hostembed.RowWiseAdagrad: Adagrad with one accumulator per row, for
hostembed tables only."""
import torch

from .._core import fused as _fused
from .._core.ops import update as update_ops
from .._core.table import table_of
from ..io import validate as _validate
from .base import HostStep, non_negative, owned_state


class RowWiseAdagrad(HostStep, torch.optim.Optimizer):
    """Adagrad with one accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD,
    without weight decay), for hostembed tables only: its state is 4 bytes
    a row instead of Adam's 8 bytes an element. On the gradient's rows:

        row_sum += mean(g * g over the row)
        w       -= lr / (sqrt(row_sum) + eps) * g

    in the table's compute dtype (float32; float64 for a float64 table),
    the squares summed in column order, then divided by the row's length
    (``maximize`` negates g). State keys: ``step`` (an int, the steps
    taken) and ``row_sum`` (a tensor of that dtype, of shape
    [num_embeddings], made at the first step; pages backed as rows are
    first written). Other parameters are refused: use torch.optim.Adagrad.
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
        if fused:
            _fused.warn_if_distributed("RowWiseAdagrad")
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value,
                                  "maximize": maximize, "fused": fused})

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if table_of(p) is None:
                    raise ValueError(
                        f"RowWiseAdagrad updates hostembed tables only; got a parameter of shape {list(p.shape)} "
                        "that is not one (use torch.optim.Adagrad, or another optimizer, for the other parameters)")
            if group["fused"]:
                _fused.register(self, [table_of(p) for p in group["params"]], self._name)
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
        pass  # no other parameters

    def _check_state(self, entry, p, where):
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
