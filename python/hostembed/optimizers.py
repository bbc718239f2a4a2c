"""hostembed.SGD, hostembed.Adagrad and hostembed.RowWiseAdagrad: sparse
optimizers whose update of a hostembed table runs in place in host memory,
in one threaded pass of the C core over the gradient's rows.

SGD and Adagrad are torch's classes with torch's signature, validation,
state keys and numerics (the core computes what torch's sparse-gradient
branch computes: SGD to the bit, Adagrad within an ulp, since torch's
vectorised sqrt is not always correctly rounded); only the hyperparameters
that make a sparse step touch every row are refused for host tables (the
classes say why).
Any other parameter is updated by torch's own step.

``fused=True`` (torch's argument for SGD and Adagrad, keyword-only for
RowWiseAdagrad) applies a host table's update in backward, from the
lookup's output gradient, as SparseAdam(fused=True) does (_fused.py): the
same bits, no weight.grad, step() after each backward. For other
parameters it keeps torch's meaning (its fused kernels).
"""
import torch

from . import _fused, _ops, _validate
from ._cache import flush_optimizer_tables, forget_optimizer_state
from ._lookup_gpu import take_grad_twin
from ._stream import copy_rows
from ._table import table_of


def check_row_sparse(p, grad, name):
    """Refuses a sparse gradient that is not row-sparse and shaped like the
    table p (RuntimeError naming the optimizer)."""
    if grad.shape != p.shape:
        raise RuntimeError(f"{name}: gradient of shape {list(grad.shape)} for a parameter of shape {list(p.shape)}")
    if grad.sparse_dim() != 1:
        # A fully sparse COO tensor a user built (sparse_dim=2) lists
        # elements, and torch updates only those; the core updates whole
        # rows, which would move (and, for Adam, decay the moments of)
        # elements with no gradient. Refused rather than made row-sparse
        # behind the user's back.
        raise RuntimeError(
            f"{name}: a hostembed table takes a row-sparse gradient (sparse_dim=1: indices [1, nnz], values "
            f"[nnz, {p.shape[1]}]), as its backward makes; got a sparse COO gradient with "
            f"sparse_dim={grad.sparse_dim()} and dense_dim={grad.dense_dim()}. Its element-wise semantics (only "
            "the listed elements change) are not supported; to update whole rows instead, pass "
            "grad.coalesce().to_dense().to_sparse(1)"
        )


def row_sparse_gradient(p, table, name):
    """(indices, values) of a host table's gradient p.grad, checked: a
    row-sparse COO tensor shaped like the table. The core sums repeated rows
    itself (autograd never marks what it stores as coalesced)."""
    grad = p.grad
    if not grad.is_sparse:
        raise RuntimeError(f"{name}: a hostembed table takes a sparse gradient (its backward makes one); got a "
                           "dense one")
    check_row_sparse(p, grad, name)
    # Taken (and so released) whatever happens next: it holds GPU memory.
    take_grad_twin(table, grad)
    return grad._indices()[0], grad._values()


def owned_state(table, tensor, per_row=False):
    """tensor as a buffer of `table` that the core may update: itself when
    it is one, else (a state loaded with load_state_dict or set by hand, of
    the right shape) a copy in a new buffer; anything else as it is, for
    the op to refuse with a message."""
    shape = (table.num_rows,) if per_row else (table.num_rows, table.dim)
    if not isinstance(tensor, torch.Tensor) or table.owns(tensor) or not tensor.is_floating_point() \
            or tensor.is_sparse or tensor.device.type != "cpu" or tuple(tensor.shape) != shape:
        return tensor
    copy = table.zeros(per_row=per_row)
    copy_rows(copy.view(table.num_rows, -1), tensor.detach().reshape(table.num_rows, -1))
    return copy


