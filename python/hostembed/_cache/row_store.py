"""Where a row cache reads and writes the rows it does not hold: a table's
host tensors in memory (HostRows), or the files of a table on disk
(FileRows), where a missed row is one read and an evicted row one write.

A table on disk keeps one file per tensor (its weight, each state tensor;
_core/table_files.py): a miss of a row of SparseAdam's would read three
files and its eviction write three, and a disk at these sizes is bound by
its request rate, not its bytes. So while an optimizer's state moves with
the rows, the cache writes each evicted row whole, weight and state, as
one record of a records file, and reads it back as one: the tensors'
files (the "homes") hold a row's newest values only until its first
eviction, and get them back at a flush (flush_homes), which every reader
of the files calls first (the cache's flush: the module's `weight`,
state_dict(), hostembed.save, the table's end). The records file holds
the optimizer's life, like the state files, and is removed with the table:
at its end's write-back (row_cache.flush_when_done), also at the
interpreter's exit, by the process that made it only (a forked child's end
leaves it alone).

An eviction's write goes on in the background (one at a time), from when
the step's misses are read until the cache next moves rows to the files
(settle: the next step's evictions, a flush); a read of a row still being
written waits for it. A write that fails gives its rows to their own files
and its error is raised by that next move, before it changes anything:
nothing of the completed steps is lost.
"""
import errno
import os
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from .._core.ops.cpu import rows_at
from .._core.table_files import ascending

# A record's fields start at multiples of this (a field read as its dtype
# needs its alignment).
_FIELD_ALIGN = 8
# Rows moved between the records file and the homes at a time (fills and
# flushes): 12 MiB of SparseAdam's records at D=128, a few large requests
# for consecutive rows, little memory under a table's budget.
_CHUNK_ROWS = 1 << 13
# Per row: bit k set while field k of its record is newer than its home;
# _VALID while the record holds the row (it was written whole since the
# records file was made, and nothing wrote the homes since).
_VALID = 0x80
_MAX_FIELDS = 7

# The one thread that writes evicted records while the steps go on (made
# at the first such write; every table's writes take turns on it).
_writer = None
_writer_lock = threading.Lock()


def _no_writer_in_child():
    # A forked child has none of its parent's threads: the executor's
    # thread would never run what the child's own tables submit (their
    # settle() would wait for good). The child makes its own; its parent's
    # writes in flight are the parent's to finish.
    global _writer, _writer_lock
    _writer, _writer_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_no_writer_in_child)


def _write_behind(function, *args):
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostembed-records-writer")
    try:
        return _writer.submit(function, *args)
    except RuntimeError:  # the interpreter is exiting (the table's last write-back): written in line
        future = Future()
        try:
            function(*args)
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
        return future


def take(tensor, index):
    """tensor[index]: host rows in scratch memory (rows_at), GPU ones by
    torch."""
    return rows_at(tensor, index) if tensor.device.type == "cpu" else tensor[index]


