"""hostembed.Embedding: torch.nn.Embedding with the table in host memory."""
import copy
import os
import warnings

import torch
from torch import nn

from . import _lookup_cpu, _lookup_gpu, _ops, _validate
from ._cuda import require_cuda, resolve_device, unavailable_reason
from ._files import FileRows, open_table
from ._ids import prepare_ids
from ._prefetch import Prefetch
from ._stream import copy_rows, read_rows
from ._table import HostTable

# _weight value that leaves a new table zeroed instead of drawing N(0, 1):
# for tables about to be filled from a file or another module.
_UNINITIALISED = object()


class Embedding(nn.Embedding):
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

    It is a subclass of ``torch.nn.Embedding``, so code that recognises
    embedding modules (DistributedDataParallel's sparse-gradient handling,
    weight-decay exclusions, ``isinstance`` checks) treats it as one; every
    method that touches the table is its own.

    Train it with :class:`hostembed.SparseAdam`, which updates the table and
    its state in place in the C core.
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=True, _weight=None, _freeze=False, device=None, dtype=None):
        # nn.Module's, not nn.Embedding's: that one would allocate a table.
        nn.Module.__init__(self)
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

        self._table = HostTable(num_embeddings, embedding_dim, first_touch=True)
        self.weight = nn.Parameter(self._table.tensor, requires_grad=not _freeze)
        self._table.bind(self.weight)
        # "gpu" or "cpu": which path the last forward took (tests assert the
        # GPU kernels ran, not the CPU fallback).
        self._last_lookup_path = None
        if _weight is None:
            self.reset_parameters()  # nn.Embedding's: the same draws as torch for the same seed
        elif _weight is not _UNINITIALISED:
            copy_rows(self.weight.data, _weight)

    @property
    def output_device(self) -> torch.device:
        """Where forward's outputs land (the table itself stays in host memory)."""
        return self._output_device

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # Eager bookkeeping; the ops check the same facts at run time,
            # compiled or not.
            self._prepare_weight()
        gpu = self._output_device.type == "cuda" and self._table.register_refused is None
        out = (_lookup_gpu if gpu else _lookup_cpu).lookup(self, input)
        if not compiling:
            self._last_lookup_path = "gpu" if gpu else "cpu"
        return out

    def prefetch(self, ids: torch.Tensor) -> None:
        """Starts gathering the rows of `ids` in the background, for the next
        lookup: call it with the next batch's ids as soon as they are known,
        then run this step as usual. If the module's next call is on the same
        ids, it takes the prefetched rows, re-reading the ones this step's
        optimizer update (or anything else) changed meanwhile, so the output
        is bit for bit what it would be without prefetch; any other call
        drops them. An id out of range raises at that call, as always.
        Writes through ``weight.data`` in between are not seen (torch does
        not track them); write through the weight itself, under no_grad.

        CPU outputs only for now (NotImplementedError for GPU outputs). With
        max_norm, rows are renormed at lookup time, so there is nothing to
        prefetch, and the call does nothing.
        """
        self._prepare_weight()
        if self._output_device.type != "cpu":
            raise NotImplementedError(
                f"hostembed.Embedding.prefetch: implemented for CPU outputs; this module's outputs are on "
                f"{self._output_device}")
        # A copy: the caller may refill its ids tensor before the lookup.
        ids = prepare_ids(ids).clone()
        table = self._table
        table.prefetch = None
        if self.max_norm is None:
            table.prefetch = Prefetch(table, self.weight, ids, *_ops.gather_later(self.weight, ids))

    def _prepare_weight(self) -> None:
        """Checks that the weight still is the table's memory, and pins the
        table on its first GPU lookup (warning and falling back to the CPU
        path if CUDA refuses)."""
        table = self._table
        table.check_process()
        weight = self._parameters["weight"]
        if not table.views(weight):
            self._adopt(weight)
        if self._output_device.type == "cuda" and table.register_refused is None:
            table.device_address(weight, resolve_device(self._output_device))

    def _adopt(self, weight) -> None:
        """`emb.weight.data = t` or `emb.weight = Parameter(t)` replaced the
        table's memory with another tensor: copy its values into the table
        (converting dtype, device and strides) and point the weight back at
        the table, or refuse what cannot be a table's values. The weight
        then no longer aliases t (torch's would)."""
        table = self._table
        new = weight.data
        if new.layout != torch.strided or not new.is_floating_point() or new.dim() != 2 \
                or tuple(new.shape) != (table.num_rows, table.dim):
            raise RuntimeError(
                f"hostembed.Embedding: the weight was replaced by a {list(new.shape)} {new.dtype} tensor"
                f"{'' if new.layout == torch.strided else f' ({new.layout})'}; a host table keeps its shape "
                f"[{table.num_rows}, {table.dim}] and floating-point values. Build a new module for another "
                "shape (hostembed.Embedding.from_pretrained)"
            )
        table.wait_for_gpu_use()
        table.rows_changed(None)
        copy_rows(table.tensor, new.detach())
        weight.data = table.tensor
        table.bind(weight)

    def __getattr__(self, name):
        # In a forked child (a DataLoader worker) the table's memory is not
        # there: say so rather than hand out a weight that cannot be read.
        if name == "weight" and not torch.compiler.is_compiling():
            table = self.__dict__.get("_table")
            if table is not None:
                table.check_process()
        return super().__getattr__(name)

    def __deepcopy__(self, memo):
        # A copy gets its own host table with the same rows (a plain
        # deepcopy would clone the weight into an ordinary tensor and copy
        # the table's memory objects, which cannot be copied).
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        weight = self._parameters["weight"]
        self._table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
        for key, value in self.__dict__.items():
            if key not in ("_table", "_parameters"):
                new.__dict__[key] = copy.deepcopy(value, memo)
        table = HostTable(self._table.num_rows, self._table.dim, first_touch=True)
        copy_rows(table.tensor, weight.detach())
        param = nn.Parameter(table.tensor, requires_grad=weight.requires_grad)
        memo[id(weight)] = param
        new.__dict__["_table"] = table
        new.__dict__["_parameters"] = {"weight": param}
        table.bind(param)
        return new

    def __getstate__(self):
        # Pickling (torch.save(model), spawn-started workers): the weight
        # goes as a tensor, the table's memory objects do not; unpickling
        # builds a new table from it.
        self._table.wait_for_gpu_use()
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_table", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        weight = self._parameters["weight"]
        table = HostTable(*weight.shape, first_touch=True)
        copy_rows(table.tensor, weight.detach())
        param = nn.Parameter(table.tensor, requires_grad=weight.requires_grad)
        self._parameters["weight"] = param
        self.__dict__["_table"] = table
        table.bind(param)

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
        self._table.wait_for_gpu_use()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Always copy into the host table (load_state_dict(assign=True)
        # would otherwise swap it for the caller's tensor), and copy in row
        # chunks so a torch.load(mmap=True) source is never resident whole:
        # the chunk copy releases the file's pages as it goes.
        #
        # All or nothing for this module: torch's own code first does the
        # bookkeeping (missing/unexpected keys, shape errors, hooks) against
        # a source that is the table itself, which copy_ skips; the rows are
        # copied only if that found nothing wrong, so emb.load_state_dict(sd)
        # either loads or raises with the table unchanged. (Inside a larger
        # model, torch's Module.load_state_dict loads module by module and
        # raises after the last: a bad entry of another module is found
        # after this one has loaded, as for any torch module. hostembed.load
        # checks the whole model first.)
        odd = [k for k in state_dict if not isinstance(k, str)]
        if odd:  # torch's own loop would raise AttributeError on k.startswith
            raise TypeError(f"hostembed.Embedding.load_state_dict: state dict keys must be strings, found "
                            f"{', '.join(f'{k!r} ({type(k).__name__})' for k in odd[:5])}")
        key = prefix + "weight"
        source = state_dict.get(key)
        table = self.weight.detach()
        copy_from = None
        if isinstance(source, torch.Tensor) and not _validate.same_memory(source, table):
            problem = _validate.tensor_problem(source, table, key)
            if problem is None:
                # A view of the table itself (its transpose, say) is read
                # whole before the rows it reads are overwritten.
                copy_from = source.detach().clone() if _validate.shares_memory(source, table) else source
            elif not problem.startswith(f"'{key}' has shape"):
                # torch would report a shape mismatch itself (and copy
                # nothing); anything else it might copy, or fail part way.
                error_msgs.append(f"While loading {key!r} into a hostembed table: {problem}")
            if copy_from is not None or not problem.startswith(f"'{key}' has shape"):
                state_dict = dict(state_dict)
                state_dict[key] = table
        local_metadata = dict(local_metadata, assign_to_params_buffers=False)
        errors, unexpected = len(error_msgs), len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # torch's load_state_dict passes strict=True to every module and
        # applies its own `strict` to the unexpected keys afterwards.
        top_strict = _validate.strict_of_running_load()
        refused = len(error_msgs) > errors or (
            (strict if top_strict is None else top_strict) and len(unexpected_keys) > unexpected)
        if copy_from is not None and not refused:
            self._table.wait_for_gpu_use()  # no kernel may still read the rows about to change
            self._table.rows_changed(None)
            copy_rows(self.weight.data, copy_from.detach(), desc=f"loading {key}")

    def _get_name(self):
        return "hostembed.Embedding"

    def extra_repr(self) -> str:
        # torch's options, then where the table and the outputs are.
        return f"{super().extra_repr()}, table in host memory, outputs on {self._output_device}"

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
