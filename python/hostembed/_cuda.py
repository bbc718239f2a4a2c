"""Whether the GPU path can run, and the ordering of GPU work on host tables.

Nothing here touches CUDA at import: torch.cuda is first asked when a table
is created or a GPU lookup is made.
"""
import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C

# Host table (weight Parameter) -> torch.cuda.Event recorded after the last
# GPU work that reads or writes it. GPU work on another stream waits for it
# on the device; CPU code that writes the table waits for it on the host
# (a gather still in flight would otherwise read half-updated rows).
_last_gpu_use = WeakIdKeyDictionary()


def cuda_compiled() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return bool(getattr(_C, "CUDA_COMPILED", False))


def cuda_available() -> bool:
    """True when the GPU path can run: CUDA kernels compiled in and a GPU
    that torch can use."""
    return cuda_compiled() and torch.cuda.is_available()


def unavailable_reason():
    """Why the GPU path cannot run here, or None when it can."""
    if not cuda_compiled():
        return ("hostembed was built without CUDA (nvcc was not found when it was built, or HOSTEMBED_CUDA=0); "
                "rebuild it where nvcc is on PATH, or with HOSTEMBED_CUDA=1 to make a missing nvcc an error")
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def require_cuda(what: str) -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"hostembed: {what} needs the GPU path, but {reason}")


def resolve_device(device: torch.device) -> torch.device:
    """A CUDA device with its index ("cuda" means the current device)."""
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def record_gpu_use(table: torch.Tensor, stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    _last_gpu_use[table] = event
    return event


def order_after_gpu_use(table: torch.Tensor, stream) -> None:
    """Makes `stream` wait (on the device, the host does not block) for the
    last GPU work on the table, which may have run on another stream."""
    event = _last_gpu_use.get(table)
    if event is not None:
        stream.wait_event(event)


def wait_for_gpu_use(table: torch.Tensor) -> None:
    """Blocks the host until no GPU work on the table is in flight: call it
    before the CPU writes the table."""
    event = _last_gpu_use.pop(table, None)
    if event is not None:
        event.synchronize()
