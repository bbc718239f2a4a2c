"""hostembed: train embedding tables larger than GPU memory.

Drop-ins for torch.nn.Embedding and torch.nn.EmbeddingBag whose table and
optimizer state live in host memory, with a threaded SIMD C core doing the
lookups and the updates in place.

The package, by layer (each imports only from the layers below it):
  distributed/  ShardedEmbedding: a table's rows over the ranks of a
           torch.distributed group (imported on its own, beside this
           module's layer)
  nn/      Embedding, EmbeddingBag, EmbeddingBagCollection,
           replace_embeddings, clip_grad_norm_; the lookup paths
           (nn/lookup/)
  optim/   SparseAdam, SGD, Adagrad, RowWiseAdagrad, Adam, AdamW; torch's own
           optimizers on host tables (optim/torch_optimizers.py)
  io/      table files, chunked loads, load checks, checkpoints (save, load)
  _cache/  the row cache (private)
  _core/   the boundary to the C core (private): HostTable, ids, the
           custom ops (_core/ops/), whether CUDA can run
"""
import re as _re
import sys as _sys

import torch as _torch

# The oldest torch hostembed supports, and the one .ci/torch_floor.sh runs
# the core tests on (pyproject.toml and docs/guides/quickstart.md state the
# same floor). Older ones fail: before 2.4 torch has no
# torch.library.custom_op, which registers every op here; on 2.4 and 2.5
# torch's own embedding_bag raises an internal assert when a frozen table
# pools with per_sample_weights that need a gradient. pip leaves an older
# torch installed, and the import then failed deep inside with an
# AttributeError naming no version, so it is refused here, first.
_TORCH_FLOOR = (2, 6)
_torch_version = str(getattr(_torch, "__version__", "unknown"))
_found = _re.match(r"(\d+)\.(\d+)", _torch_version)
if _found is None or tuple(map(int, _found.groups())) < _TORCH_FLOOR:
    _floor = ".".join(map(str, _TORCH_FLOOR))
    raise ImportError(f"hostembed needs torch >= {_floor} (found {_torch_version}): upgrade torch "
                      f"(pip install 'torch>={_floor}')")
del _found, _torch_version

from ._core.cuda import cuda_available, cuda_compiled
from ._core.ids import IdDtypeError
from ._core.ops import common as _common_ops
from .io import checkpoint as _checkpoint
from .io.checkpoint import load, save
from .nn import Embedding, EmbeddingBag, EmbeddingBagCollection, clip_grad_norm_, replace_embeddings
from .nn import clip as _clip, embedding as _embedding, embedding_bag as _embedding_bag, replace as _replace
from . import optim as _optim
from .optim import SGD, Adagrad, Adam, AdamW, RowWiseAdagrad, SparseAdam

__version__ = "0.1.0"
__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "AdamW",
           "IdDtypeError", "save", "load", "replace_embeddings", "set_num_threads", "get_num_threads", "empty_cache",
           "cuda_available", "cuda_compiled", "clip_grad_norm_"]

# The public modules of the flat layout this package had before its
# subpackages, under their old names: pickles of modules saved then name
# hostembed.embedding.Embedding, and code may import them
# (hostembed.optim was SparseAdam's module and is now the optim package).
for _name, _module in (("embedding", _embedding), ("embedding_bag", _embedding_bag), ("checkpoint", _checkpoint),
                       ("clip", _clip), ("replace", _replace), ("optimizers", _optim)):
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module


def set_num_threads(n: int) -> None:
    """Sets how many threads the core uses (the caller included).

    The core runs only while the calling thread waits for it, never at the
    same time as torch's own intra-op threads, so the default (every CPU this
    process may use) does not oversubscribe.

    Args:
        n (int): the number of threads, from 1 to 1024 (ValueError
            otherwise; TypeError for a non-int).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_threads expects an int, got {type(n).__name__}")
    _common_ops.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads the core uses."""
    return _common_ops.get_num_threads()


def empty_cache() -> None:
    """Returns to the OS the per-step buffers (outputs, gradient values) the
    core keeps for reuse; like torch.cuda.empty_cache, only needed when
    memory is tight between phases of different batch sizes."""
    _common_ops.empty_cache()
