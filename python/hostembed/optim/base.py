"""What hostembed's optimizers share: the checks of a host table's sparse
gradient, its state as buffers the core may update in place, and HostStep,
the step() of SGD, Adagrad and RowWiseAdagrad (torch's own step for every
other parameter, then the core's update of each host table; the update in
backward with fused=True).

Adding an optimizer: a row-update function in the core (csrc/optimizers.h
says how: a kind, a row function, its state layout), its kind in
_core/ops/update.py, then a file here with a torch.optim class over
HostStep whose _host_args names the kind, the state buffers (from
HostTable.zeros) and the hyperparameters; export it from optim/__init__.py.
"""
import functools
from itertools import chain

import torch
import torch.optim.optimizer as _torch_optimizer

from .._cache.row_cache import flush_optimizer_tables, forget_optimizer_state
from .._core import fused as _fused
from .._core.ops import update as update_ops
from .._core.ops.gpu import take_grad_twin
from .._core.table import table_of
from ..io import validate as _validate
from ..io.stream import copy_rows


def check_row_sparse(p, grad, name):
    """Refuses a sparse gradient that is not row-sparse and shaped like the
    table p (RuntimeError naming the optimizer)."""
    table = table_of(p)
    if table is not None:
        table.check_process()  # a forked child's table p is emptied: say why, not that the shapes differ
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


def scalar_dtype(fused=False):
    """The dtype torch gives an Adam or Adagrad step count: float32, or
    float64 under a float64 default dtype (float32 for fused steps)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32


def _hooks_without_idle_profiling(step):
    """step() with what torch's Optimizer.profile_hook_step wraps around an
    optimizer's step (the global and the optimizer's pre- and post-hooks,
    _optimizer_step_code), but its record_function only while a profiler
    runs: entering one costs ~20 us whether a profiler listens or not, a
    third of a fused step's time. Marked hooked, so torch does not wrap it
    again; where torch keeps its hooks elsewhere, torch's wrapper."""
    pre_hooks = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
    post_hooks = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
    profiled = torch.optim.Optimizer.profile_hook_step(step)
    if pre_hooks is None or post_hooks is None:
        return profiled

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        if torch.autograd._profiler_enabled():
            return profiled(self, *args, **kwargs)
        for pre_hook in chain(pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, (self, *args), kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{step} must return None or a tuple of (new_args, new_kwargs), but got "
                                       f"{result}.")
                (self, *args), kwargs = result
        out = step(self, *args, **kwargs)
        self._optimizer_step_code()
        for post_hook in chain(self._optimizer_step_post_hooks.values(), post_hooks.values()):
            post_hook(self, (self, *args), kwargs)
        return out

    wrapper.hooked = True
    return wrapper


