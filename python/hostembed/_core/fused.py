"""The fused mode of hostembed's optimizers (fused=True): a table's update is
applied in backward, from the lookup's output gradient, and no weight.grad
is built.

When it runs. A lookup's backward hands its output gradient to the table
(take_gradient) instead of returning a gradient for the weight. The first
one of a backward pass queues a callback that autograd runs when the pass
ends; it applies one update to each table with everything the pass handed
over, the tables of one optimizer in one call (the optimizer's
_fused_update_many: small tables are updated side by side). So a
table looked up several times in one forward gets one update of the summed
gradient, exactly as unfused training would (then through the unfused
reduce and update: the case is rare). A single lookup, the usual case, goes
through the core's fused pass: each unique id's gradient rows are summed
into a buffer in L1 and go straight into that row's update, the same bits
as backward followed by step(), without the gradient's round trip through
memory (on the GPU path: without its copy to the host).

The training loop keeps torch's protocol. step() marks the table ready for
the next backward and updates the optimizer's other parameters as usual;
zero_grad() has nothing to clear for a fused table. A backward that reaches
a fused table again before step() is gradient accumulation, which a fused
table cannot do (the first gradient is already applied): RuntimeError,
nothing changed.
"""
import functools
import warnings
import weakref

import torch

from .table import table_of

ACCUMULATION_MESSAGE = (
    "hostembed: this table is updated by SparseAdam(fused=True) in backward, and a second backward reached it "
    "before optimizer.step(): gradient accumulation over several backward() calls cannot be fused (the first "
    "gradient is already applied). Call step() after each backward(), or use SparseAdam(fused=False) to "
    "accumulate"
)


class CpuGradient:
    """A CPU lookup's output gradient, as its backward hands it over. For
    bags, grad has a row per bag and `bags` is the lookup's
    _core.ops.bags.BagBatch: the core finds each position's bag and factor
    from it, in the fused update and in the unfused reduce."""

    __slots__ = ("ids", "grad", "padding_idx", "scale_grad_by_freq", "dedup", "bags")

    def __init__(self, ids, grad, padding_idx, scale_grad_by_freq, dedup, bags=None):
        self.ids, self.grad, self.dedup, self.bags = ids, grad, dedup, bags
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq


class GpuGradient:
    """A GPU lookup's gradient, already summed per unique id on the GPU by
    its backward, on that backward's stream (autograd's end-of-pass
    callback may run on another): the update waits for `ready` there."""

    __slots__ = ("indices", "values", "ready")

    def __init__(self, indices, values, ready):
        self.indices, self.values, self.ready = indices, values, ready

    def wait(self):
        """(indices, values), ordered after the reduce on the current stream."""
        torch.cuda.current_stream(self.values.device).wait_event(self.ready)
        return self.indices, self.values


class RowGradient:
    """A table's gradient as the rows this process updates, summed and on
    the CPU: what a table that several processes share
    (HostTable.gradient_exchange) makes of a backward pass's gradients
    once the processes have exchanged them; updated as an unfused step
    would (repeated rows summed in order)."""

    __slots__ = ("indices", "values")

    def __init__(self, indices, values):
        self.indices, self.values = indices, values

    def wait(self):
        return self.indices, self.values


def warn_if_distributed(name, tables):
    """A warning for tables a fused optimizer would update from each
    process's own batch alone, under torch.distributed: those that are not
    a distributed module's (HostTable.sharded)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and not all(
            table.sharded for table in tables):
        warnings.warn(
            f"{name}(fused=True) under torch.distributed: each process updates its tables from its own "
            "batch in backward, with no all-reduce, and DistributedDataParallel cannot wrap a fused table "
            "(its reducer fails with 'Expected sparse gradient to be defined'). Use fused=False for "
            "replicated tables, or hostembed.distributed's tables", UserWarning, stacklevel=4)


def register(opt, tables, name):
    """Makes opt the optimizer that updates each of `tables` in backward;
    ValueError (nothing registered) if another one already does."""
    if any(optimizer_of(t) not in (None, opt) for t in tables):
        raise ValueError(f"{name}(fused=True): a hostembed table in these parameters is already updated in "
                         "backward by another fused optimizer; a table can have one")
    warn_if_distributed(name, tables)
    for table in tables:
        table.fused_optimizer, table.fused = weakref.ref(opt), True


def step_taken(opt):
    """step() of a fused optimizer: its tables' updates ran in backward; the
    next backward may reach them again."""
    for group in opt.param_groups:
        for p in group["params"]:
            table = table_of(p)
            if table is not None and optimizer_of(table) is opt:
                table.fused_awaiting_step = False


def param_of(opt, table, found=None):
    """(the parameter, its group) of `table` in opt. found: a dict to fill
    with every table's, for the next tables of the same pass (one walk over
    the parameters, not one a table)."""
    if found is None:
        found = {}
    if not found:
        for group in opt.param_groups:
            for p in group["params"]:
                t = table_of(p)
                if t is not None:
                    found.setdefault(id(t), (p, group))
    entry = found.get(id(table))
    if entry is None:
        raise RuntimeError(f"hostembed: {type(opt).__name__}(fused=True) no longer holds this table's weight")
    return entry


def optimizer_of(table):
    """The live SparseAdam(fused=True) updating table, or None."""
    ref = table.fused_optimizer
    return None if ref is None else ref()


def take_gradient(table, gradient):
    """Called by a lookup's backward; True when the table is fused and the
    gradient was taken (the backward then returns no weight gradient)."""
    opt = optimizer_of(table)
    if opt is None:
        return False
    task = torch._C._current_graph_task_id()
    pending = table.fused_pending
    if pending is not None and pending[0] != task:
        # Left by a backward pass that raised before its end (its callback
        # never ran): that pass's gradients were never applied.
        pending = table.fused_pending = None
    if pending is None:
        if table.fused_awaiting_step:
            raise RuntimeError(ACCUMULATION_MESSAGE)
        pending = table.fused_pending = (task, [])
        tables = _pending_tables.get(task)
        if tables is None:
            tables = _pending_tables[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_apply, task))
        tables.append(weakref.ref(table))
    pending[1].append(gradient)
    return True


# Backward pass (graph task id) -> the tables that took a gradient in it.
# A pass that raises before its end leaves its entry (a few weak refs).
_pending_tables = {}


def _apply(task):
    """The end of backward pass `task`: each table's update, one call for
    the tables of each optimizer."""
    by_optimizer = {}
    for ref in _pending_tables.pop(task, ()):
        table = ref()
        if table is None or table.fused_pending is None or table.fused_pending[0] != task:
            continue
        pending, table.fused_pending = table.fused_pending, None
        opt = optimizer_of(table)
        if opt is not None and pending[1]:
            gradients = pending[1]
            if table.gradient_exchange is not None:  # a collective: every process, tables in backward's order
                gradients = [table.gradient_exchange(table, gradients)]
            by_optimizer.setdefault(id(opt), (opt, []))[1].append((table, gradients))
    for opt, items in by_optimizer.values():
        many = getattr(opt, "_fused_update_many", None)
        if many is not None:
            many(items)
        else:  # SparseAdam: one table at a time (its own _fused_update)
            for table, gradients in items:
                opt._fused_update(table, gradients)
        for table, _ in items:
            table.fused_awaiting_step = True
