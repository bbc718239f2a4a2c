"""The optimizers' updates in host memory: one threaded pass of the core
over a gradient's rows (sparse_update), or straight from a lookup's output
gradient (the fused mode, sparse_update_fused). A table with a row cache
updates the rows its cache holds in their records (_cache.RowCache).
dense_adam is torch's Adam over every row of a table, without a dense
gradient."""
import torch
from torch import Tensor

from .. import _C
from .. import fused as _fused
from ..table import DTYPE_CODES, STATE_CODES, dtype_name, host_table_of
# joined: for the optimizers, which call the ops through this module.
from .common import address, cpu_ids_args, custom_op, holding, host_copies, joined  # noqa: F401
from .cpu import gradient_rows, leaves_positions, position_rows, reduce_rows


# Optimizer kinds of the core (include/he_optim.h).
ADAM, SGD, ADAGRAD, ROWWISE_ADAGRAD, ROWWISE_ADAM = 0, 1, 2, 3, 4
_OPTIMIZER_NAMES = {ADAM: "SparseAdam", SGD: "SGD", ADAGRAD: "Adagrad", ROWWISE_ADAGRAD: "RowWiseAdagrad",
                    ROWWISE_ADAM: "SparseAdam"}


def sparse_update(kind: int, weight: Tensor, state, indices: Tensor, values: Tensor, *, lr: float, step: int,
                  maximize: bool, beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0,
                  lr_decay: float = 0.0, weight_decay: float = 0.0) -> None:
    """Optimizer `kind`'s update of rows `indices` with gradient rows
    `values`, in place, by the core's threads. Repeated indices are summed
    first; an index outside the table raises before anything is written.
    state: the optimizer's state tensors by name, in the core's order, each
    a buffer of the weight's table (HostTable.zeros). A table with a row
    cache updates its cached rows in their records (_cache.RowCache)."""
    name = _OPTIMIZER_NAMES[kind]
    table = host_table_of(weight, name)
    # A cache in GPU memory takes a gradient on the GPU as it is.
    device = values.device if table.cache is not None and table.cache.device == values.device else "cpu"
    indices, values = row_gradient(table, indices, values, device, name)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, lr_decay=lr_decay, step=step, maximize=maximize,
                 weight_decay=weight_decay)
    if table.cache is not None:
        # Checked before the cache writes its records (update_rows checks
        # the host part only after them).
        for key, item in state.items():
            _state_buffer(table, f"{name}'s {key}", item)
        with table.lock:
            table.cache.update(kind, state, indices, values, **hyper)
        return
    with table.lock:
        update_rows(kind, table, state, indices, values, **hyper)


def optimizer_name(kind: int) -> str:
    return _OPTIMIZER_NAMES[kind]