class HostStep:
    """The part of step() shared by the optimizers here: torch's own step
    for every parameter that is not a host table (their gradients hidden
    from it for the call), then the core's update of each host table."""

    _name = None
    _wide = {}  # keywords that hold for the whole optimizer (keep_optimizer_wide)
    # fused=True means the update in backward (_core/fused.py); Adam and
    # AdamW keep torch's meaning (its fused kernel for the other parameters).
    _fused_in_backward = True

    @_hooks_without_idle_profiling
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            return self._step(loss)

    def _step(self, loss):
        _fused.step_taken(self)
        # Every host gradient is checked before anything is updated.
        host, others = [], False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                table = table_of(p)
                if table is None:
                    others = True
                else:
                    host.append((p, table, group, row_sparse_gradient(p, table, self._name)))
        if others:
            # torch's step for the other parameters (it skips those without
            # a gradient, so it is not called when only tables have one: its
            # loops cost as much as a small table's update).
            hidden = [(p, p.grad) for p, _, _, _ in host]
            for p, _ in hidden:
                p.grad = None
            try:
                self._torch_step()
            finally:
                for p, grad in hidden:
                    p.grad = grad
        if host:
            self._host_updates(host)
        return loss

    def _host_updates(self, host):
        """Each (p, table, group, (indices, values)) of one step's host
        tables updated: in one call of the core (small tables side by
        side), every one checked before any is written."""
        updates, records = [], []
        for p, table, group, (indices, values) in host:
            kind, state, hyper, record = self._host_args(p, table, group)
            updates.append((kind, p, state, indices, values, hyper))
            records.append((p, record))
        update_ops.sparse_update_many(updates)
        # Recorded once the core accepted the gradients.
        for p, record in records:
            if record:
                self.state[p].update(record)

    def zero_grad(self, set_to_none=True):
        # torch's own, with its record_function (~10 us a call), only for a
        # profiler to see or to zero gradients in place; dropping them is
        # all torch's does otherwise (a fused table never has one).
        if set_to_none and not torch.autograd._profiler_enabled():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = None
            return
        super().zero_grad(set_to_none)

    def _host_update(self, p, table, group, indices, values):
        kind, state, hyper, record = self._host_args(p, table, group)
        update_ops.sparse_update(kind, p, state, indices, values, **hyper)
        # Recorded once the core accepted the gradient.
        if record:
            self.state[p].update(record)

    def _fused_update_many(self, items):
        """The updates in backward (fused=True) of each (table, its lookup
        gradients) one backward pass reached (_core/fused.py calls it at the
        pass's end). A table looked up once on the CPU, the usual case, gets
        the core's fused pass; those tables go to the core in one call
        (small ones are updated side by side there)."""
        batch, found = [], {}
        for table, gradients in items:
            p, group = _fused.param_of(self, table, found)
            if len(gradients) == 1 and isinstance(gradients[0], _fused.CpuGradient):
                kind, state, hyper, record = self._host_args(p, table, group)
                batch.append((p, record, (kind, p, state, gradients[0], hyper)))
            else:
                # Several lookups of the table in one pass (one update of
                # their summed gradient, as unfused), GPU outputs (their
                # sums copied to the host: these optimizers update on the
                # CPU), or a shared table's rows after the exchange.
                parts = [update_ops.reduce_to_host(table, g) for g in gradients]
                self._host_update(p, table, group, *update_ops.joined(parts))
        update_ops.sparse_update_fused_many([update for _, _, update in batch])
        for p, record, _ in batch:
            if record:
                self.state[p].update(record)

    def _torch_step(self):
        # torch's step without the hooks torch wraps around it: they ran
        # around this optimizer's own step() already.
        step = super().step.__func__
        if getattr(step, "hooked", False):  # torch's profile_hook_step wrapper
            step = step.__wrapped__
        step(self)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            keep_optimizer_wide(self, group)
        except ValueError:
            self.param_groups.pop()
            raise
        tables = [t for t in map(table_of, group["params"]) if t is not None]
        if tables:
            try:
                self._check_host_group(group, f"{self._name}")
                if group.get("fused") and self._fused_in_backward:
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
        restore_optimizer_wide(self)
        forget_optimizer_state(self)
        for p, key, value in host_state:
            self.state[p][key] = value.to(device="cpu", dtype=table_of(p).state_dtype)

    def _check_state(self, entry, p, where):
        _validate.check_state_values(entry, p, where)


def keep_optimizer_wide(optimizer, group):
    """Puts the optimizer's whole-optimizer keywords (its state form,
    fused, update: optimizer._wide) in a param group with the constructor's
    values. torch keeps every constructor keyword in ``defaults`` and each
    group, and code that rebuilds an optimizer from its state_dict's groups
    (PyKEEN's training loop: ``cls(params=..., **group)``) counts on it. A
    group that asks another value is refused: these hold for the whole
    optimizer."""
    for key, value in optimizer._wide.items():
        asked = group.setdefault(key, value)
        if asked is not value and asked != value:
            raise ValueError(f"{type(optimizer).__name__}: {key} holds for the whole optimizer, which was built with "
                             f"{key}={value!r}; a param group asks {key}={asked!r} (build another optimizer for "
                             "those parameters)")


def restore_optimizer_wide(optimizer):
    """After torch's load_state_dict, which replaces the groups with the
    saved ones: the whole-optimizer keywords are this optimizer's (a saved
    state in another form was converted into its form)."""
    for group in optimizer.param_groups:
        group.update(optimizer._wide)


def non_negative(group, key, where):
    value = _validate.real_value(group[key], key, where)
    if not value >= 0.0:
        raise ValueError(f"{where}: Invalid {key} value: expected {key} >= 0, found {value!r}")


def refuse_differentiable(group, where, name):
    if group.get("differentiable"):
        raise ValueError(f"{where}: {name}'s differentiable implementation does not take hostembed tables (the "
                         "core updates them in place); leave differentiable unset")
