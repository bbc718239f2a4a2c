"""torch's own optimizers on hostembed tables, after a plain swap
(``torch.nn.Embedding = hostembed.Embedding``, the script unchanged).

A host table's backward makes a row-sparse weight.grad. Each torch
optimizer gets what it can take, with torch's results:

* host: torch.optim.SparseAdam, and torch.optim.Adagrad without weight
  decay or fused, on a float32 or float64 table: the table's part of the
  step is the core's update of the gradient's rows (hostembed.SparseAdam's
  and hostembed.Adagrad's: torch's arithmetic, the repeated rows of a
  gradient summed in position order within the update's pass, where
  torch's step would coalesce them first), the state in the optimizer's
  own ``state`` in torch's keys and layout.
* sparse: an optimizer that takes a row-sparse gradient with the options
  it was given (SGD without momentum, weight decay or fused; LBFGS;
  hostembed's own; torch's SparseAdam or Adagrad on a half table or with
  a closure) gets it as it is.
* adam: torch.optim.Adam and AdamW (any weight_decay, amsgrad, maximize,
  foreach or fused) on a float32 or float64 table: the table's part of the
  step is done by the core over every row, as with a dense gradient but
  without one (_core/ops/update.py's dense_adam), its state kept in the
  optimizer's own ``state`` in torch's layout (state_dict() and
  load_state_dict() as torch's).
* dense: any other optimizer (RMSprop, NAdam, RAdam, Adamax, Adadelta,
  Rprop, ASGD, Adafactor, SGD with momentum or weight decay, Adagrad with
  weight decay, one unknown to hostembed, a subclass of any of these) gets
  a dense weight.grad, as nn.Embedding(sparse=False) makes it, from its
  first step on; one warning per table says what that costs.

Done with torch's global optimizer step hooks, registered when hostembed
is imported: no torch class is patched. The pre-hook runs before step()
(and before its closure), the post-hook after step() returned. torch runs
an optimizer's own hooks after the global pre-hooks and before the global
post-hooks, so those see an Adam- or host-routed table with its gradient hidden
and not yet stepped.
"""
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._core.ops import update as update_ops
from .._core.table import any_tables, table_of
from .adam import table_step
from .base import HostStep, check_row_sparse, owned_state
from .sparse_adam import SparseAdam

SPARSE, ADAM, HOST, DENSE = "sparse", "adam", "host", "dense"

# Optimizers whose step the post-hook completes: the host gradients the
# pre-hook took from torch's view, by optimizer (weakly: a dropped
# optimizer takes its entry along).
_taken = weakref.WeakKeyDictionary()
# Tables with a row cache that torch steps itself (the sparse way), and the
# rows of their gradients, by optimizer.
_written = weakref.WeakKeyDictionary()


def route(optimizer, group, table, closure=None) -> str:
    """How `optimizer` steps `table` of param group `group` (module docstring)."""
    kind = type(optimizer)
    if isinstance(optimizer, (HostStep, SparseAdam)):
        return SPARSE
    # The core's pass can neither run a closure's backward between our
    # hooks' work nor give differentiable or capturable steps.
    plain = table.dtype in (torch.float32, torch.float64) and closure is None and not group.get("differentiable")
    if plain and (kind is torch.optim.SparseAdam or kind is torch.optim.Adagrad and not group.get("weight_decay")
                  and not group.get("fused")):
        return HOST
    if kind is torch.optim.SparseAdam or kind is torch.optim.LBFGS:
        return SPARSE
    if kind is torch.optim.SGD and not group.get("momentum") and not group.get("weight_decay") \
            and not group.get("fused"):
        return SPARSE
    if kind is torch.optim.Adagrad and not group.get("weight_decay") and not group.get("fused"):
        return SPARSE
    if kind in (torch.optim.Adam, torch.optim.AdamW) and plain and not group.get("capturable"):
        return ADAM
    return DENSE


