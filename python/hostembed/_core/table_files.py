"""A table kept in files on local disk (Embedding(storage=...)): a directory
holding table.json (shape, dtype, whether every row was written back, and
then a hash of some of its rows) and
one file per tensor, [num_rows, width] row-major from byte 0: weight.bin,
and a file per optimizer state tensor made while an optimizer lives.

Each file is mapped shared, so the table's weight and state are CPU tensors
like an in-memory table's and every path that reads or writes them works
(through the kernel's page cache, at its speed). The row cache in front of
them (_cache/row_cache.py) moves its records with read_rows/write_rows: the
core's threads, many requests in flight, O_DIRECT for rows of
DIRECT_MIN_ROW_BYTES or more (csrc/row_file.h says why not the page cache).

Optimizer state files hold the state of one optimizer's life: each is
removed when the last tensor over it goes (the optimizer's state and the
row cache's hold on it), and any left by a process that died, at the next
open. So is the row cache's records file (new_records; a row's weight and
state as one record, so that a miss is one read: _cache/row_store.py).
A table's training resumes from a checkpoint (hostembed.save), which holds
the optimizer's state and step; the table files hold the rows.

A table's files are the process's that opened them. A forked child (a
DataLoader worker) inherits their descriptors but not their mappings
(MADV_DONTFORK): its copies are closed at the fork, so that nothing the
child does (its end, its garbage collection) writes, removes or keeps
locked the files of its parent's table, and a file of a process is
removed only by that process (RowFile.pid).
"""
import errno
import fcntl
import hashlib
import json
import mmap
import operator
import os
import weakref

import torch

from . import _C
from .table import disk_fork_message, dtype_name, host_tensor, map_shared, table_of

MANIFEST = "table.json"
FORMAT = "hostembed table files"
VERSION = 1
WEIGHT_FILE = "weight.bin"
STATE_PREFIX = "state-"
# Requests in flight: a disk reaches its random-read rate only with many
# (measured here: 9.8K 4 KiB reads/s at 1, 32K at 4, 58K at 16; rows of
# 512 B: 53K/s read at 8, 69K at 32, 89K at 64).
IO_THREADS = 64
# Rows this small (a row-wise optimizer's one value a row) go through the
# page cache: their file is a small part of the table's bytes, and a
# sector holds 8 or more of them, so a direct read-modify-write of one
# would move 8x its bytes.
DIRECT_MIN_ROW_BYTES = 64
# Rows of the weight's file hashed into table.json when every row is written
# back, and checked at the next open: another file moved or copied over
# weight.bin is refused, not trained as this table's rows. A few reads at
# an open; a copy of the directory to another disk keeps them.
FINGERPRINT_ROWS = 64


def _open_direct(path):
    """(fd, alignment) of `path` opened with O_DIRECT, or (None, 0) where
    the file system has no direct I/O. The alignment is the smallest of
    512 and 4096 that a direct read takes (a 4 KiB-sector drive refuses
    512)."""
    if not hasattr(os, "O_DIRECT"):
        return None, 0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
    except OSError:  # a file system without direct I/O
        return None, 0
    with mmap.mmap(-1, 4096) as page:  # page-aligned memory
        for align in (512, 4096):
            try:
                os.preadv(fd, [memoryview(page)[:align]], 0)
                return fd, align
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    break
    os.close(fd)
    return None, 0


# Every RowFile of this process, closed in a forked child (see the module).
_row_files = weakref.WeakSet()


