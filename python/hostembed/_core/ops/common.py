"""What every op module here shares: registering a custom op, tensors as
the core's arguments (addresses, ids), per-step buffers, weight.grad.

hostembed's custom ops are the boundary between Python and the C core.

This is the only Python code that calls the extension (_C), and the one
place where tensors become addresses. Every op checks what it is handed
(dtype, device, layout, and that a table tensor is exactly the rows of a
live host table of this process, never a view of something else) before
calling the core, whose functions take named arguments only. The table and
its optimizer state go to the core as their HostBuffer objects (never as
addresses), so the core checks every shape against the memory it is given;
ids, gradients and outputs go as addresses of tensors held for the call.

Each op that reads or writes a table's rows or state holds the table's lock
(HostTable.lock) around that work: ops from several Python threads on one
table run one after another, each whole (the core releases the GIL).

The steps that touch a table are torch.library custom ops (namespace
``hostembed``) with fake implementations and registered autograd, so
torch.compile traces a lookup and its backward without breaking the graph.
What has to happen at run time (ordering against GPU work, the fork check,
keeping the gradient on the GPU for the update) happens inside the ops,
never in traced Python.

Adding an op: the core function in csrc/ (or a launcher in cuda/), its
keyword-only binding in binding/, then a custom op in the op module of
its engine (cpu.py, update.py or gpu.py) that validates, takes addresses
with address() and calls it. Modules and optimizers call the ops, never _C.
"""
import torch
from torch import Tensor

from .. import _C
from ..ids import ID_DTYPES

CUDA_COMPILED = bool(getattr(_C, "CUDA_COMPILED", False))

HostBuffer = _C.HostBuffer
set_num_threads = _C.set_num_threads
get_num_threads = _C.get_num_threads
empty_cache = _C.empty_cache


def custom_op(name, mutates_args=()):
    """Registers fn as the torch.library custom op `name` and returns fn
    itself with the op as fn.op. Traced code (torch.compile) calls the op;
    eager code calls fn directly, skipping the dispatcher's Python layers
    (about 50 us a call, measured: a tenth of a small training step)."""
    def wrap(fn):
        fn.op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        return fn
    return wrap


def eager_autograd(fn, setup_context, backward):
    """An autograd.Function running fn, then the op's own setup_context,
    with a backward calling the plain functions: the eager twin of the op.
    (The classic forward(ctx, ...) form: a separate setup_context makes
    autograd bind the arguments with inspect on every call.)"""
    def forward(ctx, *inputs):
        output = fn(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(f"{fn.__name__}_eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def functorch_active() -> bool:
    """Whether a functorch transform (vmap, grad) is active (True where
    torch cannot tell)."""
    return _functorch_active is None or _functorch_active()


def applier(function):
    """function.apply (an autograd.Function) without torch's Python wrapper
    around it when no functorch transform (vmap, grad) is active: the
    wrapper's argument walk costs 4-5 us a call, a tenth of a small
    lookup's, and does nothing for tensors that are not functorch's. Under
    a transform, function.apply itself (which refuses these Functions,
    having no setup_context, in torch's words)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is None:  # a torch without that check: its own apply, always
        return function.apply
    apply = super(torch.autograd.Function, function).apply

    def call(*args):
        return function.apply(*args) if active() else apply(*args)
    return call


def address(tensor: Tensor) -> int:
    return tensor.data_ptr()


def ids_args(ids: Tensor) -> dict:
    """The core's view of a batch of ids: contiguous int64/int32."""
    if ids.dtype not in ID_DTYPES or not ids.is_contiguous():
        raise ValueError(f"hostembed: the core takes contiguous int64/int32 ids, got {ids.dtype}"
                         f"{'' if ids.is_contiguous() else ', not contiguous'}")
    return {"ids": address(ids), "count": ids.numel(), "ids_int64": ids.dtype == torch.int64}


def cpu_ids_args(ids: Tensor) -> dict:
    if not ids.is_cpu:  # (not .device, which builds an object: 0.4 us a call)
        raise ValueError(f"hostembed: the CPU core takes ids on the CPU, got {ids.device}")
    return ids_args(ids)


def float_rows(tensor: Tensor, count: int, dim: int, device, dtype=torch.float32) -> Tensor:
    """tensor's values as a contiguous [count, dim] matrix of dtype on device."""
    return tensor.to(device=device, dtype=dtype).contiguous().reshape(count, dim)


# Smaller buffers come from torch's allocator: malloc serves them from its
# heap without page faults, faster than a HostBuffer (1 us against 5 for a
# 128 KiB lookup output).
SCRATCH_MIN_BYTES = 256 << 10


def scratch(*shape: int, dtype=torch.float32) -> Tensor:
    """An uninitialised CPU tensor of dtype from the core's scratch cache.

    For per-step buffers (lookup outputs, gradient values): when the last
    view of it dies, its pages go back to the cache and the next step of the
    same size reuses them instead of page-faulting a fresh mapping.
    """
    numel = 1
    for n in shape:
        numel *= n
    if numel * dtype.itemsize < SCRATCH_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buf = _C.HostBuffer(numel * dtype.itemsize, scratch=True)
    # The buffer may be larger (size classes): the prefix, as a tensor of
    # its own rather than a view (autograd refuses in-place changes of a
    # view that a Function returns, as `out += pos` is).
    storage = torch.frombuffer(buf, dtype=dtype, count=numel).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def host_copies(*tensors: Tensor) -> list:
    """The tensors on the CPU: GPU ones copied into pinned staging from
    torch's caching host allocator (a per-step buffer reused step after
    step, which a plain .cpu() is not: it mallocs pageable memory each
    step, faults it in, and the driver stages the copy through pinned
    memory of its own), the host waiting for the copies on the current
    stream. Staging for the table itself is never made this way
    (pin_memory() rounds up to a power of two); a per-step gradient's
    rounding costs at most its own size again."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda else t for t in tensors]
    device = next(t.device for t in tensors if t.is_cuda)
    with torch.cuda.device(device):
        for source, target in zip(tensors, out):
            if source.is_cuda and source.numel():
                target.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return out


def joined(parts) -> tuple:
    """(indices, values) of several (indices, values) parts, concatenated
    in order; one part as it is (a copy of a whole gradient saves
    nothing)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])


def weight_grad(indices: Tensor, values: Tensor, num_rows: int, dim: int, sparse: bool, dtype=None) -> Tensor:
    """The table's gradient from its reduced rows, in the table's dtype
    (values are rounded to a half table's dtype once, after the sum):
    row-sparse COO (already coalesced: the indices are unique and
    ascending) or dense."""
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    if sparse:
        return torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, dim), is_coalesced=True,
                                       check_invariants=False)
    return torch.zeros(num_rows, dim, dtype=values.dtype, device=values.device).index_copy_(0, indices, values)


class holding:
    """`with holding(tables):` holds each table's lock (HostTable.lock), its
    GPU work on the rows finished, for one core call over all of them; the
    tables distinct. (A class, not contextlib.ExitStack: that costs ~6 us,
    several times a step.)"""

    __slots__ = ("tables", "held")

    def __init__(self, tables):
        self.tables, self.held = tables, []

    def __enter__(self):
        try:
            for table in self.tables:
                table.lock.acquire()
                self.held.append(table)
                table.wait_for_gpu_use()  # a GPU kernel may still be reading or writing its rows
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for table in reversed(self.held):
            table.lock.release()
        self.held = []
        return False