def sum_repeated_rows(table, indices: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """(distinct indices, ascending; their values summed in position order,
    as the core's update sums repeated rows) of a row-sparse gradient on
    the CPU."""
    return reduce_rows(indices, values, table.num_rows, -1, False)


def update_rows(kind: int, table, state, indices: Tensor, values: Tensor, **hyper) -> None:
    """sparse_update of `table` (a HostTable) by the core, its arguments
    checked (or, from a row cache, split from checked ones); the caller
    holds table.lock."""
    args = _update_args(kind, table, state, indices, values, **hyper)
    table.wait_for_gpu_use()  # a GPU gather may still be reading rows this writes
    _C.sparse_update_many(updates=[args])
    table.rows_changed(indices)


def sparse_update_many(updates) -> None:
    """sparse_update of each (kind, weight, state, indices, values, hyper)
    of one optimizer step (one entry a table): the tables without a row
    cache by one call of the core, every one checked before any of their
    rows is written, small ones updated side by side on the core's
    threads; then each cached table's update."""
    prepared, cached = [], []
    for kind, weight, state, indices, values, hyper in updates:
        name = _OPTIMIZER_NAMES[kind]
        table = host_table_of(weight, name)
        if table.cache is not None:
            cached.append((kind, weight, state, indices, values, hyper))
            continue
        indices, values = row_gradient(table, indices, values, "cpu", name)
        prepared.append((table, indices, values, _update_args(kind, table, state, indices, values, **hyper)))
    if prepared:
        with holding({id(t): t for t, _, _, _ in prepared}.values()):
            _C.sparse_update_many(updates=[args for _, _, _, args in prepared])
            for table, indices, _, _ in prepared:
                table.rows_changed(indices)
    for kind, weight, state, indices, values, hyper in cached:
        sparse_update(kind, weight, state, indices, values, **hyper)


def _update_args(kind: int, table, state, indices: Tensor, values: Tensor, **hyper) -> dict:
    """The core's keywords for one table's update (sparse_update_many's)."""
    return dict(_table_args(kind, table, state, **hyper), indices=address(indices), values=address(values),
                nnz=indices.numel(), values_dtype=DTYPE_CODES[values.dtype])


def _table_args(kind: int, table, state, **hyper) -> dict:
    """The core's keywords for optimizer `kind`'s update of `table` that do
    not depend on the gradient: the table, its state's buffers (each
    checked to be one of the table's), the hyperparameters (TypeError for
    any other), the dtype and rounding."""
    name = _OPTIMIZER_NAMES[kind]
    buffers = tuple(_state_buffer(table, f"{name}'s {key}", item) for key, item in state.items())
    return dict(kind=kind, weight=table.buffer, state=buffers, num_rows=table.num_rows, dim=table.dim,
                dtype=DTYPE_CODES[table.dtype], stochastic_rounding=table.stochastic_rounding, seed=table.seed,
                **_hyperparameters(**hyper))


def _state_buffer(table, what, item):
    """The core's form of one state: its buffer (in the table's compute
    dtype), or for a compact state given as (tensor, scales or None,
    stochastic), (buffer, he_dtype, scales' buffer or None, stochastic)."""
    if isinstance(item, torch.Tensor):
        return table.buffer_of(item, what)
    tensor, scale, stochastic = item
    return (table.buffer_of(tensor, what), STATE_CODES[tensor.dtype],
            None if scale is None else table.buffer_of(scale, f"{what}'s scales"), bool(stochastic))


@custom_op("hostembed::sparse_adam_", mutates_args=("weight", "exp_avg", "exp_avg_sq"))
def sparse_adam_(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, indices: Tensor, values: Tensor, lr: float,
                 beta1: float, beta2: float, eps: float, step: int, maximize: bool,
                 weight_decay: float = 0.0) -> None:
    """torch.optim.SparseAdam's update (sparse_update of ADAM), an op that
    torch.compile can trace."""
    check_state(host_table_of(weight, "SparseAdam"), exp_avg, exp_avg_sq)
    sparse_update(ADAM, weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, indices, values, lr=lr,
                  beta1=beta1, beta2=beta2, eps=eps, step=step, maximize=maximize, weight_decay=weight_decay)


def row_gradient(table, indices, values, device, name="SparseAdam"):
    """A row-sparse gradient's (indices, values) as the core reads them:
    int64 [nnz] and [nnz, dim] in the table's dtype or compute dtype
    (HostTable.gradient_dtype), contiguous, on `device`. Refuses any
    other shape (a values tensor with the right number of elements but
    another shape would otherwise be read as rows) before the core runs."""
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(
            f"hostembed: {name} needs the gradient's row indices as a 1-D int64 (or int32) tensor, got a "
            f"{list(indices.shape)} {indices.dtype} tensor"
        )
    nnz = indices.numel()
    if values.dim() != 2 or tuple(values.shape) != (nnz, table.dim) or not values.is_floating_point():
        raise RuntimeError(
            f"hostembed: {name} needs the gradient's values as a floating-point [{nnz}, {table.dim}] tensor "
            f"(one row per index of a [{table.num_rows}, {table.dim}] table), got a {list(values.shape)} "
            f"{values.dtype} tensor"
        )
    indices = indices.to(device=device, dtype=torch.int64).contiguous()
    values = values.to(device=device, dtype=table.gradient_dtype(values.dtype)).contiguous()
    return indices, values


@sparse_adam_.op.register_fake
def _(weight, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, step, maximize, weight_decay=0.0):
    return None


def adam_update(*args, **hyper):
    """sparse_adam_ (the op under torch.compile)."""
    return (sparse_adam_.op if torch.compiler.is_compiling() else sparse_adam_)(*args, **hyper)


def fused_adam_update(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, gradient, *, lr: float, beta1: float,
                      beta2: float, eps: float, step: int, maximize: bool, weight_decay: float = 0.0) -> None:
    """A CPU lookup's backward and SparseAdam's update in one pass of the
    core (the fused mode, _core/fused.py): gradient is the lookup's
    _fused.CpuGradient. The same bits as grad_reduce then sparse_adam_.
    Eager only."""
    table = host_table_of(weight, "SparseAdam")
    check_state(table, exp_avg, exp_avg_sq)
    sparse_update_fused(ADAM, weight, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, gradient, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, step=step, maximize=maximize, weight_decay=weight_decay)


def sparse_update_fused(kind: int, weight: Tensor, state, gradient, *, lr: float, step: int, maximize: bool,
                        beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0, lr_decay: float = 0.0,
                        weight_decay: float = 0.0) -> None:
    """sparse_update of optimizer `kind` from a CPU lookup's output gradient
    (_fused.CpuGradient) in one pass: each id's gradient rows summed and
    handed to its row update, the same bits as grad_reduce then
    sparse_update. Eager only (the fused mode, _core/fused.py)."""
    sparse_update_fused_many([(kind, weight, state, gradient, dict(
        lr=lr, step=step, maximize=maximize, beta1=beta1, beta2=beta2, eps=eps, lr_decay=lr_decay,
        weight_decay=weight_decay))])


def _hyperparameters(*, lr: float, step: int, maximize: bool, beta1: float = 0.0, beta2: float = 0.0,
                     eps: float = 0.0, lr_decay: float = 0.0, weight_decay: float = 0.0) -> dict:
    """An update's hyperparameters, every one the core takes (TypeError
    for any other)."""
    return dict(lr=lr, step=step, maximize=maximize, beta1=beta1, beta2=beta2, eps=eps, lr_decay=lr_decay,
                weight_decay=weight_decay)


def sparse_update_fused_many(updates) -> None:
    """sparse_update_fused of each (kind, weight, state, gradient, hyper)
    of one backward pass (one entry a table), by one call of the core:
    every update checked before any row is written, small tables updated
    side by side on the core's threads. Tables with a row cache take the
    unfused reduce, then the cache's update (the same bits)."""
    prepared = []
    for kind, weight, state, gradient, hyper in updates:
        name = _OPTIMIZER_NAMES[kind]
        table = host_table_of(weight, name)
        if table.cache is not None:
            indices, values = reduce_to_host(table, gradient)
            sparse_update(kind, weight, state, indices, values, **hyper)
            continue
        grad = gradient.grad
        dtype = table.gradient_dtype(grad.dtype)
        if gradient.bags is None:
            ids = gradient.ids.reshape(-1).contiguous()
            rows, args = gradient_rows(grad, ids, table.dim, None, dtype)
            if gradient.dedup is None:  # the core sorts them
                args.update(cpu_ids_args(ids))
        else:
            # The core sorts the bags' ids and finds each one's bag and factor
            # (no-op conversions skipped: ~1 us each, a few a table a step).
            ids = gradient.bags.ids
            rows = grad if grad.dtype == dtype and grad.is_contiguous() else grad.to(dtype=dtype).contiguous()
            if rows.dim() != 2 or rows.shape[1] != table.dim:
                rows = rows.reshape(-1, table.dim)
            args = {"bags": gradient.bags.args + (0,), "bag_of": 0, "row_weights": 0, "num_bags": rows.shape[0]}
        args.update(_table_args(kind, table, state, **hyper))
        args.update(dedup=gradient.dedup, grad=address(rows), padding_idx=gradient.padding_idx,
                    scale_grad_by_freq=gradient.scale_grad_by_freq, grad_dtype=DTYPE_CODES[rows.dtype])
        prepared.append((table, ids, args, (rows, gradient)))
    if not prepared:
        return
    with holding({id(t): t for t, _, _, _ in prepared}.values()):
        _C.sparse_update_fused_many(updates=[args for _, _, args, _ in prepared])
        for table, ids, _, _ in prepared:
            table.rows_changed(ids)


def reduce_to_host(table, gradient):
    """A fused table's lookup gradient (_fused.CpuGradient, GpuGradient or
    RowGradient) reduced as its unfused backward would: (indices, values)
    on the CPU."""
    if isinstance(gradient, _fused.CpuGradient):
        if gradient.bags is None and leaves_positions(table, gradient.scale_grad_by_freq):
            # As its unfused backward leaves it (the update sums the rows of
            # every lookup in one order, as the unfused step does).
            return position_rows(gradient.ids, gradient.grad, table.dim, gradient.padding_idx)
        indices, values = reduce_rows(gradient.ids, gradient.grad, table.num_rows, gradient.padding_idx,
                                       gradient.scale_grad_by_freq, gradient.dedup, gradient.bags, rounded=True)
        # Rounded to the table's dtype, as each lookup's weight.grad is.
        return indices, values.to(table.dtype)
    return tuple(host_copies(*gradient.wait()))


def check_state(table, *state):
    for tensor in state:
        if not (tensor.dtype == table.state_dtype and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tuple(tensor.shape) == (table.num_rows, table.dim)):
            raise RuntimeError(
                f"hostembed: optimizer state for a [{table.num_rows}, {table.dim}] table must be a contiguous "
                f"{dtype_name(table.state_dtype)} CPU tensor of that shape, got a {list(tensor.shape)} {tensor.dtype} "
                f"tensor on {tensor.device}"
            )


def dense_adam(weight: Tensor, state, indices: Tensor, values: Tensor, *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, step: int, decoupled: bool, amsgrad: bool, maximize: bool,
               name: str = "Adam") -> None:
    """torch.optim.Adam's step (AdamW's with decoupled) on every row of a
    float32 or float64 host table (of the rows this process updates, for
    a table several share: table.update_rows), in place by the core's threads
    (csrc/dense_adam.h): rows `indices` with gradient rows `values` (in any
    order; repeats summed in position order, as the sparse update sums
    them), every other row with a zero gradient, so no dense gradient is
    ever made. state: exp_avg, exp_avg_sq (and max_exp_avg_sq with
    amsgrad) by name, buffers of the table in its dtype. An index outside
    the table raises before anything is written."""
    table = host_table_of(weight, name)
    indices, values = row_gradient(table, indices, values, "cpu", name)
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        indices, values = sum_repeated_rows(table, indices, values)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    buffers = tuple(table.buffer_of(state[key], f"{name}'s {key}") for key in keys)
    with table.lock:
        if table.cache is not None:
            table.cache.flush()  # every row changes: the cache's newer rows first
        table.wait_for_gpu_use()  # a GPU gather may still be reading rows this writes
        _C.dense_adam(weight=table.buffer, state=buffers, num_rows=table.num_rows, dim=table.dim, dtype=table.code,
                      indices=address(indices), values=address(values), nnz=indices.numel(), lr=lr, beta1=beta1,
                      beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, decoupled=decoupled,
                      amsgrad=amsgrad, maximize=maximize, rows=table.update_rows or (0, table.num_rows))
        table.rows_changed(None)
