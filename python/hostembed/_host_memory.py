"""Tensors that alias host memory owned by the C core.

Tables and optimizer state are allocated by the core (anonymous mmap: zeroed,
lazily backed, huge-page hinted, not inherited by forked DataLoader workers)
and exported once as CPU tensors, so state_dict(), torch.save and inspection
need no copy. Never tensor.pin_memory() for these: it copies, and torch's
pinned allocator rounds up to a power of two.

Where the GPU path can run, tables and optimizer state are registered with
CUDA (pinned and mapped in place, see cuda/host_register.cu) as they are
created: kernels then read and write their rows over PCIe, and
tensor.is_pinned() is True.
"""
import functools
import warnings
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from ._cuda import cuda_available

_FLOAT_BYTES = 4

# Parameters whose storage is a host table of ours. Weak, so a dropped
# module frees its table.
_host_tables = WeakIdKeyDictionary()

# Registered buffers by host address, so that a tensor viewing one (found by
# its storage's address) gets the device address of its rows. Weak: the
# entry goes when the buffer does, and the buffer unregisters itself.
_registered = {}


def host_zeros(num_rows: int, dim: int, *, first_touch: bool = False) -> torch.Tensor:
    """A [num_rows, dim] float32 CPU tensor of zeros in core-owned memory.

    first_touch writes the pages from the core's threads now (the table is
    about to be initialised anyway); without it pages appear as rows are
    first written (optimizer state for rows never trained costs nothing).
    """
    nbytes = num_rows * dim * _FLOAT_BYTES
    try:
        buf = _C.HostBuffer(nbytes, first_touch)
    except MemoryError as exc:
        raise MemoryError(
            f"hostembed: cannot allocate {nbytes} bytes for a [{num_rows}, {dim}] float32 table ({exc})"
        ) from None
    if nbytes == 0:
        return torch.zeros(num_rows, dim)
    _pin(buf)
    # frombuffer keeps a reference to buf: the memory lives as long as any view.
    return torch.frombuffer(buf, dtype=torch.float32).view(num_rows, dim)


def _forget(address, ref):
    if _registered.get(address) is ref:
        del _registered[address]


def _pin(buf) -> None:
    """Registers buf with CUDA when the GPU path can run.

    Registering pins every page, so lazily backed optimizer state becomes
    resident here rather than row by row: the price of letting the GPU
    update it in place. A refusal (RLIMIT_MEMLOCK, a driver limit, not
    enough memory to pin) is not fatal: the buffer stays pageable and the GPU
    path falls back to the CPU core plus a copy for it.
    """
    if not cuda_available():
        return
    try:
        buf.cuda_register(torch.cuda.current_device())
    except (RuntimeError, OSError, MemoryError, ValueError) as exc:
        warnings.warn(
            f"hostembed: could not pin {buf.nbytes} bytes of host memory for the GPU ({exc}); the buffer stays "
            "unpinned, and GPU lookups and updates on it go through the CPU core and a copy",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    _registered[buf.address] = weakref.ref(buf, functools.partial(_forget, buf.address))


def device_address(tensor: torch.Tensor):
    """The device address of tensor's first element when it lies in host
    memory registered with CUDA, else None."""
    if not _registered:
        return None
    base = tensor.untyped_storage().data_ptr()
    ref = _registered.get(base)
    buf = ref() if ref is not None else None
    if buf is None or buf.device_address is None:
        return None
    return buf.device_address + (tensor.data_ptr() - base)


def host_scratch(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor from the core's scratch cache.

    For per-step buffers (lookup outputs, gradient values): when the last
    view of it dies, its pages go back to the cache and the next step of the
    same size reuses them instead of page-faulting a fresh mapping.
    """
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape)
    buf = _C.HostBuffer(numel * _FLOAT_BYTES, scratch=True)
    # The buffer may be larger (size classes): view the prefix.
    return torch.frombuffer(buf, dtype=torch.float32, count=numel).view(shape)


def register_table(param: torch.Tensor) -> None:
    _host_tables[param] = True


def is_host_table(param: torch.Tensor) -> bool:
    return param in _host_tables