def _close_inherited():
    for row_file in list(_row_files):
        if row_file.pid != os.getpid():
            row_file.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RowFile:
    """One tensor's file: its mapping (take_tensor(): [num_rows, width], or
    [num_rows] with per_row) and explicit row reads and writes."""

    def __init__(self, path, num_rows, width, dtype, *, create, per_row=False, zero_fill=False, mapped=True):
        self.path, self.num_rows, self.width, self.dtype = path, num_rows, width, dtype
        self.pid = os.getpid()  # the process whose file this is (see the module)
        self.row_bytes = width * dtype.itemsize
        self.nbytes = num_rows * self.row_bytes
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o644)
        self.direct_fd, self.align = None, 0
        try:
            size = os.fstat(self.fd).st_size
            if create and zero_fill:
                self._write_zeros()
            elif create:
                self._reserve()
            elif size != self.nbytes:
                raise ValueError(f"hostembed: {path} is {size} bytes; a [{num_rows}, {width}] {dtype_name(dtype)} "
                                 f"tensor needs {self.nbytes}: not this table's file, or cut short")
            # The page cache may keep what the mapping reads, not what the
            # cache's moves read: they go around it where the disk allows.
            if self.row_bytes >= DIRECT_MIN_ROW_BYTES:
                self.direct_fd, self.align = _open_direct(path)
            buffer = None
            if mapped:
                buffer = map_shared(self.fd, self.nbytes) if self.nbytes else _C.HostBuffer(0)
        except BaseException:
            self.close()
            if create:
                os.unlink(path)
            raise
        if hasattr(os, "posix_fadvise") and self.nbytes:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        _row_files.add(self)
        self.per_row = per_row
        if buffer is None:  # moved by read() and write() only
            self.buffer, self._tensor = (lambda: None), None
            return
        # Held by the tensor only: the file is closed (and a state file
        # removed) when the last tensor over it goes (TableFiles).
        self.buffer = weakref.ref(buffer)
        tensor = host_tensor(buffer, num_rows, width, dtype)
        self._tensor = tensor.view(num_rows) if per_row else tensor

    def take_tensor(self):
        """The mapping as a tensor, handed out once: the file lives as long
        as it (or a view of it) does."""
        tensor, self._tensor = self._tensor, None
        return tensor

    def _reserve(self):
        """Every block of the file allocated now: a full disk is an error
        here, not at a write-back in the middle of training."""
        if not self.nbytes:
            return
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OSError(exc.errno, f"hostembed: cannot reserve {self.nbytes} bytes for {self.path} "
                                         f"({os.strerror(exc.errno)})") from None
            os.ftruncate(self.fd, self.nbytes)

    def _write_zeros(self):
        """The file written whole with zeros: a state file, read and written
        row by row from the first step. Blocks only reserved (fallocate) are
        'unwritten' to ext4, and converting them one direct write at a time
        ran at 13K rows/s here, against 100K+ once written."""
        chunk = bytes(8 << 20)
        done = synced = 0
        try:
            while done < self.nbytes:
                done += os.pwrite(self.fd, memoryview(chunk)[:min(len(chunk), self.nbytes - done)], done)
                if done - synced >= 256 << 20 or done == self.nbytes:
                    # Written pages leave the page cache as they go: under a
                    # memory limit, gigabytes of dirty zeros would count.
                    os.fdatasync(self.fd)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(self.fd, synced, done - synced, os.POSIX_FADV_DONTNEED)
                    synced = done
        except OSError as exc:
            raise OSError(exc.errno, f"hostembed: cannot write the {self.nbytes} bytes of {self.path} "
                                     f"({os.strerror(exc.errno)})") from None

    def _move(self, function, rows, buffer, read_removed=False):
        if self.pid != os.getpid():
            raise RuntimeError(disk_fork_message(os.path.dirname(self.path), self.pid))
        if self.fd is None:
            raise ValueError(f"hostembed: {self.path} was closed; its table is gone")
        function(fd=self.fd, direct_fd=-1 if self.direct_fd is None else self.direct_fd, align=self.align,
                 row_bytes=self.row_bytes, num_rows=self.num_rows, offset=0, path=self.path, rows=rows.data_ptr(),
                 count=rows.numel(), buffer=buffer.data_ptr(), threads=IO_THREADS, read_removed=read_removed)

    def read(self, rows, *, read_removed=False):
        """The rows (distinct int64 ids, any order) as a new tensor. A file
        removed while open refuses reads (training stops), unless
        read_removed (rows read to be written back, and saved from there)."""
        out = torch.empty((rows.numel(), self.width), dtype=self.dtype)
        if ascending(rows):  # no copies (a records file's rows come sorted)
            self._move(_C.read_rows, rows, out, read_removed)
            return out.view(-1) if self.per_row else out
        ordered, order = torch.sort(rows)
        self._move(_C.read_rows, ordered, out, read_removed)
        result = torch.empty_like(out)
        result[order] = out
        return result.view(-1) if self.per_row else result

    def write(self, rows, values):
        """values' rows written to rows (distinct int64 ids)."""
        if ascending(rows) and values.is_contiguous():
            self._move(_C.write_rows, rows, values)
            return
        ordered, order = torch.sort(rows)
        source = values.reshape(rows.numel(), self.width)[order].contiguous()
        self._move(_C.write_rows, ordered, source)

    def sync(self):
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise OSError(exc.errno, f"hostembed: cannot write {self.path} to disk ({os.strerror(exc.errno)})") from None

    def close(self):
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None