def _before_step(optimizer, args, kwargs):
    if not any_tables() or isinstance(optimizer, (HostStep, SparseAdam)):
        return  # no host table, or hostembed's own optimizer, which takes host gradients as they are
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
    # A step that raised never reached the post-hook: its hidden gradients
    # go back where nothing newer replaced them (a retried step), and are
    # never applied later.
    for p, _, _, grad in _taken.pop(optimizer, ()):
        if p.grad is None:
            p.grad = grad
    _written.pop(optimizer, None)  # its rows were never written
    taken, written = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            table = table_of(p)
            if table is None:
                continue
            way = route(optimizer, group, table, closure)
            if way in (ADAM, HOST) and p.grad is not None and p.grad.is_sparse:
                # Refused here, before torch steps any other parameter.
                check_row_sparse(p, p.grad, type(optimizer).__name__)
                taken.append((p, table, group, p.grad))
            elif way == DENSE:
                _make_dense(optimizer, p, table)
            elif way == SPARSE and table.cache is not None and p.grad is not None and p.grad.is_sparse:
                written.append((table, p.grad._indices()[0]))
    if taken:
        for p, _, _, _ in taken:
            p.grad = None  # torch's step skips a parameter without a gradient
        _taken[optimizer] = taken
    if written:
        _written[optimizer] = written


def _after_step(optimizer, args, kwargs):
    # Cached tables torch stepped in host memory: their cache reads again
    # the records of the rows torch wrote, not every record.
    for table, rows in _written.pop(optimizer, ()):
        with table.lock:
            table.cache.host_rows_written("weight", rows)
    taken = _taken.pop(optimizer, None)
    if not taken:
        return
    try:
        for p, table, group, grad in taken:
            step = table_step if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else host_step
            step(optimizer, p, table, group, grad._indices()[0], grad._values())
    finally:
        for p, _, _, grad in taken:
            p.grad = grad


def host_step(optimizer, p, table, group, indices, values):
    """torch's SparseAdam or Adagrad step of `p` (a host table) from the
    rows of its gradient, by the core, the state in optimizer.state[p] as
    torch keeps it (SparseAdam's made at the first step, an int step;
    Adagrad's at construction, a 0-d float step and `sum`, which is copied
    into a buffer of the table once)."""
    state = optimizer.state[p]
    maximize = bool(group.get("maximize", False))
    if isinstance(optimizer, torch.optim.SparseAdam):
        if len(state) == 0:
            state.update(step=0, exp_avg=table.zeros(), exp_avg_sq=table.zeros())
        moments = {key: owned_state(table, state[key]) for key in ("exp_avg", "exp_avg_sq")}
        step = int(state["step"]) + 1
        beta1, beta2 = (float(b) for b in group["betas"])
        update_ops.sparse_update(update_ops.ADAM, p, moments, indices, values, lr=float(group["lr"]), beta1=beta1,
                                 beta2=beta2, eps=float(group["eps"]), step=step, maximize=maximize)
        state.update(step=step, **moments)
        return
    if "sum" not in state:  # a group added after construction, as torch's _init_group would
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["sum"] = table.zeros().fill_(group["initial_accumulator_value"])
    total = owned_state(table, state["sum"])
    step_t = state["step"]
    step = int(step_t.item() if isinstance(step_t, torch.Tensor) else step_t) + 1
    update_ops.sparse_update(update_ops.ADAGRAD, p, {"sum": total}, indices, values, lr=float(group["lr"]),
                             eps=float(group["eps"]), lr_decay=float(group["lr_decay"]), step=step, maximize=maximize)
    state["sum"] = total
    if isinstance(step_t, torch.Tensor):
        step_t += 1
    else:
        state["step"] = step


def _make_dense(optimizer, p, table):
    """From now on backward makes the table's gradient dense; a sparse one
    already there is made dense now. Torch will write the rows in place:
    a row cache's newer rows go to host memory first."""
    if not table.dense_gradient:
        table.dense_gradient = True
        size = table.num_rows * table.dim * table.dtype.itemsize
        warnings.warn(
            f"hostembed: {type(optimizer).__name__} with these options takes no row-sparse gradient, so the "
            f"[{table.num_rows}, {table.dim}] table's weight.grad is dense from now on ({size} bytes a step), as "
            "nn.Embedding(sparse=False) makes it. Faster with torch's results: torch.optim.Adam or AdamW (hostembed "
            "updates the table without a dense gradient); faster still, updating only the rows each batch "
            "touches: hostembed.SparseAdam, SGD, Adagrad or RowWiseAdagrad", stacklevel=3)
    if table.cache is not None:
        with table.lock:
            table.cache.flush()
    grad = p.grad
    if grad is not None and grad.is_sparse:
        p.grad = grad.to_dense()


_hooks = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))
