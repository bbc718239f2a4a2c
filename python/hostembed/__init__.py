"""hostembed: train embedding tables larger than GPU memory.

Drop-ins for torch.nn.Embedding and torch.nn.EmbeddingBag whose table and
optimizer state live in host memory, with a threaded SIMD C core doing the
lookups and the updates in place.
"""
from . import _ops
from ._cuda import cuda_available, cuda_compiled
from ._ids import IdDtypeError
from .checkpoint import load, save
from .clip import clip_grad_norm_
from .embedding import Embedding
from .embedding_bag import EmbeddingBag
from .optim import SparseAdam
from .optimizers import SGD, Adagrad, RowWiseAdagrad
from .replace import replace_embeddings

__version__ = "0.1.0"
__all__ = ["Embedding", "EmbeddingBag", "SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad", "IdDtypeError", "save",
           "load", "replace_embeddings", "set_num_threads", "get_num_threads", "empty_cache", "cuda_available",
           "cuda_compiled", "clip_grad_norm_"]


def set_num_threads(n: int) -> None:
    """Sets how many threads the core uses (the caller included).

    The core runs only while the calling thread waits for it, never at the
    same time as torch's own intra-op threads, so the default (every CPU this
    process may use) does not oversubscribe.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_threads expects an int, got {type(n).__name__}")
    _ops.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads the core uses."""
    return _ops.get_num_threads()


def empty_cache() -> None:
    """Returns to the OS the per-step buffers (outputs, gradient values) the
    core keeps for reuse; like torch.cuda.empty_cache, only needed when
    memory is tight between phases of different batch sizes."""
    _ops.empty_cache()
