"""hostembed.EmbeddingBag: torch.nn.EmbeddingBag with the table in host memory."""
import torch
import torch.nn.functional as F
from torch import nn

from .._core.ids import prepare_ids
from .._core.ops import cpu as cpu_ops
from .._core.table import check_table_dtype
from .host_module import UNINITIALISED, HostTableModule, check_cache_rows, padding_index, pretrained_source
from .lookup import bag_cpu as _bag_cpu, bag_input as _bags, cached as _lookup_cached
from .lookup import cpu as _lookup_cpu, gpu as _lookup_gpu
from .lookup.cpu import max_norm_of


class EmbeddingBag(HostTableModule, nn.EmbeddingBag):
    r"""A drop-in for :class:`torch.nn.EmbeddingBag` whose table lives in host memory.

    Same signature and semantics as ``torch.nn.EmbeddingBag``: modes
    ``"sum"``, ``"mean"`` and ``"max"``; 2-D input (fixed-length bags), 1-D
    input with ``offsets`` (and ``include_last_offset``), or a nested
    tensor; ``per_sample_weights`` (sum mode); ``padding_idx`` left out of
    the pooling (and of a mean's count); empty bags give zeros;
    ``max_norm``; ``scale_grad_by_freq`` (not with max, as torch).

    How a batch runs: the core sorts the ids once and reads each distinct
    row once (the lookup of hostembed.Embedding, on the unique ids: range
    check, max_norm, GPU or CPU path); torch's own embedding_bag then pools
    those rows on the output device, so pooling, its order and its
    gradients (per_sample_weights' too) are torch's. The table's gradient
    is row-sparse over the distinct ids, like hostembed.Embedding's, and
    every hostembed optimizer (fused SparseAdam too) trains it.

    ``cache_rows``, ``storage`` and ``ram_budget`` (keyword-only) are
    hostembed.Embedding's: the distinct rows of a batch are looked up
    through the row cache, then pooled as without one (sum and mean by the
    core from those rows, with a cache of host records: the same bits).

    Differences from torch, as for hostembed.Embedding: ``sparse=True`` by
    default (and allowed with mode ``"max"``, which torch refuses); the
    table stays in host memory and ``device`` / ``.to()`` move the outputs;
    the table's dtype is any of hostembed.Embedding's (bags are pooled in
    it, by torch's embedding_bag); an input with offsets that decrease raises
    RuntimeError (torch may read out of bounds).

    Args:
        num_embeddings (int): size of the dictionary of embeddings: the
            table's number of rows (>= 0; ValueError otherwise).
        embedding_dim (int): the size of each embedding vector: the table's
            number of columns (>= 0; ValueError otherwise).
        max_norm (float, optional): if given, each embedding vector a lookup
            reads whose norm is larger than ``max_norm`` is renormalized to
            have norm ``max_norm`` before the pooling, in place in the host
            table (as torch writes its weight). Refused with ``cache_rows``
            (ValueError). Default: None
        norm_type (float, optional): the p of the p-norm to compute for the
            ``max_norm`` option. Default: ``2.0``
        scale_grad_by_freq (bool, optional): if True, gradients are scaled
            by the inverse of the frequency of the words in the mini-batch.
            Not with ``mode="max"`` (ValueError, as torch). Default:
            ``False``
        mode (str, optional): ``"sum"``, ``"mean"`` or ``"max"``: how each
            bag is reduced. ``"sum"`` computes the weighted sum, taking
            ``per_sample_weights`` into account; ``"mean"`` the average of
            the bag's rows; ``"max"`` the maximum over the bag, column by
            column. Any other raises ValueError. Default: ``"mean"``
        sparse (bool, optional): if True, the gradient with respect to
            ``weight`` is a row-sparse tensor over the bags' distinct rows
            (also with ``mode="max"``, which torch refuses; torch's default
            is False). False builds a dense gradient as large as the whole
            table at every backward, and warns (UserWarning). Default:
            ``True``
        include_last_offset (bool, optional): if True, ``offsets`` has one
            more element than there are bags, the last one the size of
            ``input``: the CSR format. Default: ``False``
        padding_idx (int, optional): if given, the entries at
            ``padding_idx`` do not contribute to the gradient, so the
            embedding vector at ``padding_idx`` is not updated during
            training, and they are left out of the pooling (and of a mean's
            count). A new table's row there is zeros. A negative index counts
            from the end; one outside ``[-num_embeddings, num_embeddings)``
            raises AssertionError, as torch's. Default: None
        device (torch.device or str, optional): where forward's outputs
            land, as :class:`hostembed.Embedding`'s; the table stays in host
            memory. Default: None (the CPU)
        dtype (torch.dtype, optional): the table's dtype, as
            :class:`hostembed.Embedding`'s (float32, float16, bfloat16 or
            float64; TypeError for any other); bags are pooled in it.
            Default: None (torch's default dtype)
        cache_rows (int, optional): keyword-only: a row cache of that many
            rows, as :class:`hostembed.Embedding`'s. Default: None
        storage (str or os.PathLike, optional): keyword-only: a directory
            that keeps the table on disk, as :class:`hostembed.Embedding`'s.
            Default: None
        ram_budget (int or str, optional): keyword-only, with ``storage``:
            the bytes of RAM for its row cache, as
            :class:`hostembed.Embedding`'s. Default: None
    """

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                 mode="mean", sparse=True, _weight=None, include_last_offset=False, padding_idx=None,
                 device=None, dtype=None, *, _freeze=False, cache_rows=None, storage=None, ram_budget=None):
        # nn.Module's, not nn.EmbeddingBag's: that one would allocate a table.
        nn.Module.__init__(self)
        _bags.check_options(mode, scale_grad_by_freq)
        self.padding_idx = padding_index(padding_idx, num_embeddings, "padding_idx")
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.mode = mode
        self.include_last_offset = include_last_offset
        check_cache_rows("hostembed.EmbeddingBag", cache_rows, max_norm)
        self._init_table(num_embeddings, embedding_dim, sparse, _weight, _freeze, device, dtype, cache_rows, storage,
                         ram_budget)

    def forward(self, input, offsets=None, per_sample_weights=None):
        """The pooled bags of ``input``, as ``torch.nn.EmbeddingBag``'s
        forward.

        Args:
            input (Tensor): the ids (torch.int64 or torch.int32; IdDtypeError
                for any other dtype), in bags: 2-D ``(B, N)``, B bags of N
                ids each (``offsets`` must be None); 1-D ``(n,)``, the bags
                one after the other, with ``offsets``; or a nested tensor of
                B bags. Other shapes raise ValueError, as torch. An id outside ``[0, num_embeddings)`` raises
                IndexError.
            offsets (Tensor, optional): with a 1-D ``input``, where each bag
                starts in it: ``(B,)``, or ``(B + 1,)`` with
                ``include_last_offset``. Offsets that decrease raise
                RuntimeError. Default: None
            per_sample_weights (Tensor, optional): a weight for each id, of
                ``input``'s shape (nested with a nested ``input``) and the
                table's dtype, which scales its row before the sum;
                ``mode="sum"`` only (NotImplementedError otherwise, as
                torch). None: every weight 1. Default: None

        Returns:
            Tensor: shape ``(B, embedding_dim)``, one pooled row per bag (an
            empty bag gives zeros), in the table's dtype, on
            ``output_device``.
        """
        out = _bag_cpu.small_bags(self, input, offsets, per_sample_weights)
        if out is not None:
            self._record_path("cpu")
            return out
        pools_on_cpu = self._pools_on_cpu()
        ids, offsets, per_sample_weights, include_last_offset = self._bags(input, offsets, per_sample_weights,
                                                                           pools_on_cpu)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._prepare_weight()
        gpu = self._output_device.type == "cuda" and self._table.kernels_read_it
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        if pools_on_cpu:
            # The parameter itself: self.weight would redo _prepare_weight's checks.
            out = _bag_cpu.pooled_lookup(
                self._parameters["weight"], ids, offsets, per_sample_weights,
                (self.mode, include_last_offset, padding_idx, max_norm_of(self), float(self.norm_type),
                 self.scale_grad_by_freq, self._sparse_gradient()))
            self._record_path("cpu")
            device = self._output_device
            return out if device.type == "cpu" else out.to(device)
        if compiling:
            return self._traced_bags(ids, offsets, per_sample_weights, include_last_offset, gpu, padding_idx)
        cache = self._table.cache
        if cache is not None and cache.device.type == "cpu" and self.mode != "max":
            return self._cached_bags(ids, offsets, per_sample_weights, include_last_offset, padding_idx)
        unique, inverse = self._unique(ids, gpu)
        # Each distinct row once, renormed (max_norm) and range-checked by
        # the lookup; its backward sums the rows' gradients into the table's.
        if cache is not None:  # eager only: a cached lookup is a graph break
            rows = _lookup_cached.lookup(self, unique, scale_grad_by_freq=False)
            self._record_path("cache")
        else:
            rows = (_lookup_gpu if gpu else _lookup_cpu).lookup(self, unique, scale_grad_by_freq=False)
            if not compiling:
                self._record_path("gpu" if gpu else "cpu")
        device = rows.device
        inverse = inverse.to(device)
        if self.scale_grad_by_freq and rows.requires_grad:
            # Each row's gradient over its id's count in the batch. (Not
            # embedding_bag's own flag: torch 2.13's CPU kernel divides some
            # rows by another id's count, pytorch/pytorch#190063.)
            counts = torch.bincount(inverse, minlength=unique.numel()).clamp_(min=1).to(rows.dtype)
            rows.register_hook(lambda grad: grad / counts.unsqueeze(1))
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device)
        return F.embedding_bag(inverse, rows, offsets.to(device), mode=self.mode, sparse=False,
                               per_sample_weights=per_sample_weights, include_last_offset=include_last_offset,
                               padding_idx=_bag_cpu.padding_row(unique, padding_idx))

    def _cached_bags(self, ids, offsets, per_sample_weights, include_last_offset, padding_idx):
        """Sum and mean bags through a row cache of host records: the
        batch's distinct rows from the cache, pooled by the core as from
        the table (PooledRows: the uncached bits); outputs copied to their
        device."""
        unique, inverse = self._unique(ids, False)
        rows = _lookup_cached.lookup(self, unique, scale_grad_by_freq=False, device=torch.device("cpu"))
        self._record_path("cache")
        at = _bag_cpu.padding_row(unique, padding_idx)
        out = _bag_cpu.PooledRows.apply(
            rows, None if per_sample_weights is None else per_sample_weights.to("cpu"), inverse.to(ids.dtype),
            offsets.to("cpu"), (self.mode, include_last_offset, -1 if at is None else at, self.scale_grad_by_freq))
        device = self._output_device
        return out if device.type == "cpu" else out.to(device)

    def _bags(self, input, offsets, per_sample_weights, pools_on_cpu=None):
        """(ids, offsets, per_sample_weights, include_last_offset): the
        input in any form torch takes, checked (_bags.flatten); ids and
        weights on the CPU when the CPU path pools them (pools_on_cpu:
        self._pools_on_cpu(), when the caller has it)."""
        _bags.check_options(self.mode, self.scale_grad_by_freq)
        if pools_on_cpu is None:
            pools_on_cpu = self._pools_on_cpu()
        # The core checks the offsets as it pools (without max_norm, whose
        # renorm writes rows before the pooling).
        ids, offsets, per_sample_weights, include_last_offset = _bags.flatten(
            input, offsets, per_sample_weights, self.mode, self.include_last_offset, self._table.dtype,
            core_checks_offsets=pools_on_cpu and self.max_norm is None)
        if pools_on_cpu:
            ids = prepare_ids(ids, _bags.WHO)
            if not offsets.is_cpu:
                offsets = offsets.to("cpu")
            if per_sample_weights is not None and not per_sample_weights.is_cpu:
                per_sample_weights = per_sample_weights.to("cpu")
        return ids, offsets, per_sample_weights, include_last_offset

    def _pools_on_cpu(self) -> bool:
        """Whether forward pools in the core, on the CPU (PooledLookup):
        eager, sum or mean, outputs not read by the GPU kernels."""
        return not (torch.compiler.is_compiling() or self.mode == "max" or self._table.cache is not None
                    or (self._output_device.type == "cuda" and self._table.kernels_read_it))

    def _traced_bags(self, ids, offsets, per_sample_weights, include_last_offset, gpu, padding_idx):
        """The bags for torch.compile, with no data-dependent shape: every
        id's row by the Embedding lookup op (whose backward sums each id's
        gradient rows, leaving padding_idx out), pooled by embedding_bag
        over those rows with padding positions pointed at an extra zero
        row that embedding_bag leaves out, as torch leaves padding_idx out."""
        rows = (_lookup_gpu if gpu else _lookup_cpu).lookup(self, ids)
        count, device = rows.shape[0], rows.device
        positions = torch.arange(count, device=device)
        if padding_idx >= 0:
            positions = torch.where(ids.to(device) == padding_idx, count, positions)
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device)
        return F.embedding_bag(positions, rows, offsets.to(device), mode=self.mode, sparse=False,
                               per_sample_weights=per_sample_weights, include_last_offset=include_last_offset,
                               padding_idx=count)

    def _unique(self, ids, gpu):
        """(unique ids, inverse): by the core's sort for CPU ids, by torch's
        on the GPU for GPU ids (the lookup range-checks them)."""
        if gpu and ids.device.type == "cuda":
            return torch.unique(ids, return_inverse=True)
        return cpu_ops.unique_ids(ids.to("cpu"), self.num_embeddings)

    def _get_name(self):
        return "hostembed.EmbeddingBag"

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                        mode="mean", sparse=True, include_last_offset=False, padding_idx=None, *, key=None,
                        progress=None, cache_rows=None, storage=None, ram_budget=None):
        """A new host table holding the rows of `embeddings`: torch's
        signature, and a tensor or a file as in
        :meth:`hostembed.Embedding.from_pretrained` (cache_rows, storage and
        ram_budget too)."""
        source = pretrained_source(embeddings, key)
        rows, cols = source.shape
        check_table_dtype(source.dtype, "hostembed.EmbeddingBag.from_pretrained")
        bag = cls(num_embeddings=rows, embedding_dim=cols, _weight=UNINITIALISED, _freeze=freeze,
                  dtype=source.dtype,
                  max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, mode=mode,
                  sparse=sparse, include_last_offset=include_last_offset, padding_idx=padding_idx,
                  cache_rows=cache_rows, storage=storage, ram_budget=ram_budget)
        bag._fill_from(source, progress)
        if storage is not None:
            bag.flush_cache()  # the files hold every row: the table opens again
        return bag
