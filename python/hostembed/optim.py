"""hostembed.SparseAdam: torch.optim.SparseAdam, done in place by the C core
for hostembed tables."""
import time

import torch
from torch.optim import _functional as torch_functional

from . import _ops
from ._lookup_gpu import take_grad_twin
from ._stream import copy_rows
from ._table import table_of
from ._update_choice import UpdateChooser

_STATE_TENSORS = ("exp_avg", "exp_avg_sq")

# Where the update of a table whose gradient came from a GPU lookup runs:
# "auto" times both on the first steps and keeps the faster (_update_choice.py).
DEFAULT_UPDATE = "auto"
UPDATES = ("auto", "gpu", "cpu")


class SparseAdam(torch.optim.SparseAdam):
    """torch.optim.SparseAdam with the same signature, validation, state keys
    (``step``, ``exp_avg``, ``exp_avg_sq``) and numerics.

    For a hostembed table, step() updates the weight and both moments in
    place in host memory with the core's threads (one pass over the rows in
    the gradient; the moments are created at the first step, and their pages
    are backed as rows are first written). Any other parameter goes through
    torch's own implementation.

    ``update`` says where the update of a table with GPU outputs runs:
    ``"gpu"`` by a kernel through the pinned mapping, reading the gradient
    the GPU backward left in GPU memory (the optimizer state is pinned on
    the first such step); ``"cpu"`` by the core's threads from the pinned
    copy of the gradient; ``"auto"`` (default) times both on the first
    steps of each table (3 counted steps each, after one warm-up) and keeps
    the faster (its GPU trial pins both moments, which makes them resident,
    and they stay pinned). All give the same bits. The update is complete in host
    memory when step() returns. Tables with CPU outputs always update on
    the CPU.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, *, update=DEFAULT_UPDATE):
        if update not in UPDATES:
            raise ValueError(f"SparseAdam: update must be one of {UPDATES}, got {update!r}")
        self.update = update  # before torch's __init__, which calls add_param_group
        super().__init__(params, lr=lr, betas=betas, eps=eps, maximize=maximize)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._want_grad_twin(table_of(p))

    def _want_grad_twin(self, table):
        """Asks backward to keep the gradient on the GPU while an update
        there is possible."""
        if table is None or self.update == "cpu":
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

        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
                table = table_of(p)
                if table is not None:
                    self._host_step(p, table, group)
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
        return loss

    def _host_step(self, p, table, group):
        grad = p.grad
        if grad.shape != p.shape:
            raise RuntimeError(f"SparseAdam: gradient of shape {list(grad.shape)} for a parameter of shape {list(p.shape)}")
        if grad.sparse_dim() != 1:
            # Not row-sparse (e.g. a fully sparse 2-D COO tensor a user built):
            # rare, so take the simple road to rows.
            grad = grad.coalesce().to_dense().to_sparse(sparse_dim=1)
        # Coalesced or not (autograd never marks what it stores as
        # coalesced): the core sums repeated rows itself, after checking the
        # range and before writing anything.
        indices = grad._indices()[0].contiguous()
        values = grad._values().to(torch.float32).contiguous()

        # Taken (and so released) whatever the mode: it holds GPU memory.
        twin = take_grad_twin(table, grad)
        state = self.state.get(p)  # not self.state[p]: a defaultdict would add an entry
        if not state:
            exp_avg, exp_avg_sq, step = table.zeros(), table.zeros(), 0
        else:
            exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], int(state["step"])
        beta1, beta2 = group["betas"]
        hyper = {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                 "eps": float(group["eps"]), "step": step + 1, "maximize": bool(group.get("maximize", False))}
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
        on_gpu = mode == "gpu" and all(table.device_address(t, twin.device) is not None
                                       for t in (p, exp_avg, exp_avg_sq))
        self._last_update = "gpu" if on_gpu else "cpu"
        if chooser is not None:
            # Timed from an idle device: the work queued before step() is
            # not the update's.
            torch.cuda.synchronize(twin.device)
            start = time.perf_counter()
        if on_gpu:
            _ops.gpu_adam_update(p, exp_avg, exp_avg_sq, twin.indices, twin.values, **hyper)
        else:
            _ops.adam_update(p, exp_avg, exp_avg_sq, indices, values, **hyper)
        if chooser is not None:
            chooser.record(self._last_update, time.perf_counter() - start)
        self._want_grad_twin(table)
        # Recorded only once the core accepted the gradient: a refused one
        # leaves weights, moments, step (and an empty state) as they were.
        self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    def load_state_dict(self, state_dict):
        self._check_state_shapes(state_dict)
        super().load_state_dict(state_dict)
        # torch keeps the loaded tensors; for host tables copy them into
        # core-owned memory so step() can update them in place.
        for group in self.param_groups:
            for p in group["params"]:
                table = table_of(p)
                if table is None or p not in self.state:
                    continue
                state = self.state[p]
                for key in _STATE_TENSORS:
                    if key in state:
                        own = table.zeros()
                        # In row chunks: a torch.load(mmap=True) source is
                        # released as it is copied, never resident whole.
                        copy_rows(own, state[key], desc=f"loading {key}")
                        state[key] = own
                if "step" in state:
                    state["step"] = int(state["step"])

    def _check_state_shapes(self, state_dict):
        """Refuses moments shaped unlike their parameters before anything is
        loaded (torch does not check this, and would fail later, mid-step)."""
        saved_state = state_dict.get("state", {})
        for saved_group, group in zip(state_dict.get("param_groups", []), self.param_groups):
            for saved_id, p in zip(saved_group["params"], group["params"]):
                for key in _STATE_TENSORS:
                    value = saved_state.get(saved_id, {}).get(key)
                    if value is not None and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(
                            f"SparseAdam.load_state_dict: state '{key}' of parameter {saved_id} has shape "
                            f"{list(value.shape)}, expected {list(p.shape)} like the parameter"
                        )
