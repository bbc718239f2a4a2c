"""hostembed.Embedding: torch.nn.Embedding with the table in host memory."""
import torch
from torch import nn

from .._core.ids import prepare_ids
from .._core.ops import cpu as cpu_ops
from .._core.table import check_table_dtype
from .host_module import UNINITIALISED, HostTableModule, check_cache_rows, padding_index, pretrained_source
from .lookup import cached as _lookup_cached, cpu as _lookup_cpu, gpu as _lookup_gpu
from .lookup.prefetch import Prefetch


class Embedding(HostTableModule, nn.Embedding):
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
    * The table is float32, float16, bfloat16 or float64 (``dtype``, torch's
      default dtype if None); module casts (``.half()``, ``.double()``,
      ``.to(dtype)``...) convert it in host memory, and outputs and
      gradients are in its dtype, as with torch. Arithmetic runs in float32
      for float16 / bfloat16 tables (rounded on store; see
      ``stochastic_rounding``) and in float64 for float64 ones; optimizer
      state is float32 (float64 for float64 tables). GPU outputs of tables
      other than float32 are looked up by the CPU core and copied.
    * ``scale_grad_by_freq`` works with sparse gradients too.

    It is a subclass of ``torch.nn.Embedding``, so code that recognises
    embedding modules (DistributedDataParallel's sparse-gradient handling,
    weight-decay exclusions, ``isinstance`` checks) treats it as one; every
    method that touches the table is its own.

    Train it with :class:`hostembed.SparseAdam`, which updates the table and
    its state in place in the C core. :meth:`from_pretrained` makes a table
    from a tensor or a file.

    Args:
        num_embeddings (int): size of the dictionary of embeddings: the
            table's number of rows (>= 0; ValueError otherwise).
        embedding_dim (int): the size of each embedding vector: the table's
            number of columns (>= 0; ValueError otherwise).
        padding_idx (int, optional): if given, the entries at
            ``padding_idx`` do not contribute to the gradient; therefore the
            embedding vector at ``padding_idx`` is not updated during
            training, i.e. it remains as a fixed "pad". A new table's row
            there is zeros, as torch's. A negative index counts from the end
            (``num_embeddings + padding_idx``); one outside
            ``[-num_embeddings, num_embeddings)`` raises AssertionError, as
            torch's. Default: None
        max_norm (float, optional): if given, each embedding vector a lookup
            reads whose norm is larger than ``max_norm`` is renormalized to
            have norm ``max_norm`` first, in place in the host table (torch
            also writes its weight in place). Refused with ``cache_rows``
            (ValueError). Default: None
        norm_type (float, optional): the p of the p-norm to compute for the
            ``max_norm`` option. Default: ``2.0``
        scale_grad_by_freq (bool, optional): if True, gradients are scaled
            by the inverse of the frequency of the words in the mini-batch;
            here with sparse gradients too. Default: ``False``
        sparse (bool, optional): if True, the gradient with respect to
            ``weight`` is a row-sparse tensor over the rows looked up, which
            every hostembed optimizer takes (torch's default is False).
            False builds a dense gradient as large as the whole table at
            every backward, and warns (UserWarning). Default: ``True``
        device (torch.device or str, optional): where forward's outputs
            land, and so where lookups run (see above); the table itself
            stays in host memory. A CUDA device needs the extension built
            with CUDA and a GPU that CUDA can use (RuntimeError otherwise).
            Default: None (the CPU)
        dtype (torch.dtype, optional): the table's dtype: torch.float32,
            torch.float16, torch.bfloat16 or torch.float64 (TypeError for
            any other); outputs and gradients are in it. Default: None
            (torch's default dtype)
        cache_rows (int, optional): keyword-only. Keep up to that many rows,
            with their optimizer state, in a cache (records of a row and its
            state): rows found there are read and updated there, misses are
            brought in or, when the policy turns them away, read and updated
            in host memory, and rows leaving it are written back. Training
            gives the same bits as without it, but where a row takes
            gradient from several entries of one step in two ways (a table
            looked up more than once before a step, with a row repeated
            within one of the lookups; torch's own optimizers stepping the sparse
            gradient themselves): there the cached lookup sums each
            lookup's entries of a row first, the uncached gradient sums all
            of the step's entries in the order autograd gathered them, and the two differ by float32
            rounding of that sum. Reading ``weight``,
            ``state_dict()``, ``hostembed.save`` and the optimizers'
            ``state_dict()`` write the cache back first; references to the
            weight or to optimizer state kept from earlier see host memory
            (``flush_cache()`` brings it up to date). ``cache_stats`` counts
            hits, misses and bytes moved. The cache's lookups run eagerly (a
            graph break under torch.compile); max_norm and stochastic
            rounding are refused with it. With GPU outputs and a float32
            table the records are in GPU memory and SparseAdam, SGD,
            Adagrad and RowWiseAdagrad update them there; otherwise (or
            after the first step of another optimizer) they are in host
            memory, which saves nothing. An int in
            ``[1, 2**28 - 1)`` (TypeError for a non-int, ValueError out of
            range); with ``storage``, the rows of its row cache.
            Default: None (no cache)
        storage (str or os.PathLike, optional): keyword-only, a directory.
            Keep the table, and the state of the optimizer that trains it,
            in files there, with only its hot rows in RAM: a row cache of
            ``ram_budget`` bytes or of ``cache_rows`` rows (one of the two,
            ValueError otherwise). Misses are read and evictions written by
            the core's threads with many requests in flight, around the page
            cache where rows are whole 512-byte sectors. Training gives the
            same bits as the table in memory. A directory that holds a table
            opens it (shape and dtype must match; nothing is read until
            looked up); an empty or new one gets a new table, initialised as
            torch's (a path to a file raises NotADirectoryError). The files
            hold every row only after a flush
            (``flush_cache()``; reading ``weight``, ``state_dict()``,
            ``hostembed.save``, and the module's end, at garbage collection
            or the interpreter's exit): a table whose process died with rows
            not written back refuses to open. The optimizer's state lives as
            long as the optimizer (files removed with it); a checkpoint
            (``hostembed.save``) keeps state and step. A failed read or
            write (a full disk, an I/O error, a file cut short or removed)
            raises OSError naming the file and row, and the table takes no
            more steps: what the last completed step left is in the files
            and the cache, and ``flush_cache()`` writes it. Records stay in
            host memory with GPU outputs. Default: None (the table in
            memory)
        ram_budget (int or str, optional): keyword-only, with ``storage``
            only (ValueError without it): the bytes of RAM for the row
            cache of a table on disk, an int or a string such as ``"8GiB"``
            or ``"512MB"`` (> 0, and enough for one record), counted for a
            row and two rows of optimizer state, as SparseAdam's (an
            optimizer with less state leaves part of it unused). Give
            ``cache_rows`` instead to count in rows. Default: None
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=True, _weight=None, _freeze=False, device=None, dtype=None, *,
                 cache_rows=None, storage=None, ram_budget=None):
        # nn.Module's, not nn.Embedding's: that one would allocate a table.
        nn.Module.__init__(self)
        self.padding_idx = padding_index(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        check_cache_rows("hostembed.Embedding", cache_rows, max_norm)
        self._init_table(num_embeddings, embedding_dim, sparse, _weight, _freeze, device, dtype, cache_rows,
                         storage, ram_budget)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The rows of the ids in ``input``, as ``torch.nn.Embedding``'s
        forward (``max_norm`` renorms the rows it reads in the table first).

        Args:
            input (Tensor): ids of any shape ``(*)``, torch.int64 or
                torch.int32 (IdDtypeError for any other dtype), on any
                device; an id outside ``[0, num_embeddings)`` raises
                IndexError.

        Returns:
            Tensor: shape ``(*, embedding_dim)``, the table's rows in its
            dtype, on ``output_device``; differentiable with respect to
            ``weight`` (a row-sparse gradient when ``sparse``).
        """
        out = _lookup_cpu.small_lookup(self, input)
        if out is not None:
            self._record_path("cpu")
            return out
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # Eager bookkeeping; the ops check the same facts at run time,
            # compiled or not.
            self._prepare_weight()
        if self._table.cache is not None:
            if not compiling:
                self._record_path("cache")
            return _lookup_cached.lookup(self, input)
        gpu = self._output_device.type == "cuda" and self._table.kernels_read_it
        out = (_lookup_gpu if gpu else _lookup_cpu).lookup(self, input)
        if not compiling:
            self._record_path("gpu" if gpu else "cpu")
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

        With a row cache (any output device), it plans the batch of `ids`
        in the cache and brings in its rows (on the CPU, those this step's
        update changes in host memory excepted: the lookup brings them in
        after the update); the lookup of those ids then finds its rows in
        place. With the cache in GPU memory, the ids' dedup (the one wait
        for the GPU of a cached step) happens here, so the lookup waits for
        nothing.
        """
        self._prepare_weight()
        if self._table.cache is not None:
            if self.max_norm is None:
                _lookup_cached.plan_ahead(self._table, ids, -1 if self.padding_idx is None else self.padding_idx)
            return
        if self._output_device.type != "cpu":
            raise NotImplementedError(
                f"hostembed.Embedding.prefetch: implemented for CPU outputs; this module's outputs are on "
                f"{self._output_device}")
        # A copy: the caller may refill its ids tensor before the lookup.
        ids = prepare_ids(ids).clone()
        table = self._table
        table.prefetch = None
        if self.max_norm is None:
            table.prefetch = Prefetch(table, self.weight, ids, *cpu_ops.gather_later(self.weight, ids))

    def _get_name(self):
        return "hostembed.Embedding"

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, sparse=True, *, key=None, progress=None, cache_rows=None,
                        storage=None, ram_budget=None):
        """A new host table holding the rows of `embeddings` (torch's signature, plus file loading).

        embeddings: a 2-D tensor, or a path (str or os.PathLike) to a file:
        ``.npy``; ``.safetensors``; ``.pt``/``.pth`` written by torch.save
        (a tensor, or a state_dict-like mapping, nested mappings addressed
        with dotted keys). key: the entry to load; by default the file's only
        2-D float tensor, else ``"weight"``. The table keeps the source's
        dtype (float32, float16, bfloat16 or float64; TypeError for others).

        Rows stream into the table in bounded chunks, so loading needs the
        table's memory plus a few chunks, never the file's size again.
        progress: show a tqdm bar (None: for files of 1 GiB and more, on a
        terminal). cache_rows, storage, ram_budget: as the constructor's;
        with storage, the rows stream into the table's new files (a
        directory that already holds a table is refused), so a table larger
        than RAM is made from a file in bounded memory.
        """
        source = pretrained_source(embeddings, key)
        rows, cols = source.shape
        check_table_dtype(source.dtype, "hostembed.Embedding.from_pretrained")
        emb = cls(num_embeddings=rows, embedding_dim=cols, _weight=UNINITIALISED, _freeze=freeze,
                  dtype=source.dtype,
                  padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                  scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, cache_rows=cache_rows, storage=storage,
                  ram_budget=ram_budget)
        emb._fill_from(source, progress)
        if storage is not None:
            emb.flush_cache()  # the files hold every row: the table opens again
        return emb