def ascending(rows):
    """Whether rows are strictly ascending (distinct and sorted)."""
    return rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())


class TableFiles:
    """A table's directory: its weight's file, and the state files of the
    optimizers that live."""

    def __init__(self, path, num_rows, dim, dtype):
        # Absolute: a state file is removed by path when its optimizer goes,
        # which may be after the program changed directory.
        self.path = os.path.abspath(os.fspath(path))
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(f"storage={self.path!r} is a file, not a directory: give a directory for the "
                                     "table's files (a new or empty one for a new table)")
        # Python ints for table.json: torch's modules take numpy's too
        # (DLRM's script passes them).
        num_rows, dim = operator.index(num_rows), operator.index(dim)
        self.num_rows, self.dim, self.dtype = num_rows, dim, dtype
        manifest = os.path.join(self.path, MANIFEST)
        self.created = not os.path.exists(manifest)
        if self.created:
            # The description last: a directory holds a table once it has
            # one, so a creation that fails (a full disk) leaves none.
            os.makedirs(self.path, exist_ok=True)
            self.weight = RowFile(os.path.join(self.path, WEIGHT_FILE), num_rows, dim, dtype, create=True)
            try:
                self._lock()
                self._write_manifest(clean=False)
            except BaseException:
                self.weight.close()
                os.unlink(self.weight.path)
                raise
        else:
            self._check_manifest(manifest, opened=False)
            self.weight = RowFile(os.path.join(self.path, WEIGHT_FILE), num_rows, dim, dtype, create=False)
            self._lock()
            self._check_manifest(manifest, opened=True)
        self._remove_state_files()
        self.clean = False
        self._state_count = 0
        # HostBuffer address -> RowFile, for the row cache's moves; an
        # entry goes with its buffer.
        self._files = {}
        # The finalizers that close and remove the state files (end_state).
        self._state_ends = []

    def _lock(self):
        """One module at a time, in any process: two would write the same
        rows, and an open removes the state files it finds. Held (flock on
        the weight file) until the table's rows are dropped."""
        try:
            fcntl.flock(self.weight.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.weight.close()
            raise RuntimeError(f"hostembed: the table in {self.path} is open in another module (of this process or "
                               "another); one module at a time may hold a table's files") from None

    def _check_manifest(self, manifest, *, opened):
        """Shape and dtype (before the weight file is opened), then, once
        the table is this module's, whether it was closed cleanly."""
        try:
            with open(manifest) as f:
                info = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"hostembed: {manifest} cannot be read as a table's description ({exc})") from None
        if info.get("format") != FORMAT or info.get("version") != VERSION:
            raise ValueError(f"hostembed: {manifest} is not a hostembed table (format {info.get('format')!r}, "
                             f"version {info.get('version')!r}; expected {FORMAT!r}, {VERSION})")
        if opened:
            resume = ("To resume, make the table with storage= a new or emptied directory and load your last "
                      "checkpoint into it (hostembed.load(path, model, optimizer)); this directory can then be "
                      "removed")
            if not info.get("clean"):
                self.weight.close()
                raise RuntimeError(
                    f"hostembed: the table in {self.path} was not closed cleanly: the process that trained it "
                    "stopped with rows in its RAM cache not yet written, so its file holds rows of different steps. "
                    + resume)
            saved = info.get("fingerprint")
            if saved is not None and saved != self._fingerprint():
                self.weight.close()
                raise RuntimeError(
                    f"hostembed: {self.weight.path} does not hold the rows the table in {self.path} was closed with "
                    f"({FINGERPRINT_ROWS} rows read to check differ): another file was moved or copied over it. "
                    "Put the table's own file back, or " + resume[0].lower() + resume[1:])
            return
        found = (info.get("num_rows"), info.get("dim"), info.get("dtype"))
        wanted = (self.num_rows, self.dim, dtype_name(self.dtype))
        if found != wanted:
            raise ValueError(f"hostembed: the table in {self.path} is [{found[0]}, {found[1]}] {found[2]}; the module "
                             f"asks for [{wanted[0]}, {wanted[1]}] {wanted[2]}")

    def check_process(self):
        """Raises where this process is not the one that opened the table (a
        forked child): it must not write or remove the parent's files."""
        if self.weight.pid != os.getpid():
            raise RuntimeError(disk_fork_message(self.path, self.weight.pid))

    def _write_manifest(self, *, clean):
        self.check_process()
        info = {"format": FORMAT, "version": VERSION, "num_rows": self.num_rows, "dim": self.dim,
                "dtype": dtype_name(self.dtype), "weight": WEIGHT_FILE, "clean": clean}
        if clean:
            info["fingerprint"] = self._fingerprint()
        target = os.path.join(self.path, MANIFEST)
        temporary = target + ".tmp"
        try:
            with open(temporary, "w") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        except OSError as exc:
            _unlink_quietly(temporary)
            # A write or fsync error (a full disk) names no file of its own.
            raise OSError(exc.errno, f"hostembed: cannot write {target}, the description of the table in "
                                     f"{self.path} ({os.strerror(exc.errno) if exc.errno else exc})") from None
        except BaseException:
            _unlink_quietly(temporary)
            raise
        _fsync_dir(self.path)

    def _fingerprint(self):
        """A hash of FINGERPRINT_ROWS rows spread over the weight's file, read
        from the file itself (after a flush, what the table holds)."""
        digest = hashlib.blake2b(digest_size=16)
        n, row = self.num_rows, self.weight.row_bytes
        for i in sorted({k * (n - 1) // max(FINGERPRINT_ROWS - 1, 1) for k in range(FINGERPRINT_ROWS)} if n else ()):
            data = os.pread(self.weight.fd, row, i * row)
            if len(data) != row:
                raise OSError(errno.EIO, f"hostembed: {self.weight.path} ends before row {i}")
            digest.update(data)
        return digest.hexdigest()

    def _remove_state_files(self):
        for name in os.listdir(self.path):
            if name.startswith(STATE_PREFIX) and name.endswith(".bin"):
                os.unlink(os.path.join(self.path, name))

    def _register(self, row_file, tensor, remove):
        buffer = row_file.buffer()
        if buffer is not None and row_file.nbytes:
            self._files[buffer.address] = row_file
            end = weakref.finalize(buffer, self._forget, buffer.address, row_file, remove)
            if remove:
                self._state_ends = [e for e in self._state_ends if e.alive] + [end]
        else:
            self._forget(None, row_file, remove)
        return tensor

    def _forget(self, address, row_file, remove):
        self._files.pop(address, None)
        row_file.close()
        if remove and row_file.pid == os.getpid():  # a forked child's end leaves its parent's files alone
            try:
                os.unlink(row_file.path)
            except OSError:
                pass

    def end_state(self):
        """The state files closed and removed now, at the end of the process
        (their tensors stay readable, over the mappings): where the process
        ends with os._exit (multiprocessing's fork children), nothing else
        would remove them."""
        for end in self._state_ends:
            end()
        self._state_ends = []

    def weight_buffer(self):
        """The HostBuffer mapping the weight's file (once): the file stays
        open, and locked, while it lives."""
        buffer = self.weight.buffer()
        self._register(self.weight, self.weight.take_tensor(), False)
        return buffer

    def close(self):
        """Lets go of a table not taken after all (before weight_buffer)."""
        self.weight.close()

    def new_state(self, width, dtype, per_row):
        """A zeroed state tensor of `width` values of dtype a row ([num_rows]
        with per_row) over a new file of the directory, removed when the
        tensor and its views go."""
        self.check_process()
        self._state_count += 1
        path = os.path.join(self.path, f"{STATE_PREFIX}{os.getpid()}-{self._state_count}.bin")
        row_file = RowFile(path, self.num_rows, width, dtype, create=True, per_row=per_row, zero_fill=True)
        return self._register(row_file, row_file.take_tensor(), True)

    def new_records(self, record_bytes):
        """A file of [num_rows, record_bytes] bytes (_cache/row_store.py's
        records), reserved, unmapped: its owner writes every row, and removes
        it (or the next open, as a state file)."""
        self.check_process()
        self._state_count += 1
        path = os.path.join(self.path, f"{STATE_PREFIX}{os.getpid()}-{self._state_count}-records.bin")
        return RowFile(path, self.num_rows, record_bytes, torch.uint8, create=True, mapped=False)

    def row_file_of(self, tensor):
        """The RowFile whose mapping `tensor` is, or None."""
        if not tensor.numel():
            return None
        return self._files.get(tensor.untyped_storage().data_ptr())

    def set_clean(self, clean):
        """Records whether every row is written back (the files alone then
        hold the table): set before the first write of a session's step
        and after a complete flush."""
        if clean != self.clean:
            self.check_process()
            if clean:
                self.weight.sync()
                if self.removed():
                    # Nothing on disk to mark: the rows are in the open
                    # files, and a checkpoint (hostembed.save) reads them.
                    return
            self._write_manifest(clean=clean)
            self.clean = clean

    def removed(self):
        """True when the weight's file was removed (rm -rf of the directory)
        while the table is open: its rows live only in this process."""
        self.check_process()
        return os.fstat(self.weight.fd).st_nlink == 0


# torch's functions that make a state tensor like a parameter, as torch's
# optimizers call them: full_like(p, value, memory_format=...) for
# Adagrad's sum at construction, zeros_like(p, ...) for a moment.
_STATE_LIKE = (torch.full_like, torch.zeros_like)


class FileTableParameter(torch.nn.Parameter):
    """The weight of a table kept on disk: an nn.Parameter whose
    ``torch.full_like`` / ``torch.zeros_like`` (as torch's optimizers call
    them) make the state in a file of the table, as hostembed's optimizers
    do. torch.optim.Adagrad makes its ``sum`` that way at construction: a
    table-sized tensor in RAM, which a table on disk must never need.
    Every other function is torch's, with a plain tensor result, as for
    nn.Parameter; only tables on disk pay for the check."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _STATE_LIKE and args and isinstance(args[0], cls):
            state = _state_in_file(func, args, kwargs)
            if state is not None:
                return state
        return super().__torch_function__(func, types, args, kwargs)


def _state_in_file(func, args, kwargs):
    """A state tensor in a file of args[0]'s table, or None where torch's
    call asks for something else (another dtype, device or layout)."""
    p, table = args[0], table_of(args[0])
    value = args[1] if func is torch.full_like and len(args) > 1 else kwargs.get("fill_value", 0)
    plain = set(kwargs) <= {"fill_value", "memory_format"} \
        and kwargs.get("memory_format", torch.preserve_format) in (torch.preserve_format, torch.contiguous_format)
    if table is None or table.files is None or not plain or len(args) > (2 if func is torch.full_like else 1) \
            or table.state_dtype != p.dtype or isinstance(value, complex):
        return None
    return fill_state(table, table.zeros(), value)


def fill_state(table, state, value, chunk_rows=1 << 16):
    """state (a new state tensor of `table`) filled with `value`: for a table
    on disk through its file's row writes (the rows then never pass
    through the process's mapping, so the fill costs no RAM), else in place."""
    row_file = table.files.row_file_of(state) if table.files is not None else None
    if value == 0 and row_file is not None:
        return state  # written with zeros when made
    if row_file is None:
        return state.fill_(value)
    block = torch.full((min(chunk_rows, row_file.num_rows), row_file.width), value, dtype=row_file.dtype)
    for start in range(0, row_file.num_rows, chunk_rows):
        rows = torch.arange(start, min(start + chunk_rows, row_file.num_rows))
        row_file.write(rows, block[:rows.numel()])
    return state


def weight_parameter(table, requires_grad):
    """The module's weight over `table`'s rows: a FileTableParameter for a
    table on disk, else an nn.Parameter."""
    cls = FileTableParameter if table.files is not None else torch.nn.Parameter
    return cls(table.tensor, requires_grad=requires_grad)
