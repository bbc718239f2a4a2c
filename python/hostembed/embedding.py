"""hostembed.Embedding: torch.nn.Embedding with the table in host memory."""
import os
import warnings

import torch
from torch import nn

from . import _C, _gpu
from ._cuda import require_cuda, unavailable_reason, wait_for_gpu_use
from ._files import FileRows, open_table
from ._host_memory import host_scratch, host_zeros, register_table
from ._ids import prepare_ids
from ._sparse import reduce_rows, row_sparse
from ._stream import copy_rows, read_rows

# _weight value that leaves a new table zeroed instead of drawing N(0, 1):
# for tables about to be filled from a file or another module.
_UNINITIALISED = object()


class _Lookup(torch.autograd.Function):
    """out = weight[ids] by the core; backward reduces rows per unique id."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, sparse, out_device):
        num_rows, dim = weight.shape
        out = host_scratch(*ids.shape, dim)
        _C.gather(
            weight.data_ptr(), num_rows, dim, ids.data_ptr(), ids.numel(), ids.dtype == torch.int64, out.data_ptr()
        )
        ctx.save_for_backward(ids)
        ctx.table_shape = (num_rows, dim)
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        ctx.sparse = sparse
        if out_device.type != "cpu":
            out = out.to(out_device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        (ids,) = ctx.saved_tensors
        num_rows, dim = ctx.table_shape
        rows = grad_out.to(device="cpu", dtype=torch.float32).contiguous().view(-1, dim)
        indices, values = reduce_rows(ids.view(-1), rows, num_rows, ctx.padding_idx, ctx.scale_grad_by_freq)
        if ctx.sparse:
            grad = row_sparse(indices, values, num_rows)
        else:
            grad = torch.zeros(num_rows, dim, dtype=torch.float32)
            grad.index_copy_(0, indices, values)
        return grad, None, None, None, None, None


class Embedding(nn.Module):
    r"""A drop-in for :class:`torch.nn.Embedding` whose table lives in host memory.

    Same signature and semantics as ``torch.nn.Embedding``, with these
    differences:

    * ``sparse=True`` by default: a dense gradient of a host table costs the
      whole table per step (``sparse=False`` works, and warns).
    * ``device`` says where outputs land; the table always stays in host
      memory, and ``.to()`` / ``.cuda()`` / ``.cpu()`` only move the outputs.
      With outputs on a GPU (and the extension built with CUDA), lookups run
      on the GPU: ids may be on the CPU or the GPU, rows are read straight
      from the pinned table, and gradients are reduced on the GPU.
    * The table is always float32; ``dtype`` other than float32 is refused and
      ``.half()``-style casts of a model leave it float32.
    * ``scale_grad_by_freq`` works with sparse gradients too.

    Train it with :class:`hostembed.SparseAdam`, which updates the table and
    its state in place in the C core.
    """

    __constants__ = ["num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"]

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=True, _weight=None, _freeze=False, device=None, dtype=None):
        super().__init__()
        if dtype is not None and dtype != torch.float32:
            raise TypeError(f"hostembed.Embedding keeps float32 tables; dtype={dtype} is not supported")
        if num_embeddings < 0 or embedding_dim < 0:
            raise ValueError(
                f"num_embeddings and embedding_dim must be >= 0, got {num_embeddings} and {embedding_dim}"
            )
        # padding_idx checks and their AssertionErrors are torch's own.
        if padding_idx is not None:
            if padding_idx > 0:
                assert padding_idx < num_embeddings, "Padding_idx must be within num_embeddings"
            elif padding_idx < 0:
                assert padding_idx >= -num_embeddings, "Padding_idx must be within num_embeddings"
                padding_idx = num_embeddings + padding_idx
        if _weight is not None and _weight is not _UNINITIALISED:
            assert list(_weight.shape) == [num_embeddings, embedding_dim], (
                "Shape of weight does not match num_embeddings and embedding_dim"
            )
        if not sparse:
            warnings.warn(
                "hostembed.Embedding(sparse=False): every backward builds a dense gradient as large as the "
                f"whole table ({num_embeddings * embedding_dim * 4} bytes); use sparse=True with "
                "hostembed.SparseAdam unless you need a dense optimizer",
                stacklevel=2,
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._output_device = torch.device("cpu") if device is None else torch.device(device)
        if self._output_device.type == "cuda":
            require_cuda(f"hostembed.Embedding(device={str(self._output_device)!r})")

        table = host_zeros(num_embeddings, embedding_dim, first_touch=True)
        self.weight = nn.Parameter(table, requires_grad=not _freeze)
        register_table(self.weight)
        if _weight is None:
            self.reset_parameters()
        elif _weight is not _UNINITIALISED:
            copy_rows(self.weight.data, _weight)

    def reset_parameters(self) -> None:
        # Same draws as nn.Embedding: torch.manual_seed(s) gives both the same table.
        nn.init.normal_(self.weight)
        self._fill_padding_idx_with_zero()

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    @property
    def output_device(self) -> torch.device:
        """Where forward's outputs land (the table itself stays in host memory)."""
        return self._output_device

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._output_device.type == "cuda":
            out = _gpu.lookup(self, input)
            if out is not None:
                return out
        ids = prepare_ids(input)
        # A GPU lookup's max_norm may still be writing rows this reads.
        wait_for_gpu_use(self.weight)
        if self.max_norm is not None:
            with torch.no_grad():
                _C.renorm(self.weight.data_ptr(), self.num_embeddings, self.embedding_dim, ids.data_ptr(),
                          ids.numel(), ids.dtype == torch.int64, float(self.max_norm), float(self.norm_type))
        return _Lookup.apply(self.weight, ids, self.padding_idx, self.scale_grad_by_freq, self.sparse,
                             self._output_device)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.cpu()/.half() arrive here as fn over every tensor.
        # Moving a 50 GB table to the GPU is exactly what this module exists
        # to avoid: see where fn would send a tensor and send outputs there.
        # The probe starts where outputs go now, so that a dtype-only cast
        # (model.cuda().half()) keeps them there.
        try:
            device = fn(torch.empty(0, device=self._output_device)).device
        except (AssertionError, RuntimeError) as exc:
            # Only a move to a device torch cannot use fails on an empty
            # tensor: say why in hostembed's words.
            reason = unavailable_reason()
            if reason is None:
                raise
            raise RuntimeError(f"hostembed: moving hostembed.Embedding outputs to the GPU needs the GPU path, "
                               f"but {reason}") from exc
        if device.type == "cuda":
            require_cuda(f"hostembed.Embedding outputs on {device}")
        self._output_device = device
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # state_dict() aliases the table, and torch.save reads it right
        # away: a max_norm renorm kernel of the last GPU lookup may still be
        # writing rows.
        wait_for_gpu_use(self.weight)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Always copy into the host table (load_state_dict(assign=True)
        # would otherwise swap it for the caller's tensor), and copy in row
        # chunks so a torch.load(mmap=True) source is never resident whole:
        # the chunk copy releases the file's pages as it goes. torch's own
        # code then does the bookkeeping (missing/unexpected keys, shape
        # errors, hooks) against a source that is the table itself, which
        # copy_ skips.
        wait_for_gpu_use(self.weight)  # no kernel may still read the rows about to change
        key = prefix + "weight"
        source = state_dict.get(key)
        if isinstance(source, torch.Tensor) and source.shape == self.weight.shape and source.is_floating_point() \
                and source.data_ptr() != self.weight.data_ptr():
            copy_rows(self.weight.data, source.detach(), desc=f"loading {key}")
            state_dict = dict(state_dict)
            state_dict[key] = self.weight.detach()
        local_metadata = dict(local_metadata, assign_to_params_buffers=False)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        s = "{num_embeddings}, {embedding_dim}"
        if self.padding_idx is not None:
            s += ", padding_idx={padding_idx}"
        if self.max_norm is not None:
            s += ", max_norm={max_norm}"
        if self.norm_type != 2:
            s += ", norm_type={norm_type}"
        if self.scale_grad_by_freq is not False:
            s += ", scale_grad_by_freq={scale_grad_by_freq}"
        if self.sparse is not False:
            s += ", sparse=True"
        if self._output_device.type != "cpu":
            s += ", device={_output_device}"
        return s.format(**self.__dict__)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, sparse=True, *, key=None, progress=None):
        """A new host table holding the rows of `embeddings` (torch's signature, plus file loading).

        embeddings: a 2-D tensor, or a path (str or os.PathLike) to a file:
        ``.npy``; ``.safetensors``; ``.pt``/``.pth`` written by torch.save
        (a tensor, or a state_dict-like mapping, nested mappings addressed
        with dotted keys). key: the entry to load; by default the file's only
        2-D float tensor, else ``"weight"``. float16, bfloat16 and float64
        rows are converted to float32 on the way in.

        Rows stream into the table in bounded chunks, so loading needs the
        table's memory plus a few chunks, never the file's size again.
        progress: show a tqdm bar (None: for files of 1 GiB and more, on a
        terminal).
        """
        if isinstance(embeddings, torch.Tensor):
            if key is not None:
                raise ValueError("from_pretrained: key= applies to files, not to a tensor")
            assert embeddings.dim() == 2, "Embeddings parameter is expected to be 2-dimensional"
            source = embeddings
        elif isinstance(embeddings, (str, os.PathLike)):
            source = open_table(embeddings, key)
        else:
            raise TypeError(
                "from_pretrained expects a 2-D tensor or a path (str or os.PathLike), got "
                f"{type(embeddings).__name__}"
            )
        rows, cols = source.shape
        emb = cls(num_embeddings=rows, embedding_dim=cols, _weight=_UNINITIALISED, _freeze=freeze,
                  padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                  scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        if isinstance(source, FileRows):
            read_rows(source, emb.weight.data, progress=progress)
        else:
            copy_rows(emb.weight.data, source.detach(), progress=progress)
        return emb
