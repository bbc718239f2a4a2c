"""What hostembed.Embedding and hostembed.EmbeddingBag share: the host
table behind the weight, the output device, and the module protocol (weight
replacement, copies, pickling, casts, state_dict) done on the table."""
import copy
import os
import warnings

import torch
from torch import nn

from .._cache.gpu_cache import GpuRowCache
from .._cache.row_cache import RowCache, flush_when_done
from .._core.cuda import require_cuda, resolve_device, unavailable_reason
from .._core.ops.cache_plan import MAX_CACHE_ROWS
from .._core.ops.common import CUDA_COMPILED
from .._core.table import HostTable, check_table_dtype, compute_dtype, dtype_name
from .._core.table_files import TableFiles, weight_parameter
from ..io import validate as _validate
from ..io.files import FileRows, open_table
from ..io.stream import copy_rows, read_rows

# _weight value that leaves a new table zeroed instead of drawing N(0, 1):
# for tables about to be filled from a file or another module.
UNINITIALISED = object()


def padding_index(padding_idx, num_embeddings, word="Padding_idx"):
    """padding_idx checked and made non-negative, with torch's own
    AssertionErrors (nn.Embedding's say "Padding_idx", nn.EmbeddingBag's
    "padding_idx")."""
    if padding_idx is not None:
        if padding_idx > 0:
            assert padding_idx < num_embeddings, f"{word} must be within num_embeddings"
        elif padding_idx < 0:
            assert padding_idx >= -num_embeddings, f"{word} must be within num_embeddings"
            padding_idx = num_embeddings + padding_idx
    return padding_idx