class _HostStep:
    """The part of step() shared by the optimizers here: torch's own step
    for every parameter that is not a host table (their gradients hidden
    from it for the call), then the core's update of each host table."""

    _name = None

    def _host_params(self):
        for group in self.param_groups:
            for p in group["params"]:
                table = table_of(p)
                if table is not None and p.grad is not None:
                    yield p, table, group

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _fused.step_taken(self)
        # Every host gradient is checked before anything is updated.
        host = [(p, table, group, row_sparse_gradient(p, table, self._name))
                for p, table, group in self._host_params()]
        hidden = [(p, p.grad) for p, _, _, _ in host]
        for p, _ in hidden:
            p.grad = None
        try:
            self._torch_step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        for p, table, group, (indices, values) in host:
            self._host_update(p, table, group, indices, values)
        return loss

    def _host_update(self, p, table, group, indices, values):
        kind, state, hyper, record = self._host_args(p, table, group)
        _ops.sparse_update(kind, p, state, indices, values, **hyper)
        # Recorded once the core accepted the gradient.
        if record:
            self.state[p].update(record)

    def _fused_update(self, table, gradients):
        """The update of `table` in backward (fused=True) with the lookup
        gradients of one backward pass (_fused.py calls it at its end)."""
        p, group = _fused.param_of(self, table)
        if len(gradients) == 1 and isinstance(gradients[0], _fused.CpuGradient):
            kind, state, hyper, record = self._host_args(p, table, group)
            _ops.sparse_update_fused(kind, p, state, gradients[0], **hyper)
            if record:
                self.state[p].update(record)
            return
        # Several lookups of the table in one pass (one update of their
        # summed gradient, as unfused), or GPU outputs (their sums copied
        # to the host: these optimizers update on the CPU).
        parts = [_ops.reduce_to_host(table, g) for g in gradients]
        self._host_update(p, table, group, torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts]))

    def _torch_step(self):
        super().step()

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        tables = [t for t in map(table_of, group["params"]) if t is not None]
        if tables:
            try:
                self._check_host_group(group, f"{self._name}")
                if group.get("fused"):
                    _fused.register(self, tables, self._name)
            except Exception:
                self.param_groups.pop()
                raise

    def state_dict(self):
        # A cached table's newest state may be in its cache's records.
        flush_optimizer_tables(self)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, after checking everything it reads (the
        layout, each group's hyperparameters, each parameter's state), so a
        refused state dict (TypeError or ValueError naming the entry) leaves
        the optimizer as it was. A host table's state is copied into the
        table's own memory at the next step."""
        where = f"{self._name}.load_state_dict"
        layout = _validate.optimizer_layout(self, state_dict, where)
        for index, group, pairs in layout:
            group_where = f"{where}: param_groups[{index}]"
            self._check_group(group, group_where)
            for saved_id, p in pairs:
                entry = state_dict["state"].get(saved_id)
                if entry:
                    self._check_state(entry, p, f"{where}: state of parameter {saved_id}")
            if any(table_of(p) is not None for _, p in pairs):
                self._check_host_group(group, group_where)
        # torch's load casts floating state to the parameter's dtype; a host
        # table keeps its state in its compute dtype (float32 for a half
        # table), so those values go in as saved and convert once.
        host_state = [(p, key, value) for _, _, pairs in layout for saved_id, p in pairs
                      if table_of(p) is not None
                      for key, value in (state_dict["state"].get(saved_id) or {}).items()
                      if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()]
        super().load_state_dict(state_dict)
        forget_optimizer_state(self)
        for p, key, value in host_state:
            self.state[p][key] = value.to(device="cpu", dtype=table_of(p).state_dtype)

    def _check_state(self, entry, p, where):
        _validate.check_state_values(entry, p, where)


def _non_negative(group, key, where):
    value = _validate._real(group[key], key, where)
    if not value >= 0.0:
        raise ValueError(f"{where}: Invalid {key} value: expected {key} >= 0, found {value!r}")


def _refuse_differentiable(group, where, name):
    if group.get("differentiable"):
        raise ValueError(f"{where}: {name}'s differentiable implementation does not take hostembed tables (the "
                         "core updates them in place); leave differentiable unset")


class SGD(_HostStep, torch.optim.SGD):
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
        _refuse_differentiable(group, where, "SGD")

    def _host_args(self, p, table, group):
        return _ops.SGD, {}, {"lr": float(group["lr"]), "step": 1, "maximize": bool(group.get("maximize", False))}, {}


class Adagrad(_HostStep, torch.optim.Adagrad):
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
        _validate._require(group, ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"), where)
        for key in ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"):
            _non_negative(group, key, where)
        for key in ("maximize", "differentiable"):
            _validate._flag(group, key, where)

    def _check_host_group(self, group, where):
        if group.get("weight_decay", 0) != 0:
            raise ValueError(f"{where}: weight_decay={group['weight_decay']!r} with a hostembed table: torch's "
                             "Adagrad does not take weight decay with sparse gradients (it raises at step()); "
                             "use weight_decay=0 for host tables")
        _refuse_differentiable(group, where, "Adagrad")

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
        return _ops.ADAGRAD, {"sum": total}, hyper, {"sum": total,
                                                      "step": torch.tensor(float(step), dtype=torch.float32)}


class RowWiseAdagrad(_HostStep, torch.optim.Optimizer):
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
        _validate._require(group, ("lr", "eps", "initial_accumulator_value"), where)
        for key in ("lr", "eps", "initial_accumulator_value"):
            _non_negative(group, key, where)
        _validate._flag(group, "maximize", where)

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
        return _ops.ROWWISE_ADAGRAD, {"row_sum": row_sum}, hyper, {"step": step + 1, "row_sum": row_sum}
