"""One host table: its memory, its CUDA registration, the ordering of GPU
work on it, and the host buffers of its optimizer state.

Every piece of per-table bookkeeping lives on this object (the module holds
it as ``emb._table``; an optimizer finds it from the parameter with
:func:`table_of`), so that a dropped module takes all of it along.

Registration with CUDA is lazy: a table is pinned on its first GPU lookup,
and an optimizer-state buffer on the first GPU update that writes it. A
table that only ever produces CPU outputs never pins a page and never
creates a CUDA context, even on a GPU machine.
"""
import os
import threading
import warnings
import weakref

import torch

from . import _C

# The dtypes a table may have, and their codes in the core (include/he_dtype.h).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
# Optimizer state may also be kept in these (he_dtype.h): half precision, or
# 8-bit codes (int8: HE_Q8, uint8: HE_Q8_NONNEG) with float32 scales.
COMPACT_STATE_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.uint8)
STATE_CODES = {**DTYPE_CODES, torch.int8: 4, torch.uint8: 5}


def compute_dtype(dtype):
    """The dtype the core computes in for a table of `dtype`: float64 for
    float64 tables, float32 for the others. Gradients and optimizer state
    are in it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype):
    """'bfloat16' for torch.bfloat16: a dtype as messages name it."""
    return str(dtype).split(".")[-1]


def check_table_dtype(dtype, who):
    """A TypeError naming the dtypes a table may have, for any other."""
    if dtype not in DTYPE_CODES:
        raise TypeError(f"{who}: a host table is float32, float16, bfloat16 or float64; dtype={dtype} is not "
                        "supported")

class _TablesOfParameters:
    """Parameter -> its HostTable, weak on the parameter; the table never
    refers back to it, so a dropped module frees the table. Keyed by id()
    and checked against a weak reference: every op and optimizer step
    looks tables up, and torch's WeakIdKeyDictionary takes ~1.5 us a
    lookup where this takes ~0.15."""

    def __init__(self):
        self._entries = {}  # id(param) -> (weak reference to param, table)

    def get(self, param):
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __setitem__(self, param, table):
        key, entries = id(param), self._entries

        def forget(ref):
            # Only this parameter's entry: its id may already be another's.
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(param, forget), table)

    def keys(self):
        return [p for p in (ref() for ref, _ in list(self._entries.values())) if p is not None]

    def __len__(self):
        return len(self.keys())


_tables = _TablesOfParameters()
# The address of a table's rows -> the table: the ops find a table from
# whatever tensor object torch hands them (the parameter itself in eager
# mode and, so far, under torch.compile too; an alias of it otherwise).
_by_address = weakref.WeakValueDictionary()
# HostTable.handle -> the table, for ops given an int instead of a tensor.
_by_handle = weakref.WeakValueDictionary()


def table_by_handle(handle, what):
    table = _by_handle.get(handle)
    if table is None:
        raise RuntimeError(f"hostembed: {what}: its table no longer exists")
    table.check_process()
    return table


def any_tables() -> bool:
    """Whether any host table is alive in this process."""
    return len(_tables) > 0


def table_of(param):
    """The HostTable behind a parameter, or None for any other tensor."""
    return _tables.get(param)


def host_table_of(tensor, what):
    """The HostTable whose rows `tensor` is, checked to be exactly those
    rows in this process; a clear error otherwise. The ops call it before
    touching any memory."""
    table = _tables.get(tensor)
    if table is None and tensor.numel():
        table = _by_address.get(tensor.data_ptr())
    if table is None:
        raise RuntimeError(
            f"hostembed: {what} needs a hostembed table's weight, but got a {list(tensor.shape)} {tensor.dtype} "
            f"tensor on {tensor.device} that is not one (was the weight's .data replaced?)"
        )
    table.check_process()
    if not table.views(tensor):
        raise RuntimeError(
            f"hostembed: the weight of this [{table.num_rows}, {table.dim}] host table no longer views the "
            f"table's memory (it is a {list(tensor.shape)} {tensor.dtype} tensor on {tensor.device}"
            f"{'' if tensor.is_contiguous() else ', not contiguous'}). The rows live in host memory owned "
            "by the table: change them in place, e.g. `with torch.no_grad(): emb.weight.copy_(new)`, or "
            "build a new module with hostembed.Embedding.from_pretrained(new)"
        )
    return table


# This process's id, as the tables compare it with their own (os.getpid()
# is a system call: 0.2 us, on every op): renewed in a forked child.
_pid = os.getpid()


def _in_forked_child():
    # A forked child has no mapping of the tables (MADV_DONTFORK, see
    # csrc/host_memory.c): any read of their rows would fault. The
    # parameters get an empty tensor so that a raw read raises instead of
    # crashing, and every op and `emb.weight` say why (check_process).
    global _pid
    _pid = os.getpid()
    for param in list(_tables.keys()):
        param.data = torch.empty(0, dtype=param.dtype)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)


FORK_MESSAGE = (
    "hostembed: a host table's memory is not inherited by forked processes (a table of tens of GB would "
    "otherwise be copied page by page as training writes it), and this is a forked child of the process "
    "that made it, such as a DataLoader worker. Look the rows up in the main process (call the module on "
    "the batch's ids in the training loop, not in the Dataset), or give the workers a torch tensor of "
    "the rows they need (e.g. emb.weight.detach().clone()) before the DataLoader starts them"
)


def disk_fork_message(path, pid):
    """Why a forked child cannot use its parent's table on disk (in `path`,
    opened by process `pid`)."""
    return (f"hostembed: the table in {path} is process {pid}'s, and this is a forked child of it (such as a "
            "DataLoader worker): a child does not inherit its parent's tables on disk (their rows are not mapped "
            "here, and a child writing their files would change the table under the parent). Look the rows up in "
            "the main process, or make the child a table of its own in another directory (this one stays locked "
            "while the parent holds it)")


def host_tensor(buf, num_rows, dim, dtype=torch.float32):
    """A [num_rows, dim] CPU tensor of dtype over a HostBuffer (no copy); the
    tensor keeps the buffer alive."""
    if num_rows * dim == 0:
        return torch.zeros(num_rows, dim, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=num_rows * dim).view(num_rows, dim)


def _seen_only_by_table(tensor):
    """Whether the table's rows tensor is all that sees its memory: its
    storage's users are the frombuffer tensor, the table's [N, D] view of
    it, the weight, and the storage object made here to ask (torch's
    private count; without it, assume others)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(tensor.untyped_storage()._cdata) <= 4


