"""hostembed.SparseAdam: torch.optim.SparseAdam, done in place by the C core
for hostembed tables."""
import time

import torch
from torch.optim import _functional as torch_functional, adam as torch_adam

from .._cache.row_cache import flush_optimizer_tables, forget_optimizer_state
from .._core import fused as _fused
from .._core.ops import gpu as gpu_ops, update as update_ops
from .._core.ops.gpu import take_grad_twin
from .._core.table import table_of
from ..io import validate as _validate
from ..io.stream import copy_rows
from .base import check_row_sparse, keep_optimizer_wide, owned_state, restore_optimizer_wide, scalar_dtype
from .compact_state import CODE_DTYPES, StateBytes, StateForm, check_saved, scale_key, state_bytes
from .update_choice import UpdateChooser

_STATE_TENSORS = ("exp_avg", "exp_avg_sq")
_STATE_KEYS = ("step",) + _STATE_TENSORS
_SCALE_KEYS = tuple(scale_key(key) for key in _STATE_TENSORS)

# Where the update of a table whose gradient came from a GPU lookup runs:
# "auto" times both on the first steps and keeps the faster (update_choice.py).
DEFAULT_UPDATE = "auto"
UPDATES = ("auto", "gpu", "cpu")


class SparseAdam(torch.optim.SparseAdam):
    """torch.optim.SparseAdam with the same signature, validation, state keys
    (``step``, ``exp_avg``, ``exp_avg_sq``) and numerics.

    For a hostembed table, step() updates the weight and both moments in
    place in host memory with the core's threads (one pass over the rows in
    the gradient; the moments are created at the first step, and their pages
    are backed as rows are first written). Any other parameter goes through
    torch's own implementation: torch's SparseAdam for a sparse gradient
    (an nn.Embedding(sparse=True)), torch's Adam for a dense one, with
    Adam's state layout; so ``SparseAdam(model.parameters())`` trains a
    whole model, its tables lazily and its dense layers as Adam does.

    Compact state (``state_dtype``, ``rowwise_exp_avg_sq``,
    ``state_rounding``; hostembed tables only, other parameters keep
    torch's float state): the default (float32, element-wise) is torch's
    SparseAdam exactly; the compact forms are not, and the README measures
    what they cost in model quality. A compact state updates on the CPU (a
    table with GPU outputs copies its gradient to the host); a row cache
    keeps it in host-memory records (a GPU cache moves there, with a
    warning), rounded to nearest only. Any saved form loads into any other
    (optim/compact_state.py).

    The keyword-only ``update``, ``fused``, ``state_dtype``,
    ``rowwise_exp_avg_sq`` and ``state_rounding`` hold for the whole
    optimizer: they are in ``defaults`` and in every param group, as torch
    keeps its keywords, and a param group that asks another value raises
    ValueError (build another optimizer for those parameters).

    Args:
        params (iterable): an iterable of parameters (or named parameters)
            to optimize, or of dicts defining parameter groups; hostembed
            tables and any other parameters, as torch's. Sparse or complex
            parameter tensors raise ValueError, as torch's.
        lr (float or Tensor, optional): the learning rate, > 0 (ValueError
            otherwise; a Tensor lr must have one element). Default: ``1e-3``
        betas (Tuple[float, float], optional): the coefficients used for
            the running averages of the gradient and of its square, each in
            ``[0, 1)`` (ValueError otherwise). As torch's SparseAdam, a
            table row's moments decay only at the steps whose gradient holds
            the row (lazily), and the bias correction counts the steps of
            the table, not of the row. Default: ``(0.9, 0.999)``
        eps (float, optional): the term added to the denominator to improve
            numerical stability, > 0 (ValueError otherwise).
            Default: ``1e-8``
        maximize (bool, optional): maximize the objective with respect to
            the params, instead of minimizing (the gradient is negated).
            Default: ``False``
        update (str, optional): keyword-only: where the update of a table
            with GPU outputs runs: ``"gpu"`` by a kernel through the pinned
            mapping, reading the gradient the GPU backward left in GPU
            memory (the optimizer state is pinned on the first such step);
            ``"cpu"`` by the core's threads from the pinned copy of the
            gradient; ``"auto"`` times both on the first steps of each table
            (3 counted steps each, after one warm-up) and keeps the faster
            (its GPU trial pins both moments, which makes them resident, and
            they stay pinned). All give the same bits. The update is
            complete in host memory when step() returns. Tables with CPU
            outputs always update on the CPU. Any other value raises
            ValueError. Default: ``"auto"``
        fused (bool, optional): keyword-only: True applies each hostembed
            table's update in backward, at the end of the backward pass,
            straight from the lookup's output gradient: no ``weight.grad``
            is built, and the gradient never goes through memory (CPU) or to
            the host (GPU outputs, updated on the GPU unless
            ``update="cpu"``). The weights and moments are the same bits as
            unfused training. step() must follow each backward() (gradient
            accumulation over several backward() calls raises
            RuntimeError), and the tables' gradients cannot be clipped or
            inspected. Other parameters are updated by step() as usual;
            state_dict() is the same either way. A non-bool raises
            TypeError. (torch's SparseAdam has no ``fused``.)
            Default: ``False``
        weight_decay (float, optional): keyword-only; torch's SparseAdam has
            none: AdamW's decoupled decay, lazily, on the rows each step
            updates: ``w *= 1 - lr * weight_decay`` before their Adam
            update, as AdamW orders it; rows a step does not touch are not
            decayed (a dense decay would be a pass over the whole table
            every step). >= 0 (ValueError otherwise); not 0 only in a param
            group of hostembed tables (ValueError for a group with other
            parameters). Default: ``0.0``
        state_dtype (torch.dtype, optional): keyword-only: the dtype of both
            moments of a host table: torch.float32 (torch's), or
            torch.bfloat16 or torch.float16 (2 bytes an element; float16
            underflows small squared gradients and warns), or torch.int8 (8
            bits an element and a float32 scale per 256 columns of a row:
            exp_avg as int8 codes of its square root, exp_avg_sq as uint8
            codes of its fourth root; the state dict shows the codes and
            ``exp_avg_scale``/``exp_avg_sq_scale``). Also the strings
            ``"float32"``, ``"bfloat16"``, ``"float16"`` and ``"int8"``;
            None means float32; anything else raises ValueError.
            Default: ``torch.float32``
        rowwise_exp_avg_sq (bool, optional): keyword-only: True keeps one
            second moment a row, the mean of the row's squared gradient
            (FBGEMM's partial row-wise Adam): D + 1 values of state a row
            instead of 2D. Another algorithm than Adam (one step size a
            row): it held on synthetic CTR models but lost on real
            knowledge graphs whose entity rows are renormalised every step
            (docs/results.md, Compact optimizer state). A non-bool raises
            TypeError. Default: ``False``
        state_rounding (str, optional): keyword-only: how updated compact
            moments are stored: rounded to ``"nearest"`` or
            ``"stochastic"`` (unbiased); any other raises ValueError.
            Default: ``"nearest"``
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, *, update=DEFAULT_UPDATE,
                 fused=False, weight_decay=0.0, state_dtype=torch.float32, rowwise_exp_avg_sq=False,
                 state_rounding="nearest"):
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r}")
        if update not in UPDATES:
            raise ValueError(f"SparseAdam: update must be one of {UPDATES}, got {update!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"SparseAdam: fused must be a bool, got {type(fused).__name__}")
        if not isinstance(rowwise_exp_avg_sq, bool):
            raise TypeError(f"SparseAdam: rowwise_exp_avg_sq must be a bool, got {type(rowwise_exp_avg_sq).__name__}")
        # Before torch's __init__, which calls add_param_group.
        self.update, self.fused, self._weight_decay = update, fused, float(weight_decay)
        self._form = StateForm(state_dtype, state_rounding, "SparseAdam")
        self._rowwise = rowwise_exp_avg_sq
        self._wide = {"update": update, "fused": fused, "state_dtype": self._form.dtype,
                      "rowwise_exp_avg_sq": rowwise_exp_avg_sq, "state_rounding": state_rounding}
        super().__init__(params, lr=lr, betas=betas, eps=eps, maximize=maximize)
        self.defaults.update(weight_decay=self._weight_decay, **self._wide)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("weight_decay", self._weight_decay)
        try:
            keep_optimizer_wide(self, group)
            _check_weight_decay(group, "SparseAdam")
        except ValueError:
            self.param_groups.pop()
            raise
        tables = [t for t in map(table_of, group["params"]) if t is not None]
        if self.fused:
            try:
                _fused.register(self, tables, "SparseAdam")
            except ValueError:
                self.param_groups.pop()
                raise
        for table in tables:
            self._want_grad_twin(table)

    @property
    def _compact(self):
        """Whether host tables keep a state other than torch's."""
        return self._form.compact or self._rowwise

    @property
    def _kind(self):
        return update_ops.ROWWISE_ADAM if self._rowwise else update_ops.ADAM

    def _want_grad_twin(self, table):
        """Asks backward to keep the gradient on the GPU while an update
        there is possible."""
        if table is None or self.update == "cpu" or self._compact:  # a compact state updates on the CPU
            return
        if self.update == "gpu" or table.update_chooser is None or not table.update_chooser.settled:
            table.twin_wanted = True
        else:
            table.twin_wanted = table.update_chooser.choice == "gpu"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if self.fused:
            _fused.step_taken(self)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            dense = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                table = table_of(p)
                if table is not None:
                    if not p.grad.is_sparse:
                        raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
                    self._host_step(p, table, group)
                    continue
                if not p.grad.is_sparse:
                    dense.append(p)
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if params:
                beta1, beta2 = group["betas"]
                torch_functional.sparse_adam(
                    params, grads, exp_avgs, exp_avg_sqs, steps, eps=group["eps"], beta1=beta1, beta2=beta2,
                    lr=float(group["lr"]), maximize=group.get("maximize", False),
                )
            if dense:
                self._dense_step(dense, group)
        return loss

    def _dense_step(self, params, group):
        """torch.optim.Adam's step for parameters with dense gradients (a
        whole model's dense layers), with its state layout: one optimizer
        for a model, the tables updated lazily, the rest as Adam would."""
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not isinstance(state["step"], torch.Tensor):  # a state from the sparse path or a load
                state["step"] = torch.tensor(float(state["step"]), dtype=scalar_dtype())
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        torch_adam.adam(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=0.0, eps=group["eps"],
                        maximize=group.get("maximize", False))

    def _host_step(self, p, table, group):
        grad = p.grad
        check_row_sparse(p, grad, "SparseAdam")
        # Coalesced or not (autograd never marks what it stores as
        # coalesced): the core sums repeated rows itself, after checking the
        # range and before writing anything. The op checks the shapes.
        indices = grad._indices()[0]
        values = grad._values()

        # Taken (and so released) whatever the mode: it holds GPU memory.
        twin = take_grad_twin(table, grad)
        if self._compact:
            state, step = self._compact_state(p, table)
            if table.cache is not None and twin is not None and twin.device == table.cache.device:
                indices, values = twin.indices, twin.values  # a GPU cache updates from the GPU copy
            update_ops.sparse_update(self._kind, p, self._core_state(table, state), indices, values,
                                     **self._hyper(group, step + 1))
            self._last_update = "cpu" if table.cache is None else "cache"
            self.state[p].update(state, step=step + 1)
            return
        exp_avg, exp_avg_sq, step = self._table_state(p, table)
        hyper = self._hyper(group, step + 1)
        if table.cache is not None:
            # The row cache updates its records where they are (a cache in
            # GPU memory from the gradient's GPU copy), the other rows in
            # host memory.
            if twin is not None and twin.device == table.cache.device:
                indices, values = twin.indices, twin.values
            update_ops.adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
            self._last_update = "cache"
            self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
            return
        mode, chooser = "cpu", None
        if twin is not None:
            mode = self.update
            if mode == "auto":
                if table.update_chooser is None:
                    table.update_chooser = UpdateChooser()
                chooser = table.update_chooser if not table.update_chooser.settled else None
                mode = table.update_chooser.next_mode()
        # Pins and maps the state on its first GPU update; a buffer CUDA
        # refused to pin (warned then) sends the update to the CPU.
        on_gpu = mode == "gpu" and self._gpu_ready(p, table, exp_avg, exp_avg_sq, twin.device)
        self._last_update = "gpu" if on_gpu else "cpu"
        if chooser is not None:
            # Timed from an idle device: the work queued before step() is
            # not the update's.
            torch.cuda.synchronize(twin.device)
            start = time.perf_counter()
        if on_gpu:
            gpu_ops.gpu_adam_update(p, exp_avg, exp_avg_sq, twin.indices, twin.values, **hyper)
        else:
            update_ops.adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
        if chooser is not None:
            chooser.record(self._last_update, time.perf_counter() - start)
        self._want_grad_twin(table)
        # Recorded only once the core accepted the gradient: a refused one
        # leaves weights, moments, step (and an empty state) as they were.
        self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    def _fused_update(self, table, gradients):
        """The fused mode's update of `table` with the lookup gradients of
        one backward pass (called by _fused at the pass's end)."""
        p, group = _fused.param_of(self, table)
        if self._compact:
            self._fused_compact_update(p, table, group, gradients)
            return
        exp_avg, exp_avg_sq, step = self._table_state(p, table)
        hyper = self._hyper(group, step + 1)
        if len(gradients) > 1 or isinstance(gradients[0], _fused.RowGradient):
            # One update of the summed gradient, as unfused: the reduced
            # gradients concatenated in the order autograd would have
            # accumulated them (or the rows a shared table's exchange gave);
            # the core (or a cache) sums repeated rows in that order. A
            # cache in GPU memory takes GPU sums as they are.
            indices, values = update_ops.joined(_gradient_parts(table, gradients))
            update_ops.adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
            self._last_update = "cpu" if table.cache is None else "cache"
        elif isinstance(gradients[0], _fused.CpuGradient):
            update_ops.fused_adam_update(p, exp_avg, exp_avg_sq, gradients[0], **hyper)
            self._last_update = "cpu"
        else:
            # GPU outputs: the sums stay on the GPU and the kernel updates
            # through the pinned mapping ("auto" too: the update needs no
            # copy of the gradient to the host, which is what "cpu" costs).
            indices, values = gradients[0].wait()
            if table.cache is not None:
                update_ops.adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
                self._last_update = "cache"
            elif self.update != "cpu" and self._gpu_ready(p, table, exp_avg, exp_avg_sq, values.device):
                gpu_ops.gpu_adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
                self._last_update = "gpu"
            else:
                update_ops.adam_update(p, exp_avg, exp_avg_sq, *update_ops.host_copies(indices, values), **hyper)
                self._last_update = "cpu"
        self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    def _fused_compact_update(self, p, table, group, gradients):
        """_fused_update of a compact state: on the CPU (one lookup's
        gradient in the core's fused pass, else the reduced gradients as
        unfused), or by a row cache where its records are."""
        state, step = self._compact_state(p, table)
        hyper, core_state = self._hyper(group, step + 1), self._core_state(table, state)
        if len(gradients) == 1 and isinstance(gradients[0], _fused.CpuGradient):
            update_ops.sparse_update_fused(self._kind, p, core_state, gradients[0], **hyper)
        else:
            # One lookup's sums as they are (joined): the cache knows them
            # distinct (note_distinct), a copy it would check on the host.
            indices, values = update_ops.joined(_gradient_parts(table, gradients))
            update_ops.sparse_update(self._kind, p, core_state, indices, values, **hyper)
        self._last_update = "cpu" if table.cache is None else "cache"
        self.state[p].update(state, step=step + 1)

    def _compact_state(self, p, table):
        """(state tensors by key, step) of a host table under a compact
        form: new zeroed buffers before its first update."""
        state = self.state.get(p)
        if state:
            return {k: v for k, v in state.items() if k != "step"}, int(state["step"])
        new = self._form.new(table, "exp_avg", nonnegative=False)
        if self._rowwise:
            new["exp_avg_sq"] = table.zeros(per_row=True)
        else:
            new.update(self._form.new(table, "exp_avg_sq", nonnegative=True))
        return new, 0

    def _core_state(self, table, state):
        return {key: self._form.core_item(table, state, key) for key in _STATE_TENSORS}

    def state_bytes(self):
        """Host bytes of the optimizer state of each hostembed table, by
        parameter: {param: bytes} (its moments and their scales as kept;
        tables not yet stepped have none). A dict keyed as ``self.state``;
        printed, it names each table by its index in ``state_dict()`` (and
        its name, given named parameters), shape and dtype, not by its
        values."""
        sizes, labels = {}, {}
        index = 0
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for p, name in zip(group["params"], names):
                if table_of(p) is not None and self.state.get(p):
                    sizes[p] = state_bytes(self.state[p])
                    labels[p] = f"param {index}" + ("" if name is None else f" {name!r}")
                index += 1
        return StateBytes(sizes, labels)

    @staticmethod
    def _gpu_ready(p, table, exp_avg, exp_avg_sq, device):
        return all(table.device_address(t, device) is not None for t in (p, exp_avg, exp_avg_sq))

    @staticmethod
    def _hyper(group, step):
        # Checked at every step, as the core checks it: a group edited by
        # hand must not reach the GPU kernel, which takes it as it comes.
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                "eps": float(group["eps"]), "step": step, "maximize": bool(group.get("maximize", False)),
                "weight_decay": _weight_decay_of(group, "SparseAdam")}

    def _table_state(self, p, table):
        """(exp_avg, exp_avg_sq, step) of a host table: new zeroed buffers
        of the table before its first update."""
        state = self.state.get(p)  # not self.state[p]: a defaultdict would add an entry
        if not state:
            exp_avg, exp_avg_sq, step = table.zeros(), table.zeros(), 0
        else:
            exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], int(state["step"])
            # The core updates the state in the table's own buffers (it takes
            # the buffer objects, not addresses): moments put into the state
            # by hand as ordinary tensors are copied into new ones, and kept
            # in the state only once the step is accepted.
            exp_avg, exp_avg_sq = owned_state(table, exp_avg), owned_state(table, exp_avg_sq)
        return exp_avg, exp_avg_sq, step

    def state_dict(self):
        # A cached table's newest state may be in its cache's records.
        flush_optimizer_tables(self)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, all or nothing, with the state of host
        tables copied into core-owned memory (in row chunks: a
        torch.load(mmap=True) source is released as it is copied, never
        resident whole).

        Everything is checked before anything changes: the layout (group
        count and sizes, parameter ids), each group's hyperparameters the way
        the constructor checks them (0 <= beta < 1, eps > 0; lr >= 0, since
        a scheduler may have brought it to 0; maximize a bool), and each
        parameter's state (empty, or an int step >= 0 and floating moments
        shaped like the parameter). A refused state dict raises TypeError
        or ValueError naming the entry, and leaves the optimizer as it was.
        torch's own load_state_dict checks none of this and fails (or
        trains to NaN) later.

        The moments of a host table are copied into the optimizer's
        existing buffers when it has them (no second copy of the state in
        memory), else into new ones. Only a failure while those in-place
        copies run (a read error of the source, an interrupt) can leave the
        optimizer partially loaded: that raises RuntimeError saying so.
        """
        plan = LoadPlan(self, state_dict, "SparseAdam.load_state_dict")
        plan.stage()
        plan.copy_in_place()
        plan.install()

    def _checkpoint_load_plan(self, state_dict, where):
        """hostembed.load's plan of this optimizer's state (the method that
        io/checkpoint.py's LOAD_PLAN names)."""
        return LoadPlan(self, state_dict, where)


def _weight_decay_of(group, where):
    """The group's weight_decay (0 when absent) as a float, checked >= 0."""
    decay = group.get("weight_decay", 0.0)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not decay >= 0:
        raise ValueError(f"{where}: Invalid weight_decay value: {decay!r}")
    return float(decay)


def _check_weight_decay(group, where):
    """weight_decay (the decoupled, lazy decay of the rows each step
    updates) is >= 0, and not 0 only for a group of hostembed tables: torch's
    SparseAdam, which updates the other parameters, has none."""
    decay = _weight_decay_of(group, where)
    if decay and any(table_of(p) is None for p in group["params"]):
        raise ValueError(f"{where}: weight_decay={decay!r} applies to hostembed tables only (torch's SparseAdam, "
                         "which updates the other parameters, has no weight decay); put them in a group with "
                         "weight_decay=0, or use torch.optim.AdamW for dense ones")


def _copy(dst, src, desc):
    copy_rows(dst, src.detach(), desc=desc)


def _reusable(table, tensor):
    """True when `tensor` is a whole state buffer of `table` (one the core
    allocated for it, not the rows themselves), which a load may overwrite
    in place."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.dtype != table.state_dtype \
            or tensor.device.type != "cpu" or not tensor.is_contiguous() \
            or tuple(tensor.shape) != (table.num_rows, table.dim):
        return False
    base = tensor.untyped_storage().data_ptr()
    return base == tensor.data_ptr() and base != table.tensor.data_ptr() and table._buffers.get(base) is not None


def _saved_compact(entry, p):
    """True when a saved state holds a form torch's load cannot cast: 8-bit
    codes (and their scales), or a row-wise second moment."""
    if any(key in entry for key in _SCALE_KEYS):
        return True
    return any(isinstance(entry[key], torch.Tensor) and (entry[key].dtype in CODE_DTYPES or (
        key == "exp_avg_sq" and tuple(entry[key].shape) == tuple(p.shape[:1]))) for key in _STATE_TENSORS)


class _Moment:
    """One moment of a host table's state: where it comes from and goes."""

    def __init__(self, saved_id, key, source, table, current):
        self.saved_id, self.key, self.source, self.table = saved_id, key, source, table
        # The optimizer's own buffer, overwritten in place, or None: a new one.
        self.destination = current
        self.in_place = current is not None


class LoadPlan:
    """A SparseAdam state dict, checked in full, and how it will be installed.

    stage(): allocates the host buffers the load needs and fills those that
    are new (nothing the optimizer holds changes: a failure drops them);
    copy_in_place(): overwrites the moments the optimizer already has (a
    failure there leaves them partially loaded); install(): torch's
    load_state_dict with the host moments replaced by the filled buffers
    (everything it reads is checked, so it does not fail half-way).
    hostembed.load stages every optimizer before any in-place copy.
    """

    def __init__(self, optimizer, state_dict, where, fill=_copy):
        self.optimizer, self.where, self.fill = optimizer, where, fill
        layout = _validate.optimizer_layout(optimizer, state_dict, where)
        saved_state = state_dict["state"]
        self.state = {}
        self.moments = []
        self.converted, self.converted_state = [], {}
        for index, group, pairs in layout:
            _validate.check_sparse_adam_group(group, f"{where}: param_groups[{index}]")
            _check_weight_decay(dict(group, params=[p for _, p in pairs]), f"{where}: param_groups[{index}]")
            for saved_id, p in pairs:
                entry = saved_state.get(saved_id)
                if not entry:
                    continue
                here = f"{where}: state of parameter {saved_id}"
                table = table_of(p)
                if not set(_STATE_KEYS) <= set(entry) <= set(_STATE_KEYS + (_SCALE_KEYS if table else ())):
                    raise ValueError(f"{here}: expected the keys {list(_STATE_KEYS)} (and, for 8-bit moments, "
                                     f"{list(_SCALE_KEYS)}), or an empty state; found {sorted(map(repr, entry))}")
                step = _validate.check_step(entry["step"], here)
                if table is not None and (optimizer._compact or _saved_compact(entry, p)):
                    # Saved in a compact form, or loaded into one: converted
                    # (a chunk of rows at a time) into new buffers at stage().
                    for key in _STATE_TENSORS:
                        check_saved(entry[key], entry.get(scale_key(key)), key, p, here,
                                    per_row_ok=key == "exp_avg_sq")
                    self.state[saved_id] = {"step": step}
                    self.converted.append((saved_id, table, entry))
                    continue
                for key in _STATE_TENSORS:
                    value = entry[key]
                    try:
                        _validate.check_moment(value, p, key, here)
                    except _validate.DoesNotFit:
                        raise _validate.DoesNotFit(
                            f"{where}: state '{key}' of parameter {saved_id} has shape {list(value.shape)}, "
                            f"expected {list(p.shape)} like the parameter") from None
                table = table_of(p)
                if table is None:
                    self.state[saved_id] = entry  # torch's own load casts it
                    continue
                # The core keeps an int step and the moments (in the table's compute
                # dtype) in its own memory.
                self.state[saved_id] = {"step": step}
                current = optimizer.state.get(p) or {}  # get: the state is a defaultdict
                for key in _STATE_TENSORS:
                    mine = current.get(key)
                    if not _reusable(table, mine) or any(m.destination is mine for m in self.moments):
                        mine = None
                    self.moments.append(_Moment(saved_id, key, entry[key], table, mine))
        # A source that is itself one of the buffers about to be overwritten
        # (exp_avg and exp_avg_sq swapped) must be read before it is written:
        # the buffer it is goes to a new one instead.
        in_place = {m.destination.data_ptr(): m for m in self.moments if m.in_place}
        for moment in self.moments:
            source = moment.source
            if source.device.type == "cpu" and source.numel():
                target = in_place.get(source.untyped_storage().data_ptr())
                if target is not None and target is not moment:
                    target.destination, target.in_place = None, False
        self.groups = state_dict["param_groups"]
        self.staged = False

    def stage(self):
        """Allocates the new buffers, then fills them: a MemoryError or a read
        error here changes nothing (the new buffers are dropped)."""
        fresh = [m for m in self.moments if not m.in_place]
        buffers = [m.table.zeros() for m in fresh]
        for moment, buffer in zip(fresh, buffers):
            self.fill(buffer, moment.source, f"loading {moment.key}")
        for moment, buffer in zip(fresh, buffers):
            moment.destination = buffer
        form = self.optimizer._form
        converted = {}
        for saved_id, table, entry in self.converted:
            state = {}
            for key in _STATE_TENSORS:
                per_row = key == "exp_avg_sq" and self.optimizer._rowwise
                state.update(form.convert(table, key, key == "exp_avg_sq", per_row, entry[key],
                                          entry.get(scale_key(key))))
            converted[saved_id] = state
        self.converted_state = converted
        self.staged = True

    def in_place_bytes(self):
        return sum(m.destination.numel() * 4 for m in self.moments if m.in_place)

    def copy_in_place(self):
        """Overwrites the moments the optimizer already holds."""
        done = []
        for moment in self.moments:
            if not moment.in_place:
                continue
            try:
                self.fill(moment.destination, moment.source, f"loading {moment.key}")
            except Exception as exc:
                raise RuntimeError(
                    f"{self.where}: copying '{moment.key}' of parameter {moment.saved_id} into the optimizer's "
                    f"state failed part way ({type(exc).__name__}: {exc}); the optimizer is partially loaded "
                    f"({', '.join(done + [f'part of {moment.key} of parameter {moment.saved_id}'])} overwritten; "
                    "hyperparameters and steps unchanged): load a state dict again before stepping"
                ) from exc
            done.append(f"{moment.key} of parameter {moment.saved_id}")

    def install(self):
        if not self.staged:
            raise RuntimeError("SparseAdam: a load plan must be staged before it is installed")
        # The loaded state supersedes what a row cache holds (the next
        # update brings the loaded values in).
        forget_optimizer_state(self.optimizer)
        state = {saved_id: dict(entry) for saved_id, entry in self.state.items()}
        for moment in self.moments:
            state[moment.saved_id][moment.key] = moment.destination
        torch.optim.SparseAdam.load_state_dict(self.optimizer, {"state": state, "param_groups": self.groups})
        restore_optimizer_wide(self.optimizer)
        # torch's load casts floating state to the parameter's dtype; a host
        # table's moments are in its compute dtype (float32 for a half
        # table), in the buffers staged for them.
        params = {saved: p for saved_group, group in zip(self.groups, self.optimizer.param_groups)
                  for saved, p in zip(saved_group["params"], group["params"])}
        for moment in self.moments:
            self.optimizer.state[params[moment.saved_id]][moment.key] = moment.destination
        for saved_id, state in self.converted_state.items():
            self.optimizer.state[params[saved_id]].update(state)


def _gradient_parts(table, gradients):
    """A backward pass's lookup gradients of `table` as (indices, values)
    each: as they are where a cache in GPU memory takes them (GPU sums on
    its device), else reduced on the host as unfused backward would."""
    on_gpu = table.cache is not None and table.cache.device.type == "cuda" and \
        all(isinstance(g, _fused.GpuGradient) and g.values.device == table.cache.device for g in gradients)
    return [g.wait() if on_gpu else update_ops.reduce_to_host(table, g) for g in gradients]