def pretrained_source(embeddings, key):
    """The rows from_pretrained loads: a 2-D tensor, or a file's rows."""
    if isinstance(embeddings, torch.Tensor):
        if key is not None:
            raise ValueError("from_pretrained: key= applies to files, not to a tensor")
        assert embeddings.dim() == 2, "Embeddings parameter is expected to be 2-dimensional"
        return embeddings
    if isinstance(embeddings, (str, os.PathLike)):
        return open_table(embeddings, key)
    raise TypeError(
        "from_pretrained expects a 2-D tensor or a path (str or os.PathLike), got "
        f"{type(embeddings).__name__}"
    )


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(value, what):
    """An int of bytes from an int or a string such as "8GiB" / "512 MB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        unit = text[len(digits):]
        try:
            number = int(float(digits) * _UNITS[unit])
        except (ValueError, KeyError, OverflowError):  # OverflowError: "inf", "1e999"
            raise ValueError(f"{what} must be bytes: an int, or a string such as '8GiB' or '512MB'; got "
                             f"{value!r}") from None
    else:
        raise TypeError(f"{what} must be an int or a string such as '8GiB', got {type(value).__name__}")
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return number


def storage_cache_rows(name, num_rows, dim, dtype, cache_rows, ram_budget):
    """The row cache of a table on disk: cache_rows if given, else the
    records that ram_budget holds, counting a row's weight and two rows of
    optimizer state (SparseAdam's; less state leaves part of the budget
    unused)."""
    if (cache_rows is None) == (ram_budget is None):
        raise ValueError(f"{name}(storage=...): give the RAM for its hot rows, as ram_budget= (bytes, or a string "
                         "such as '8GiB') or as cache_rows= (rows), one of the two")
    if cache_rows is not None:
        return min(cache_rows, max(num_rows, 1))
    budget = parse_bytes(ram_budget, f"{name}: ram_budget")
    record = dim * (dtype.itemsize + 2 * compute_dtype(dtype).itemsize)
    rows = budget // max(record, 1)
    if rows < 1:
        raise ValueError(f"{name}: ram_budget={ram_budget!r} holds no row: a row and its optimizer state take "
                         f"{record} bytes")
    return min(rows, max(num_rows, 1))


def check_cache_rows(name, cache_rows, max_norm):
    if cache_rows is None:
        return
    if isinstance(cache_rows, bool) or not isinstance(cache_rows, int):
        raise TypeError(f"{name}: cache_rows must be an int or None, got {type(cache_rows).__name__}")
    if not 1 <= cache_rows < MAX_CACHE_ROWS:
        raise ValueError(f"{name}: cache_rows must be in [1, {MAX_CACHE_ROWS}), got {cache_rows}")
    if max_norm is not None:
        raise ValueError(f"{name}: max_norm renorms rows in host memory at each lookup, which a row "
                         "cache cannot do; use one or the other")


class HostTableModule:
    """Mixin before nn.Embedding / nn.EmbeddingBag in the bases: every
    method that touches the weight goes to the host table."""

    def _init_table(self, num_embeddings, embedding_dim, sparse, _weight, _freeze, device, dtype, cache_rows=None,
                    storage=None, ram_budget=None):
        name = self._get_name()
        # torch's: the default dtype when none is given.
        dtype = torch.get_default_dtype() if dtype is None else dtype
        check_table_dtype(dtype, name)
        if num_embeddings < 0 or embedding_dim < 0:
            raise ValueError(
                f"num_embeddings and embedding_dim must be >= 0, got {num_embeddings} and {embedding_dim}"
            )
        if _weight is not None and _weight is not UNINITIALISED:
            assert list(_weight.shape) == [num_embeddings, embedding_dim], (
                "Shape of weight does not match num_embeddings and embedding_dim"
            )
        if not sparse:
            warnings.warn(
                f"{name}(sparse=False): every backward builds a dense gradient as large as the "
                f"whole table ({num_embeddings * embedding_dim * dtype.itemsize} bytes); use sparse=True with "
                "hostembed.SparseAdam unless you need a dense optimizer",
                stacklevel=3,
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sparse = sparse
        self._output_device = torch.device("cpu") if device is None else torch.device(device)
        if self._output_device.type == "cuda":
            require_cuda(f"{name}(device={str(self._output_device)!r})")

        files = None
        if storage is not None:
            cache_rows = storage_cache_rows(name, num_embeddings, embedding_dim, dtype, cache_rows, ram_budget)
            files = TableFiles(storage, num_embeddings, embedding_dim, dtype)
            if not files.created and _weight is not None:  # from_pretrained's UNINITIALISED too
                files.close()
                raise ValueError(f"{name}: {files.path} already holds a table; its rows are the module's "
                                 "(give a new directory to start from other values)")
            self._table = HostTable(num_embeddings, embedding_dim, dtype=dtype, rows_buffer=files.weight_buffer())
            self._table.files = files
        elif ram_budget is not None:
            raise ValueError(f"{name}: ram_budget= limits the RAM of a table kept on disk; give storage= too")
        else:
            self._table = HostTable(num_embeddings, embedding_dim, dtype=dtype, first_touch=True)
        self.weight = weight_parameter(self._table, requires_grad=not _freeze)
        self._table.bind(self.weight)
        # "gpu" or "cpu": which path the last forward took (tests assert the
        # GPU kernels ran, not the CPU fallback).
        self._last_lookup_path = None
        if files is None or files.created:
            if _weight is None:
                self.reset_parameters()  # torch's: the same draws as torch for the same seed
            elif _weight is not UNINITIALISED:
                copy_rows(self.weight.data, _weight)
        if files is not None:
            flush_when_done(self, self._table)
            if _weight is not UNINITIALISED:  # from_pretrained's rows: once filled
                files.set_clean(True)
        self._cache_rows = cache_rows
        self._make_cache()

    # ---- the row cache (Embedding(cache_rows=N))

    @property
    def cache_rows(self):
        """The rows the module's row cache holds at most (None: no cache).
        Setting it writes the cache back and starts a new one of that size
        (None: none)."""
        return self._cache_rows

    @cache_rows.setter
    def cache_rows(self, value):
        check_cache_rows(self._get_name(), value, self.max_norm)
        if value is None and self._table.files is not None:
            raise ValueError(f"{self._get_name()}: a table kept on disk ({self._table.files.path}) reads and writes "
                             "its rows through its row cache; give it a number of rows, not None")
        if value is not None and self._table.stochastic_rounding:
            raise ValueError(f"{self._get_name()}: a row cache cannot repeat stochastic rounding bit for bit; "
                             "switch stochastic_rounding off first")
        self.flush_cache()
        self._cache_rows = value
        self._make_cache()

    def _make_cache(self) -> None:
        """A new, empty row cache for the table, if the module has one."""
        table = self._table
        table.planned = None
        table.cache = None
        table.twin_wanted = False  # a cached GPU lookup asked for it; the optimizer asks again at its step
        if self._cache_rows and table.num_rows:
            capacity, device = min(self._cache_rows, table.num_rows), self._cache_device()
            table.cache = GpuRowCache(table, capacity, device=device) if device.type == "cuda" \
                else RowCache(table, capacity, lookahead=True)

    def _cache_device(self):
        """Where the cache's records live: on the GPU the outputs go to, for
        float32 tables with the CUDA kernels built; else in host memory.
        A table on disk keeps them in host memory: a GPU cache reads its
        misses over a pinned mapping of the rows, and pinning a file's
        mapping would hold the whole file in RAM."""
        device = self._output_device
        if device.type == "cuda" and CUDA_COMPILED and self._table.dtype == torch.float32 \
                and self._table.files is None:
            return resolve_device(device)
        return torch.device("cpu")

    @property
    def cache_stats(self):
        """The row cache's counts since the module was built (None without a
        cache): batches; rows (unique rows looked up), hits (found in the
        cache), fetches (misses brought in), bypassed (misses read and
        updated in host memory); evictions; fetched_bytes and
        written_back_bytes (records moved: a row and its optimizer state);
        with the records in GPU memory also host_reads (rows of the weight
        and of each state tensor the fetches read over PCIe: a row whose
        state was never written is given zeros for it, unread)."""
        cache = self._table.cache
        return None if cache is None else cache.stats

    def _sparse_gradient(self) -> bool:
        """Whether backward makes weight.grad row-sparse: ``sparse``,
        unless an optimizer that needs a dense gradient has stepped this
        table (optim/torch_optimizers.py)."""
        return self.sparse and not self._table.dense_gradient

    def flush_cache(self) -> None:
        """Writes every row and optimizer state the cache holds newer than
        host memory back to it. Reading the module's ``weight``,
        ``state_dict()``, ``hostembed.save`` and the optimizers'
        ``state_dict()`` do it themselves; call it before reading the table
        or an optimizer's ``state`` through references kept from earlier."""
        cache = self._table.cache
        if cache is not None:
            with self._table.lock:
                cache.flush()

    def _flush_weight(self) -> None:
        cache = self._table.cache
        if cache is not None and cache.holds_newer("weight"):
            with self._table.lock:
                cache.flush(("weight",))

    def _fill_from(self, source, progress):
        """Copies from_pretrained's source (pretrained_source) into the table."""
        if isinstance(source, FileRows):
            read_rows(source, self.weight.data, progress=progress)
        else:
            copy_rows(self.weight.data, source.detach(), progress=progress)

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of forward's outputs: the table's, as with torch."""
        return self._table.dtype

    @property
    def stochastic_rounding(self) -> bool:
        """float16 / bfloat16 tables: whether optimizer updates round the new
        weights stochastically (up or down with probability proportional to
        the distance, so small updates are not lost on average) instead of
        to nearest even. Off by default: on, training is reproducible for a
        given torch.manual_seed and thread count independent, but not bit
        for bit the nearest-rounded result."""
        return self._table.stochastic_rounding

    @stochastic_rounding.setter
    def stochastic_rounding(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {type(value).__name__}")
        if value and self._table.cache is not None:
            raise ValueError(f"{self._get_name()}: stochastic rounding draws per row in host memory, which a row "
                             "cache's records cannot repeat bit for bit; build the module without cache_rows")
        if value and not self._table.seed:
            self._table.seed = int(torch.randint(1, 2**62, (1,)).item())
        self._table.stochastic_rounding = value

    def _retype(self, dtype) -> None:
        """A module cast: the table's rows converted to dtype in host memory
        (row chunks, the old memory freed as they go: HostTable.retype), the
        weight pointed at them. Optimizer state converts at the optimizer's
        next step."""
        weight = self._parameters["weight"]
        self.flush_cache()  # rows and state; the cache starts anew in the new dtype
        new = self._table.retype(dtype, lambda dst, src, release: copy_rows(
            dst, src, release_source=release, desc=f"casting to {dtype}"))
        weight.data = new
        self._table.bind(weight)
        self._make_cache()

    def _use_table(self, table) -> None:
        """Points the module at `table`, a HostTable of its shape and dtype
        (one in memory shared between processes): the weight becomes a new
        parameter over its rows, and the table the module had is dropped."""
        old = self._table
        if (table.num_rows, table.dim, table.dtype) != (old.num_rows, old.dim, old.dtype):
            raise ValueError(f"{self._get_name()}: a [{table.num_rows}, {table.dim}] {table.dtype} table cannot "
                             f"replace a [{old.num_rows}, {old.dim}] {old.dtype} one")
        weight = weight_parameter(table, requires_grad=self._parameters["weight"].requires_grad)
        self._table = table
        self.weight = weight
        table.bind(weight)
        self._make_cache()

    def _record_path(self, path) -> None:
        """Notes which path the last lookup took (tests and benchmarks read
        _last_lookup_path). A plain attribute, set without
        nn.Module.__setattr__, whose checks cost more than a small lookup."""
        self.__dict__["_last_lookup_path"] = path

    @property
    def output_device(self) -> torch.device:
        """Where forward's outputs land (the table itself stays in host memory)."""
        return self._output_device

    def _prepare_weight(self) -> None:
        """Checks that the weight still is the table's memory, and pins the
        table on its first GPU lookup (warning and falling back to the CPU
        path if CUDA refuses)."""
        table = self._table
        table.check_process()
        weight = self._parameters["weight"]
        if not table.views(weight):
            self._adopt(weight)
        if self._output_device.type == "cuda" and table.kernels_read_it and table.cache is None:
            table.device_address(weight, resolve_device(self._output_device))

    def _adopt(self, weight) -> None:
        """`emb.weight.data = t` or `emb.weight = Parameter(t)` replaced the
        table's memory with another tensor: copy its values into the table
        (converting dtype, device and strides) and point the weight back at
        the table, or refuse what cannot be a table's values. The weight
        then no longer aliases t (torch's would)."""
        table = self._table
        new = weight.data
        if new.layout == torch.strided and new.is_floating_point() and new.dim() == 2 \
                and new.shape[1] == table.dim and new.shape[0] != table.num_rows:
            self._resize_to(weight, new)
            return
        if new.layout != torch.strided or not new.is_floating_point() or new.dim() != 2 \
                or tuple(new.shape) != (table.num_rows, table.dim):
            raise RuntimeError(
                f"{self._get_name()}: the weight was replaced by a {list(new.shape)} {new.dtype} tensor"
                f"{'' if new.layout == torch.strided else f' ({new.layout})'}; a host table keeps its shape "
                f"[{table.num_rows}, {table.dim}] and floating-point values. Build a new module for another "
                "shape (from_pretrained)"
            )
        table.wait_for_gpu_use()
        table.rows_changed(None)
        copy_rows(table.tensor, new.detach())
        weight.data = table.tensor
        table.bind(weight)

    def _resize_to(self, weight, new) -> None:
        """`weight.data = t` with t of another number of rows, as Hugging
        Face's resize_token_embeddings does: a new host table of t's rows
        (copied in chunks), under the same Parameter, so ties to it and
        optimizers built afterwards hold. An optimizer's state of the old
        size is torch's problem as for any parameter resized this way (its
        next step refuses the shapes)."""
        old = self._table
        where = f"{self._get_name()}: the weight was replaced by a {list(new.shape)} tensor (a resize)"
        if old.files is not None:
            raise RuntimeError(f"{where}; a table kept on disk ({old.files.path}) keeps its rows: make a new table "
                               "of the new size from a checkpoint (hostembed.load) in another directory")
        if old.fused_optimizer is not None and old.fused_optimizer() is not None:
            raise RuntimeError(f"{where}; it is updated in backward by a fused optimizer of the old size: resize "
                               "before building the optimizer")
        check_table_dtype(new.dtype, self._get_name())
        table = HostTable(new.shape[0], old.dim, dtype=new.dtype, first_touch=True)
        table.stochastic_rounding, table.seed = old.stochastic_rounding, old.seed
        copy_rows(table.tensor, new.detach())
        old.wait_for_gpu_use()
        self.__dict__["_table"] = table
        weight.data = table.tensor
        table.bind(weight)
        self.num_embeddings = table.num_rows
        self._make_cache()

    def __getattr__(self, name):
        # In a forked child (a DataLoader worker) the table's memory is not
        # there: say so rather than hand out a weight that cannot be read.
        # With a row cache, the weight read is the current one: the cache's
        # newer rows are written back first.
        if name == "weight" and not torch.compiler.is_compiling():
            table = self.__dict__.get("_table")
            if table is not None:
                table.check_process()
                self._flush_weight()
        return super().__getattr__(name)

    def __deepcopy__(self, memo):
        # A copy gets its own host table with the same rows (a plain
        # deepcopy would clone the weight into an ordinary tensor and copy
        # the table's memory objects, which cannot be copied).
        self._refuse_copy_of_files("copied (copy.deepcopy)")
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        weight = self._parameters["weight"]
        self._table.wait_for_gpu_use()  # a GPU lookup's renorm may still be writing rows
        self._flush_weight()
        for key, value in self.__dict__.items():
            if key not in ("_table", "_parameters"):
                new.__dict__[key] = copy.deepcopy(value, memo)
        table = HostTable(self._table.num_rows, self._table.dim, dtype=self._table.dtype, first_touch=True)
        table.stochastic_rounding, table.seed = self._table.stochastic_rounding, self._table.seed
        copy_rows(table.tensor, weight.detach())
        param = nn.Parameter(table.tensor, requires_grad=weight.requires_grad)
        memo[id(weight)] = param
        new.__dict__["_table"] = table
        new.__dict__["_parameters"] = {"weight": param}
        table.bind(param)
        new._make_cache()
        return new

    def _refuse_copy_of_files(self, what):
        files = self._table.files
        if files is not None:
            raise RuntimeError(f"{self._get_name()}: a table kept on disk ({files.path}) is not {what}: the copy "
                               "would be a table in memory as large as the files. Call flush_cache() and open the "
                               "directory again in another module, or save a checkpoint (hostembed.save)")

    def __getstate__(self):
        # Pickling (torch.save(model), spawn-started workers): the weight
        # goes as a tensor, the table's memory objects do not; unpickling
        # builds a new table from it.
        self._refuse_copy_of_files("pickled (torch.save(model), spawned workers)")
        self._table.wait_for_gpu_use()
        self._flush_weight()
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_table", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        weight = self._parameters["weight"]
        table = HostTable(*weight.shape, dtype=weight.dtype, first_touch=True)
        copy_rows(table.tensor, weight.detach())
        param = nn.Parameter(table.tensor, requires_grad=weight.requires_grad)
        self._parameters["weight"] = param
        self.__dict__["_table"] = table
        table.bind(param)
        self.__dict__.setdefault("_cache_rows", None)
        self._make_cache()

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.cpu()/.half() arrive here as fn over every tensor.
        # Moving a 50 GB table to the GPU is exactly what this module exists
        # to avoid: see where fn would send a tensor and send outputs there;
        # a dtype cast converts the table in host memory. The probe starts
        # where outputs go now, in the table's dtype, so that a dtype-only
        # cast (model.cuda().half()) keeps them there and a device-only move
        # keeps the dtype.
        try:
            probe = fn(torch.empty(0, device=self._output_device, dtype=self._table.dtype))
            device = probe.device
        except (AssertionError, RuntimeError) as exc:
            # Only a move to a device torch cannot use fails on an empty
            # tensor: say why in hostembed's words.
            reason = unavailable_reason()
            if reason is None:
                raise
            raise RuntimeError(f"hostembed: moving {self._get_name()} outputs to the GPU needs the GPU path, "
                               f"but {reason}") from exc
        if device.type == "cuda":
            require_cuda(f"{self._get_name()} outputs on {device}")
        if probe.is_floating_point() and probe.dtype != self._table.dtype:
            check_table_dtype(probe.dtype, self._get_name())
            self._retype(probe.dtype)
        moved, self._output_device = device != self._output_device, device
        if moved and self._table.cache is not None:
            self.flush_cache()
            self._make_cache()  # where the outputs go now
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # state_dict() aliases the table, and torch.save reads it right
        # away: a max_norm renorm kernel of the last GPU lookup may still be
        # writing rows.
        self._table.wait_for_gpu_use()
        self._flush_weight()
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

    def extra_repr(self) -> str:
        # torch's options, then where the table and the outputs are.
        dtype = "" if self._table.dtype == torch.float32 else f"{dtype_name(self._table.dtype)} "
        files = self._table.files
        if files is None:
            where = "table in host memory"
        else:
            # cache_rows, not ram_budget: the module keeps only the rows
            # (ram_budget was turned into them, and cache_rows can be set).
            where = f"table on disk in {files.path!r} (cache_rows={self._cache_rows} in memory)"
        return f"{super().extra_repr()}, {dtype}{where}, outputs on {self._output_device}"

