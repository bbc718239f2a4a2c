"""The table's gradient of a lookup traced by torch.compile.

A compiled graph cannot hand back a row-sparse gradient: inductor has no
sparse outputs ("Cannot access storage of SparseTensorImpl": dynamo then
breaks the graph at the lookup's backward), and a table tied to a dense
module (a language model's output projection) would need a sparse and a
dense gradient added inside the graph, which torch's fake tensors cannot
do (fullgraph=True fails). So the compiled backward gives the table no
gradient: an ordered (effectful) custom op, take_grad, sums the rows by
id and keeps them, and when the backward pass ends they are accumulated
into the weight's .grad as autograd would have (row-sparse, or added to
the dense gradient the tie left there). The same values as eager mode.

What differs from eager mode: the table's part reaches .grad at the end of
the backward pass, not when its node runs (a hook on the weight does not
see it), and only through .backward(): torch.autograd.grad does not
return it (nor does it touch .grad). A backward pass that raises gives the
table nothing (eager mode may have added its part before the error).
"""
import functools
import threading
import weakref

import torch
from torch import Tensor

from ..table import table_by_handle
from .common import weight_grad


def keep(handle: int, indices: Tensor, values: Tensor) -> None:
    """A compiled lookup's gradient sums (cpu.take_grad's) for the table
    `handle`, accumulated into its weight's .grad when this backward pass
    ends."""
    task = torch._C._current_graph_task_id()
    with _lock:
        parts = _pending.get(task)
        if parts is None:
            parts = _pending[task] = _Sums()
            # The callback holds the only strong reference (see _pending).
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_accumulate, parts))
        parts.setdefault(handle, []).append((indices, values))


def register_effect(op) -> bool:
    """op (cpu.take_grad's) as an ordered side effect, or False where this
    torch has no such registration (a compiled backward then hands back
    the gradient, with the graph break described above)."""
    register = getattr(op, "register_effect", None)
    effect = getattr(torch.library, "EffectType", None)
    if register is None or effect is None:
        return False
    register(effect.ORDERED)  # else AOTAutograd drops an op whose result nothing reads
    return True


class _Sums(dict):
    """{table handle: [(indices, values), ...]} of one backward pass; a
    class only because a plain dict cannot be weakly referenced."""


# Backward pass (graph task id) -> its _Sums, weakly: the only strong
# reference is the callback queued on torch's graph task, which torch drops
# with the task whether it ran or not. A backward that raises never runs
# its callbacks, so holding the sums here would keep them for good; held
# this way its entry goes when torch frees the failed task.
_pending = weakref.WeakValueDictionary()
_lock = threading.Lock()


def _accumulates(param):
    """Whether this backward pass accumulates into param's .grad: not in
    torch.autograd.grad() (which returns gradients; it would not return
    this one), nor in backward(inputs=...) without it."""
    if param is None or not param.requires_grad:
        return False
    try:
        with torch.enable_grad():  # torch finds the node through a view's grad_fn
            node = torch.autograd.graph.get_gradient_edge(param).node
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch: "... we are currently running autograd.grad()"
        return False


def _accumulate(parts):
    with _lock:
        # Emptied so that the tensors go now, not when torch frees the task.
        sums_by_table = dict(parts)
        parts.clear()
    for handle, sums in sums_by_table.items():
        try:
            table = table_by_handle(handle, "a compiled lookup's backward")
        except RuntimeError:  # dropped since its forward: no weight to give a gradient
            continue
        param = table.parameter()
        # Asked here, not in take_grad: autograd is off below the op.
        if not _accumulates(param):
            continue
        grad = None
        for indices, values in sums:
            part = weight_grad(indices, values, table.num_rows, table.dim, True, table.dtype)
            grad = part if grad is None else grad + part
        if param.grad is None:
            param.grad = grad
        elif param.grad.is_sparse:
            param.grad = param.grad + grad
        else:
            param.grad.add_(grad)  # a tie's dense gradient, as autograd adds them