class HostRows:
    """The rows of host tensors in memory: `hosts` (the cache's dict, name:
    tensor, which grows as state attaches)."""

    def __init__(self, hosts):
        self.hosts = hosts

    def home_read(self, host, rows: Tensor) -> Tensor:
        """host[rows] (distinct rows) of a host tensor, from its own memory."""
        return take(host, rows)

    def home_write(self, host, rows: Tensor, values: Tensor) -> None:
        host[rows] = values

    def read(self, keys, rows: Tensor) -> dict:
        """{key: hosts[key][rows]} (distinct rows)."""
        return {key: take(self.hosts[key], rows) for key in keys}

    def read_into(self, keys, rows: Tensor, put) -> None:
        """put(key, hosts[key][rows]) for each key, one at a time: each
        in scratch memory (take) that the next reuses once put lets go."""
        for key in keys:
            put(key, take(self.hosts[key], rows))

    def write(self, rows: Tensor, keys, value_of) -> None:
        """hosts[key][rows] = value_of(key) for each key, one at a time."""
        for key in keys:
            self.hosts[key][rows] = value_of(key)

    def start_writes(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def newer_rows(self) -> tuple:
        return 0, 0

    def unflushed(self, key) -> bool:
        return False

    def flush_homes(self, keys=None, rows=None) -> None:
        pass

    def forget(self, keep=None, rows=None) -> None:
        pass

    def retire(self, keep=None) -> None:
        pass


class FileRows:
    """The rows of a table on disk: its tensors' files (through `files`, a
    TableFiles, for `hosts`: the cache's dict), and, while state moves with
    the rows, a records file of whole rows (see the module)."""

    def __init__(self, hosts, files):
        self.hosts, self.files = hosts, files
        self.records = None  # the records file (a RowFile), made at the first write of whole rows
        self.fields = ()  # (key, byte offset, bytes, dtype, row shape) a field, in the records file's order
        self.flags = None  # uint8 per row: _VALID and the unflushed fields' bits
        self._refused = None  # why the records file could not be made (warned once), or None
        self._remove = None  # removes the records file (a finalizer: also when this goes)
        # (sorted rows, their records) read by the last read of part of the
        # fields, or None; dropped by any write (_read_records says why).
        self._kept = None
        # [(sorted rows, their records, future)] of the write going on in
        # the background, or [None]: a list the records file's finalizer
        # shares, so that it never closes the file under that write.
        self._writing = [None]
        # (rows, records) whose background write failed, until their fields
        # are in the homes (_rescue): their newest values are only here.
        self._stranded = []
        # (sorted rows, their records, the records file) of a write not
        # started yet (start_writes).
        self._queued = None

    # ---- the tensors' files

    def home_read(self, host, rows: Tensor) -> Tensor:
        """host[rows] (distinct rows) of a host tensor, from its own file, by
        the core's I/O threads rather than faulted in through the mapping
        one page at a time (or from its memory, if it has no file)."""
        row_file = self.files.row_file_of(host)
        return take(host, rows) if row_file is None else row_file.read(rows)

    def home_write(self, host, rows: Tensor, values: Tensor) -> None:
        """host[rows] = values (distinct rows), in its own file (the first
        write of a session marks the files as not holding the whole table
        until a flush)."""
        row_file = self.files.row_file_of(host)
        if row_file is None:
            host[rows] = values
        elif rows.numel():
            self.files.set_clean(False)
            row_file.write(rows, values)

    def _home_read(self, key, rows):
        return self.home_read(self.hosts[key], rows)

    def _home_write(self, key, rows, values):
        self.home_write(self.hosts[key], rows, values)

    # ---- the records file

    def _layout(self):
        """The fields of a record of the hosts as they are now, or None
        where rows do not move whole (no state, or a tensor not in a file)."""
        if len(self.hosts) < 2 or len(self.hosts) > _MAX_FIELDS:
            return None
        fields, offset = [], 0
        for key, host in self.hosts.items():
            if self.files.row_file_of(host) is None:
                return None
            nbytes = host[:1].nbytes
            fields.append((key, offset, nbytes, host.dtype, tuple(host.shape[1:])))
            offset += -(-nbytes // _FIELD_ALIGN) * _FIELD_ALIGN
        return tuple(fields), offset

    def _record_bytes(self, raw):
        """A record's bytes: whole sectors of direct I/O where the disk has
        it (a write of part of a sector reads it first), else whole cache
        lines."""
        align = max(self.files.weight.align, 64)
        return -(-raw // align) * align

    def _current(self):
        """The records file, if it holds records of the hosts' fields as
        they are now."""
        if self.records is None:
            return None
        layout = self._layout()
        return self.records if layout is not None and layout[0] == self.fields else None

    def _make(self):
        """A records file for the hosts' fields, or None (they do not move
        whole, or it could not be made: warned, and rows move field by
        field, as slower, the same values)."""
        layout = self._layout()
        if layout is None or self._refused is not None or self.records is not None:
            return None
        fields, raw = layout
        records = None
        try:
            records = self.files.new_records(self._record_bytes(raw))
            self._fill(records, fields)
        except BaseException as exc:
            if records is not None:
                _remove(records)
            if not isinstance(exc, OSError):
                raise
            self._refused = str(exc)
            warnings.warn(f"hostembed: the records file of the table in {self.files.path} could not be made "
                          f"({exc}); its rows move a file at a time from now on (a disk request per tensor a row)",
                          RuntimeWarning, stacklevel=2)
            return None
        self.records, self.fields = records, fields
        self.flags = torch.full((self.files.num_rows,), _VALID, dtype=torch.uint8)
        self._remove = weakref.finalize(self, _remove, records, self._writing)
        # Not at the interpreter's exit before the table's own write-back
        # (row_cache.flush_when_done), which reads it: it goes with this.
        self._remove.atexit = False
        return records

    def _fill(self, records, fields):
        """Every row's record written from the tensors' files, in runs of
        consecutive rows (a few large requests): from then on every miss is
        one read, a row's first too. Linear in the table, like the state
        files' own zeroing when they were made."""
        self.records, self.fields = records, fields
        try:
            for chunk in torch.arange(self.files.num_rows).split(_CHUNK_ROWS):
                records.write(chunk, self._join(lambda key: self._home_read(key, chunk), chunk.numel()))
        finally:
            self.records, self.fields = None, ()

    def _split(self, buffer):
        """A read of records as {key: values} (views of `buffer`)."""
        n = buffer.shape[0]
        return {key: buffer[:, offset:offset + nbytes].view(dtype).view(n, *shape)
                for key, offset, nbytes, dtype, shape in self.fields}

    def _join(self, value_of, n, order=None):
        """Records of each field's value_of(key) (rows in `order` if given)."""
        buffer = torch.empty((n, self.records.width), dtype=torch.uint8)
        end = 0
        for key, offset, nbytes, _, _ in self.fields:
            buffer[:, end:offset] = 0  # padding: the file's bytes are the values' alone
            field = value_of(key).reshape(n, -1).view(torch.uint8)
            buffer[:, offset:offset + nbytes] = field if order is None else field[order]
            end = offset + nbytes
        buffer[:, end:] = 0
        return buffer

    def _read_records(self, rows, whole):
        """Records of `rows` (distinct, each held by its record): those the
        last read of part of the fields kept (self._kept) without a read, the
        others read. A read of part of the fields keeps what it read: the
        forward reads a bypassed row's weight, and its update next reads
        the whole row."""
        if self._kept is not None and whole and torch.equal(self._kept[0], rows):
            buffer, self._kept = self._kept[1], None  # the usual update after its forward: no copy
            return buffer
        found = torch.zeros(rows.shape, dtype=torch.bool)
        if self._kept is not None:
            kept_rows, kept = self._kept
            at = torch.searchsorted(kept_rows, rows).clamp(max=max(kept_rows.numel() - 1, 0))
            found = kept_rows[at] == rows if kept_rows.numel() else found
        if not bool(found.any()):
            buffer = self.records.read(rows)
        else:
            buffer = torch.empty((rows.numel(), self.records.width), dtype=torch.uint8)
            buffer[found] = kept[at[found]]
            missing = (~found).nonzero().view(-1)
            if missing.numel():
                buffer[missing] = self.records.read(rows[missing])
        if whole:
            self._kept = None  # used: it would only hold memory
        else:
            order = torch.argsort(rows)
            self._kept = (rows[order], buffer[order]) if not ascending(rows) else (rows, buffer)
        return buffer

    def _bits(self, keys):
        bits = 0
        for k, (key, *_) in enumerate(self.fields):
            if key in keys:
                bits |= 1 << k
        return bits

    # ---- what the cache calls

    def read(self, keys, rows: Tensor) -> dict:
        """{key: rows' values} (distinct rows): a row whose record holds it,
        from the records file (one read), else from each key's file."""
        records = self._current()
        if records is not None and self.files.removed():
            # Its reads would not see it (they read the records file): training
            # stops here, as a read of the weight's file would stop it.
            raise OSError(errno.ENOENT, f"hostembed: {self.files.weight.path}: the file was removed while the "
                                        "table was open (its rows live only as long as this process); save a "
                                        "checkpoint of the table now")
        self._wait_for(rows)
        in_records = None if records is None else (self.flags[rows] & _VALID) != 0
        if in_records is None or not bool(in_records.any()):
            return {key: self._home_read(key, rows) for key in keys}
        if bool(in_records.all()):
            read = self._split(self._read_records(rows, whole=len(keys) == len(self.fields)))
            return {key: read[key] for key in keys}
        at = in_records.nonzero().view(-1)
        elsewhere = (~in_records).nonzero().view(-1)
        read = self._split(self._read_records(rows[at], whole=len(keys) == len(self.fields)))
        out = {}
        for key in keys:
            host = self.hosts[key]
            out[key] = torch.empty((rows.numel(), *host.shape[1:]), dtype=host.dtype)
            out[key][at] = read[key]
            out[key][elsewhere] = self._home_read(key, rows[elsewhere])
        return out

    def read_into(self, keys, rows: Tensor, put) -> None:
        """put(key, values) for each key (as read() gives them)."""
        for key, values in self.read(keys, rows).items():
            put(key, values)

    def write(self, rows: Tensor, keys, value_of) -> None:
        """Rows' value_of(key) for each key (distinct rows): every field
        at once goes to the records file (one write a row); fewer go to
        their files, and those rows' records are given up (flushed first)."""
        if not rows.numel():
            return
        self.settle()
        self._kept = None
        self.files.set_clean(False)  # the files will not hold the whole table until a flush
        whole = set(keys) == set(self.hosts)
        records = self._current()
        if records is None and whole:
            records = self._make()
        if records is not None and whole:
            order = None
            if not ascending(rows):  # joined in the file's order: the write copies nothing more
                order = torch.argsort(rows)
                rows = rows[order]
            buffer = self._join(value_of, rows.numel(), order)
            # Set now: until the write is done, reads of these rows wait for
            # it (read), and one that fails gives them back to their homes
            # (settle).
            self.flags[rows] = _VALID | self._bits(keys)
            self._queued = (rows, buffer, records)
            return
        self.forget(rows=rows)
        for key in keys:
            self._home_write(key, rows, value_of(key))

    def start_writes(self) -> None:
        """Starts the queued write in the background: after the step's
        misses are read (reads and writes at once were slower than one after
        the other on this project's disk), while the step computes."""
        if self._queued is not None:
            rows, buffer, records = self._queued
            self._queued = None
            self._writing[0] = (rows, buffer, _write_behind(records.write, rows, buffer))

    def settle(self) -> None:
        """Waits for the write going on in the background (starting a queued
        one first). If it failed, its rows go to their homes (the records
        file no longer holds them) and its error is raised: the caller stops
        before it changes anything. Rows of an earlier failed write go to
        their homes first (or its error is raised again): nothing reads or
        writes a row's older values past them."""
        self._rescue()
        self.start_writes()
        job = self._writing[0]
        if job is None:
            return
        rows, buffer, future = job
        self._writing[0] = None
        error = future.exception()
        if error is None:
            return
        self.flags[rows] = 0
        self._stranded.append((rows, buffer))
        try:
            self._rescue()
        except OSError:
            pass  # kept: the next flush writes them, or raises
        try:
            raise error
        finally:
            # No cycle through this frame (the error's traceback holds it):
            # the table's files close when the module goes, without a gc.
            error = job = future = None

    def _rescue(self) -> None:
        """The rows of failed background writes written to their homes."""
        while self._stranded:
            rows, buffer = self._stranded[0]
            read = self._split(buffer)
            for key, *_ in self.fields:
                self._home_write(key, rows, read[key])
            self._stranded.pop(0)

    def _wait_for(self, rows: Tensor) -> None:
        """Settles first where rows are among those being written, or
        stranded by a failed write."""
        if self._stranded:
            self._rescue()
        busy = [job[0] for job in (self._queued, self._writing[0]) if job is not None]
        if any(bool(torch.isin(rows, written).any()) for written in busy):
            self.settle()

    def newer_rows(self) -> tuple:
        """(rows of the records file newer than their files in some field,
        the fields a record has): what a flush would write from it."""
        if self.records is None:
            return 0, 0
        return int(((self.flags & (_VALID - 1)) != 0).sum()), len(self.fields)

    def unflushed(self, key) -> bool:
        """Whether rows of `key` in the records file are newer than its file."""
        if self.records is None:
            return False
        bits = self._bits((key,))
        return bits != 0 and bool(((self.flags & bits) != 0).any())

    def flush_homes(self, keys=None, rows=None) -> None:
        """The records' fields of `keys` (all by default) newer than their
        files written there (of `rows` only, if given); the records stay."""
        self._kept = None  # the homes change (and the caller may write them next)
        self.settle()
        if self.records is None:
            return
        bits = self._bits(self.hosts if keys is None else keys)
        flags = self.flags if rows is None else self.flags[rows]
        todo = ((flags & bits) != 0).nonzero().view(-1)
        if rows is not None:
            todo = rows[todo]
        for chunk in todo.split(_CHUNK_ROWS):
            # Read even where the table's directory was removed: its rows
            # are then saved from the tensors' open files (hostembed.save).
            read = self._split(self.records.read(chunk, read_removed=True))
            flags = self.flags[chunk]
            for key, *_ in self.fields:
                bit = self._bits((key,)) & bits
                if bit:  # only the rows whose field is newer: another's may be older than its file
                    which = ((flags & bit) != 0).nonzero().view(-1)
                    self._home_write(key, chunk[which], read[key][which])
            # Cleared once written: a failed write leaves them newer.
            self.flags[chunk] &= ~bits & 0xFF

    def forget(self, keep=None, rows=None) -> None:
        """The records (of `rows`, else all) no longer read: the homes are
        written, or about to be, some other way. Their fields in `keep`
        (all but those the caller rewrote: by default every one) that are
        newer than their files are written there first; the others are
        superseded."""
        if self.records is None:
            return
        keep = [key for key, *_ in self.fields] if keep is None else keep
        self.flush_homes(keep, rows)
        if rows is None:
            self.flags.zero_()
        else:
            self.flags[rows] = 0

    def retire(self, keep=None) -> None:
        """Before the hosts' fields change (state attached or dropped): the
        records' fields in `keep` (default all) written to their files, and
        the records file removed; the next write of whole rows makes one
        for the new fields."""
        if self.records is None:
            return
        self.forget(keep)
        self._remove()
        self.records, self.fields, self.flags, self._remove = None, (), None, None


def _remove(row_file, writing=(None,)):
    if row_file.pid != os.getpid():
        # A forked child's end (or garbage collection): the file and the
        # write in flight are the parent's (whose writer thread the child
        # has not: waiting for it would never end).
        return
    job = writing[0]
    if job is not None:
        job[2].exception()  # its error, if any, was the table's; the file goes either way
    row_file.close()
    try:
        os.unlink(row_file.path)
    except OSError:
        pass
