"""Whether the GPU path can run here, and why not.

Nothing here touches CUDA at import: torch.cuda is first asked when a module
is given GPU outputs; a CUDA context is made by the first GPU lookup.
"""
import torch

from .ops.common import CUDA_COMPILED


def cuda_compiled() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return CUDA_COMPILED


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