def allocate(num_rows, dim, *, dtype=torch.float32, first_touch=False):
    """A zeroed HostBuffer for a [num_rows, dim] table of dtype, or a
    MemoryError naming the size."""
    nbytes = num_rows * dim * dtype.itemsize
    what = f"a [{num_rows}, {dim}] {dtype_name(dtype)} table ({nbytes} bytes)"
    if nbytes > (1 << 63) - 1:
        raise MemoryError(f"hostembed: cannot allocate {what}: larger than any address space")
    try:
        return _C.HostBuffer(nbytes, first_touch)
    except MemoryError as exc:
        raise MemoryError(f"hostembed: cannot allocate {what} ({exc})") from None


def map_shared(fd, nbytes):
    """A HostBuffer over the first `nbytes` of the file `fd`, mapped shared
    (every process of a host that maps the file sees the same bytes), or a
    MemoryError naming the size."""
    try:
        return _C.HostBuffer(nbytes, fd=fd)
    except MemoryError as exc:
        raise MemoryError(f"hostembed: cannot map {nbytes} bytes of shared memory ({exc})") from None


class HostTable:
    """A [num_rows, dim] table in core-owned host memory, of one of the
    DTYPE_CODES dtypes; its optimizer state is in compute_dtype(dtype)."""

    def __init__(self, num_rows, dim, *, dtype=torch.float32, first_touch=True, rows_buffer=None):
        """rows_buffer: a HostBuffer to hold the rows instead of a new one
        (one mapped shared by the processes of a host, _C.HostBuffer(fd=));
        its bytes are the rows as they are."""
        self.num_rows, self.dim = num_rows, dim
        self.dtype = dtype
        # Half tables: whether optimizer updates round the new weights
        # stochastically, and the seed they draw from (taken from torch's
        # generator when stochastic rounding is first switched on, so that
        # torch.manual_seed makes runs repeat and a table that never uses
        # it draws nothing: its initial rows are torch's for the seed).
        self.stochastic_rounding = False
        self.seed = 0
        # Every buffer of this table with bytes in it (its rows and its
        # optimizer state), by host address: the ops hand the core the
        # buffer object a tensor views, never the tensor's address, so the
        # core checks the table's shape against the buffer's own size. Weak:
        # a state buffer goes when the optimizer drops it.
        self._buffers = weakref.WeakValueDictionary()
        # Host address -> why CUDA refused to pin that buffer: asked once.
        self._refused = {}
        # Why CUDA refused to pin the rows themselves (then lookups with GPU
        # outputs go through the CPU core), or None. A plain attribute:
        # forward reads it, also under torch.compile.
        self.register_refused = None
        # torch.cuda.Event after the last GPU work that reads or writes the
        # rows: GPU work on another stream waits for it on the device, CPU
        # code that writes the rows waits for it on the host.
        self.last_gpu_use = None
        # Set by an optimizer that updates on the GPU: backward then keeps
        # the GPU copy of the reduced gradient (see ops/gpu.py's GradTwin).
        self.twin_wanted = False
        self.grad_twin = None
        # Where SparseAdam(update="auto") settled for this table.
        self.update_chooser = None
        # The fused mode (fused.py): a weak reference to the
        # SparseAdam(fused=True) that updates this table in backward, the
        # gradients of this backward pass waiting for its end, and whether
        # an update was applied since that optimizer's last step().
        # `fused` is the plain flag that forward reads (also under
        # torch.compile, which runs a fused table's lookup eagerly).
        self.fused = False
        self.fused_optimizer = None
        self.fused_pending = None
        self.fused_awaiting_step = False
        # Set when an optimizer that cannot take a row-sparse gradient
        # (torch's RMSprop, NAdam, ...) first steps this table: from then on
        # backward makes weight.grad dense, as nn.Embedding(sparse=False)
        # does (optim/torch_optimizers.py). A plain flag forward reads.
        self.dense_gradient = False
        # A table whose rows several processes share (the distributed
        # SharedEmbedding): the rows [start, end) this process updates
        # (None: all of them; Adam's step over every row keeps to them),
        # and what makes a fused backward pass's gradients the rows this
        # process updates, exchanged with the others (None: no exchange).
        self.update_rows = None
        self.gradient_exchange = None
        # Whether the table holds a distributed module's rows (a shard, or
        # a shared table): every process's gradient reaches it through the
        # module's exchange, not an all-reduce.
        self.sharded = False
        # The outstanding Embedding.prefetch (_prefetch.Prefetch), or None,
        # and what the last lookup that found one did with it.
        self.prefetch = None
        self.prefetch_outcome = None
        # The files of a table kept on disk (table_files.TableFiles;
        # Embedding(storage=...)), or None for a table in memory.
        self.files = None
        # The table's row cache (_cache.RowCache; Embedding(cache_rows=N)),
        # or None, and the batch prefetch() planned for it (nn/lookup/cached.py).
        self.cache = None
        self.planned = None
        # Held by every op around its work on the rows or the state (CPU
        # core calls, and GPU launches with the waits that order them), so
        # that each op is atomic relative to the others: a lookup in one
        # Python thread sees the rows before or after another thread's
        # optimizer step, never half of it, and two max_norm renorms never
        # scale the same row at once. The core releases the GIL, so without
        # it threads would run on the same rows together.
        self.lock = threading.Lock()
        # Registration asks CUDA once per buffer, from whichever thread gets
        # there first (the ops call it holding `lock`, forward without it).
        self._register_lock = threading.Lock()
        self.pid = os.getpid()
        # The rows' buffer, held strongly: the ops pass it to the core.
        if rows_buffer is None:
            self.buffer, self.tensor = self._new_buffer(first_touch=first_touch)
        else:
            if rows_buffer.nbytes < num_rows * dim * dtype.itemsize:
                raise ValueError(f"hostembed: a [{num_rows}, {dim}] {dtype_name(dtype)} table needs "
                                 f"{num_rows * dim * dtype.itemsize} bytes, the buffer has {rows_buffer.nbytes}")
            if rows_buffer.nbytes:
                self._buffers[rows_buffer.address] = rows_buffer
            self.buffer, self.tensor = rows_buffer, host_tensor(rows_buffer, num_rows, dim, dtype)
        if self.tensor.numel():
            _by_address[self.tensor.data_ptr()] = self
        # An int naming this table to ops that cannot take the table (or a
        # tensor of it, which autograd would version-check) as an argument.
        self.handle = id(self)
        _by_handle[self.handle] = self

    @property
    def code(self):
        """The table's dtype as the core's he_dtype code."""
        return DTYPE_CODES[self.dtype]

    @property
    def state_dtype(self):
        return compute_dtype(self.dtype)

    def gradient_dtype(self, dtype):
        """The dtype the core reads a gradient of `dtype` in: the table's
        own (a half table's weight.grad and output gradient stay half, the
        core widens their rows), else the compute dtype."""
        return self.dtype if dtype == self.dtype else self.state_dtype

    def _new_buffer(self, *, first_touch=False, per_row=False, dtype=None, width=None):
        width = 1 if per_row else self.dim if width is None else width
        dtype = self.dtype if dtype is None else dtype
        if self.files is not None:  # a table on disk: its state too (table_files.py)
            tensor = self.files.new_state(width, dtype, per_row)
            row_file = self.files.row_file_of(tensor)
            if row_file is not None:
                self._buffers[row_file.buffer().address] = row_file.buffer()
            return None, tensor
        buf = allocate(self.num_rows, width, dtype=dtype, first_touch=first_touch)
        if buf.nbytes:
            self._buffers[buf.address] = buf
        tensor = host_tensor(buf, self.num_rows, width, dtype)
        return buf, tensor.view(self.num_rows) if per_row else tensor

    def zeros(self, *, first_touch=False, per_row=False, dtype=None, width=None):
        """A new zeroed optimizer-state buffer of this table, in its compute
        dtype (or `dtype`: a compact state's, see optim/compact_state.py):
        [num_rows, dim] (per-element state), [num_rows, width] (an 8-bit
        state's scales), or [num_rows] with per_row (one state value per
        row). Without first_touch, pages are backed only once written: state
        of rows never trained costs nothing."""
        dtype = self.state_dtype if dtype is None else dtype
        return self._new_buffer(first_touch=first_touch, per_row=per_row, dtype=dtype, width=width)[1]

    def retype(self, dtype, copy):
        """Converts the rows to `dtype` in new host memory: copy(dst, src,
        release) fills the new [num_rows, dim] tensor from the old one in
        chunks, each new page backed as it is written, and with release
        drops each old chunk's pages once converted, so a cast's peak is the
        larger of the two tables plus a chunk: never both. Without release
        (the old rows are seen from elsewhere: a view kept by the user, as
        torch's cast would leave it intact, or a GPU's pinned mapping) the
        old memory goes after the copy. Returns the new tensor; the caller
        points the weight at it. Optimizer state made before stays in the
        old compute dtype (an optimizer step then says so)."""
        if self.files is not None:
            raise RuntimeError(f"hostembed: this table's rows are kept in {self.files.path}, as "
                               f"{dtype_name(self.dtype)}; a cast would need a new table. Convert a checkpoint of it "
                               f"into a table of dtype={dtype} instead")
        if self.update_rows is not None:
            raise RuntimeError(f"hostembed: this table's rows are one copy that several processes share "
                               f"(hostembed.distributed), all of them reading its {dtype_name(self.dtype)} rows; a "
                               f"cast to {dtype_name(dtype)} would give this process a table of its own. Build the "
                               f"table with dtype={dtype} instead")
        self.wait_for_gpu_use()
        self.prefetch = None  # its rows are in the old dtype
        old_buffer, old_tensor = self.buffer, self.tensor
        release = old_tensor.numel() > 0 and not self.registered and _seen_only_by_table(old_tensor)
        buf, tensor = self._new_buffer(dtype=dtype)
        copy(tensor, old_tensor, release)
        if old_tensor.numel():
            _by_address.pop(old_tensor.data_ptr(), None)
            self._buffers.pop(old_buffer.address, None)
        self.buffer, self.tensor, self.dtype = buf, tensor, dtype
        if tensor.numel():
            _by_address[tensor.data_ptr()] = self
        self.register_refused = None
        return tensor

    def bind(self, param):
        """Makes table_of(param) find this table, and parameter() find
        param (the weight bound last: a compiled lookup's gradient goes
        there, ops/compiled_grad.py)."""
        _tables[param] = self
        self._parameter = weakref.ref(param)

    def parameter(self):
        """The weight parameter bound last, or None (gone, or none yet)."""
        ref = getattr(self, "_parameter", None)
        return None if ref is None else ref()

    def check_process(self):
        if self.pid != _pid:
            raise RuntimeError(FORK_MESSAGE if self.files is None else disk_fork_message(self.files.path, self.pid))

    def views(self, tensor):
        """True when tensor is exactly this table's rows: the whole buffer,
        row-major, in the table's dtype. A weight whose .data was swapped is
        not."""
        # Every op asks, several times a step: the cheapest tests first
        # (is_cpu, not .device, which builds an object: 0.4 of 1.4 us).
        mine = self.tensor
        return ((tensor.data_ptr() == mine.data_ptr() or tensor.numel() == 0) and tensor.is_cpu
                and tensor.dtype == self.dtype and tensor.shape == (self.num_rows, self.dim) and tensor.is_contiguous())

    def owns(self, tensor):
        """True when tensor is exactly one of this table's buffers (its rows,
        or optimizer state made by zeros()): [num_rows, dim] (or [num_rows]
        for per-row state), in the table's dtype or its compute dtype,
        row-major, from the buffer's first byte. The core checks each shape
        against its buffer's size."""
        if not (tensor.dtype in (self.dtype, self.state_dtype) + COMPACT_STATE_DTYPES
                and tuple(tensor.shape) in self._state_shapes() and tensor.device.type == "cpu"
                and tensor.is_contiguous()):
            return False
        return tensor.numel() == 0 or self._buffers.get(tensor.data_ptr()) is not None

    def _state_shapes(self):
        # The last: an 8-bit state's scales, one a block of 256 columns.
        return ((self.num_rows, self.dim), (self.num_rows,), (self.num_rows, (self.dim + 255) // 256))

    def buffer_of(self, tensor, what):
        """The HostBuffer that tensor is exactly (see owns), for the core; a
        RuntimeError naming `what` for any other tensor. An empty table's
        tensors have no memory: the rows' (empty) buffer stands for them."""
        if not self.owns(tensor):
            raise RuntimeError(
                f"hostembed: {what} of a [{self.num_rows}, {self.dim}] {dtype_name(self.dtype)} host table must "
                f"be a {dtype_name(self.state_dtype)} CPU tensor of that shape (or [{self.num_rows}] for per-row "
                f"state) in the table's own host memory, got a {list(tensor.shape)} {tensor.dtype} tensor "
                f"on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'} that is not one"
            )
        if tensor.numel() == 0:
            return self.buffer
        return self._buffers[tensor.data_ptr()]

    def rows_changed(self, rows=None):
        """Called by whatever writes the rows (the ops, loads): `rows` the
        ids written (a tensor, repeats allowed), None for any. An
        outstanding prefetch re-reads them, or is dropped (None); None also
        makes the row cache re-read its records."""
        if self.files is not None:
            self.files.set_clean(False)  # until a flush: a load stopped halfway must not open
        if rows is None and self.cache is not None:
            self.cache.mark_stale()
        prefetch = self.prefetch
        if prefetch is not None:
            prefetch.changed.append(None if rows is None or rows.device.type != "cpu"
                                    else rows.reshape(-1).to(torch.int64))

    # ---- CUDA registration (lazy)

    def _register(self, buf, device):
        """Pins and maps buf (from `device`'s context) on first use; False
        when CUDA refused it (warned once)."""
        if buf.device_address is not None:
            return True
        with self._register_lock:
            return self._register_locked(buf, device)

    def _register_locked(self, buf, device):
        if buf.device_address is not None:  # another thread did it meanwhile
            return True
        if buf.address in self._refused:
            return False
        try:
            buf.cuda_register(device.index)
        except (RuntimeError, OSError, MemoryError, ValueError) as exc:
            self._refused[buf.address] = str(exc)
            rows = buf is self.buffer
            if rows:
                self.register_refused = str(exc)
            warnings.warn(
                f"hostembed: could not pin {buf.nbytes} bytes of host memory for the GPU ({exc}); "
                + ("the table stays unpinned, and its GPU lookups and updates go through the CPU core and a "
                   "copy" if rows else "this optimizer state stays unpinned, and its updates run on the CPU"),
                RuntimeWarning,
                stacklevel=6,
            )
            return False
        return True

    def device_address(self, tensor, device):
        """The device address of tensor's first element, pinning and mapping
        its buffer (from `device`'s context) on first use; None when the
        buffer is not ours or CUDA refused to pin it (warned once)."""
        base = tensor.untyped_storage().data_ptr()
        buf = self._buffers.get(base)
        if buf is None or not self._register(buf, device):
            return None
        return buf.device_address + (tensor.data_ptr() - base)

    def pinned_buffer(self, tensor, device, what):
        """buffer_of(tensor), pinned and mapped for `device` (on first use);
        None when CUDA refused to pin it. An empty table's needs no pinning."""
        buf = self.buffer_of(tensor, what)
        if tensor.numel() and not self._register(buf, device):
            return None
        return buf

    @property
    def kernels_read_it(self):
        """Whether lookups with GPU outputs can use the kernels: they read
        pinned float32 tables; otherwise the CPU core looks rows up and a
        copy takes them to the GPU."""
        return self.register_refused is None and self.dtype == torch.float32

    @property
    def registered(self):
        return self.buffer.nbytes > 0 and self.buffer.device_address is not None

    # ---- ordering GPU work on the rows

    def record_gpu_use(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        self.last_gpu_use = event
        return event

    def order_after_gpu_use(self, stream):
        """Makes `stream` wait (on the device; the host does not block) for
        the last GPU work on the rows, which may have run on another stream."""
        if self.last_gpu_use is not None:
            stream.wait_event(self.last_gpu_use)

    def wait_for_gpu_use(self):
        """Blocks the host until no GPU work on the rows is in flight: call
        it before the CPU reads rows a GPU kernel may write, or writes rows
        one may read."""
        event, self.last_gpu_use = self.last_gpu_use, None
        if event is not None:
            event.synchronize()
