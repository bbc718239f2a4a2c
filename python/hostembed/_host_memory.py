"""Tensors that alias host memory owned by the C core.

Tables and optimizer state are allocated by the core (anonymous mmap: zeroed,
lazily backed, huge-page hinted, not inherited by forked DataLoader workers)
and exported once as CPU tensors, so state_dict(), torch.save and inspection
need no copy. Never tensor.pin_memory() for these: it copies, and torch's
pinned allocator rounds up to a power of two.
"""
import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C

_FLOAT_BYTES = 4

# Parameters whose storage is a host table of ours. Weak, so a dropped
# module frees its table.
_host_tables = WeakIdKeyDictionary()


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
    # frombuffer keeps a reference to buf: the memory lives as long as any view.
    return torch.frombuffer(buf, dtype=torch.float32).view(num_rows, dim)


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
