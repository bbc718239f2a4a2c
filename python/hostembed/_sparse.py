"""Row-sparse gradients: reduce rows per unique id in the C core."""
import torch

from . import _C
from ._host_memory import host_scratch


def reduce_rows(ids, rows, num_rows, padding_idx=None, scale_grad_by_freq=False):
    """Sums rows[i] per unique ids[i].

    ids: contiguous CPU int64/int32 [n]; rows: contiguous float32 [n, D].
    Returns (indices int64 [k], values float32 [k, D]), indices ascending,
    padding_idx left out. Raises IndexError for an id outside [0, num_rows)
    before anything is written. Deterministic for any thread count.
    """
    dim = rows.shape[1]
    dedup = _C.Dedup(ids.data_ptr(), ids.numel(), ids.dtype == torch.int64, num_rows)
    unique = dedup.num_unique
    indices = torch.empty(unique, dtype=torch.int64)
    values = host_scratch(unique, dim)
    written = _C.grad_reduce(
        dedup,
        rows.data_ptr(),
        dim,
        -1 if padding_idx is None else padding_idx,
        scale_grad_by_freq,
        values.data_ptr(),
        indices.data_ptr(),
    )
    return indices[:written], values[:written]


def row_sparse(indices, values, num_rows):
    """A coalesced sparse COO [num_rows, D] gradient from ascending unique rows."""
    return torch.sparse_coo_tensor(
        indices.unsqueeze(0), values, (num_rows, values.shape[1]), check_invariants=False, is_coalesced=True
    )
