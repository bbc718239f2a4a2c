"""hostembed.SparseAdam: torch.optim.SparseAdam, done in place by the C core
for hostembed tables."""
import torch
from torch.optim import _functional as torch_functional

from . import _C, _gpu
from ._cuda import order_after_gpu_use, record_gpu_use, wait_for_gpu_use
from ._host_memory import device_address, host_zeros, is_host_table
from ._stream import copy_rows

_STATE_TENSORS = ("exp_avg", "exp_avg_sq")

# Where the update of a table whose gradient came from a GPU lookup runs.
# Per element of the u x D gradient rows, with the gradient already copied
# to pinned host memory by backward (weight.grad must be a CPU tensor):
#   "cpu": the core's threads read w, m, v, g and write w, m, v in host
#          memory: 28 bytes of host-memory traffic, at the rate a few
#          threads reach on random 512-byte rows;
#   "gpu": a kernel reads w, m, v over PCIe and writes them back: 12 bytes
#          each way on a full-duplex link (~50 GB/s each way on PCIe 5 x16),
#          g from GPU memory, and the CPU stays free.
# With ~16 cores, host memory would need ~2.3x the one-way PCIe rate on
# random rows (well over 100 GB/s) for "cpu" to win, so "gpu" is the default.
# Unmeasured so far: benchmarks/gpu.py times both, and the default follows
# the measurement. Without a GPU twin of the gradient (CPU outputs, or a
# gradient changed after backward) "gpu" uses the CPU core.
DEFAULT_UPDATE = "gpu"
UPDATES = ("gpu", "cpu")


class SparseAdam(torch.optim.SparseAdam):
    """torch.optim.SparseAdam with the same signature, validation, state keys
    (``step``, ``exp_avg``, ``exp_avg_sq``) and numerics.

    For a hostembed table, step() updates the weight and both moments in
    place in host memory with the core's threads (one pass over the rows in
    the gradient; the moments are created at the first step, and their pages
    are backed as rows are first written). Any other parameter goes through
    torch's own implementation.

    ``update`` says where the update of a table with GPU outputs runs:
    ``"gpu"`` (default) by a kernel through the pinned mapping, reading the
    gradient the GPU backward left in GPU memory; ``"cpu"`` by the core's
    threads from the pinned copy of the gradient. Both give the same bits.
    The update is complete in host memory when step() returns.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, *, update=DEFAULT_UPDATE):
        if update not in UPDATES:
            raise ValueError(f"SparseAdam: update must be one of {UPDATES}, got {update!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, maximize=maximize)
        self.update = update
        if update == "gpu":
            for group in self.param_groups:
                for p in group["params"]:
                    if is_host_table(p):
                        _gpu.want_grad_twin(p)

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
                if is_host_table(p):
                    self._host_step(p, group)
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

    def _host_step(self, p, group):
        num_rows, dim = p.shape
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
        twin = _gpu.take_grad_twin(p, grad)
        if self.update == "gpu":
            _gpu.want_grad_twin(p)  # also for parameters added by add_param_group
        state = self.state.get(p)  # not self.state[p]: a defaultdict would add an entry
        if not state:
            exp_avg, exp_avg_sq, step = host_zeros(num_rows, dim), host_zeros(num_rows, dim), 0
        else:
            exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], int(state["step"])
        beta1, beta2 = group["betas"]
        hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), step + 1,
                 bool(group.get("maximize", False)))
        on_gpu = None
        if self.update == "gpu" and twin is not None:
            on_gpu = [device_address(t) for t in (p, exp_avg, exp_avg_sq)]
            if None in on_gpu:  # a buffer the driver refused to pin (warned then)
                on_gpu = None
        self._last_update = "gpu" if on_gpu else "cpu"
        if on_gpu:
            self._gpu_step(p, on_gpu, twin, hyper)
            self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
            return
        # A GPU gather may still be reading rows this is about to write.
        wait_for_gpu_use(p)
        _C.sparse_adam(
            p.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), num_rows, dim,
            indices.data_ptr(), values.data_ptr(), indices.numel(), *hyper,
        )
        # Recorded only once the core accepted the gradient: a refused one
        # leaves weights, moments, step (and an empty state) as they were.
        self.state[p].update(step=step + 1, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    @staticmethod
    def _gpu_step(p, addresses, twin, hyper):
        """The update kernel on the twin's device, ordered after any GPU work
        on the table (a gather on another stream reading these rows)."""
        device = twin.device
        dim = p.shape[1]
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            order_after_gpu_use(p, stream)
            w, m, v = addresses
            _C.cuda_sparse_adam(w, m, v, dim, twin.indices.data_ptr(), twin.values.data_ptr(), twin.nnz, *hyper,
                                device.index, stream.cuda_stream)
            # Done when step() returns, as any optimizer on CPU tensors:
            # state_dict(), torch.save and CPU reads of the weight see the
            # update. The next lookup waits for its dedup anyway, so this
            # wait mostly moves that one earlier.
            record_gpu_use(p, stream).synchronize()

    def load_state_dict(self, state_dict):
        self._check_state_shapes(state_dict)
        super().load_state_dict(state_dict)
        # torch keeps the loaded tensors; for host tables copy them into
        # core-owned memory so step() can update them in place.
        for group in self.param_groups:
            for p in group["params"]:
                if not is_host_table(p) or p not in self.state:
                    continue
                state = self.state[p]
                for key in _STATE_TENSORS:
                    if key in state:
                        own = host_zeros(*p.shape)
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
