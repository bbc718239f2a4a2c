"""RowCache: a table's rows and their optimizer state kept in the slots
of a cache (records), moved as the planner (_core/ops/cache_plan.py) says;
and the optimizers' hooks into the caches of their tables."""
import atexit
import functools
import multiprocessing
import os
import sys
import time
import warnings
import weakref

import torch
from torch import Tensor

from .._core.ops import update as update_ops
from .._core.ops.cache_plan import CachePlan, CachePlanner
from .._core.table import HostTable, table_of
from .row_store import FileRows, HostRows, take as _take


def _ordered(method):
    """Work on GPU records runs on the caller's current stream, after the
    cache's previous work on whatever stream that ran (a forward under
    torch.cuda.stream(s), then step() on the default one)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        stream = torch.cuda.current_stream(self.device)
        if self._last_use is not None:
            stream.wait_event(self._last_use)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._last_use = torch.cuda.Event()
            self._last_use.record(stream)
    return run


class CacheConflict(RuntimeError):
    """A cached table's host rows (or state) were written in place while
    its cache held updates that host memory did not have yet."""


class RowCache:
    """A host table's rows, and their optimizer state, kept in `capacity`
    slots (records) and moved as the CPU planner says: each batch's rows
    are read and updated in their slots, or in host memory where they
    bypass the cache, and the results are bit for bit the uncached
    table's. The records are host memory (a HostTable of `capacity` rows,
    updated by the same core, every optimizer). A cache in GPU memory is
    a GpuRowCache (gpu_cache.py), which keeps this class's coherence with
    host memory and plans on the GPU.

    A batch: plan(unique) (evictions and fetches done, the flagged ones
    too unless lookahead), rows(plan, unique) for the forward, update(...)
    for the optimizer's step, of rows wherever they are then (a gradient
    may span several batches). With lookahead, plan(next) may come before
    the current batch's update; finish(next) then does the fetches that
    had to wait for it. flush() writes the records back.

    Coherence with host memory, per tensor (the weight, each state tensor
    an update brought in): an update makes the records newer ("dirty")
    until a flush; a write to the host tensor through torch (its version
    counter moves) or one announced with mark_stale() (loads, which write
    without torch) makes host memory newer, and the records are re-read
    from it at the next plan, update or flush. Both at once cannot be
    resolved (CacheConflict)."""

    def __init__(self, table, capacity: int, *, lookahead: bool = False, policy: str = "frequency"):
        self.table = table
        self.lookahead = lookahead
        self.policy = policy
        self.device = torch.device("cpu")
        self.planner = CachePlanner(table.num_rows, capacity, lookahead=lookahead, policy=policy)
        # The records' HostTable when they are in host memory (the core
        # updates them as a table of `capacity` rows), else None.
        self.records = None
        self.host = {"weight": table.tensor}
        self.cached = {"weight": self._new_records(weight=True)}
        self.version = {"weight": table.tensor._version}
        self.dirty, self.stale = set(), set()
        # Where rows not in a slot are read and written (row_store.py).
        self.store = HostRows(self.host) if table.files is None else FileRows(self.host, table.files)
        # The row each record holds. Not the planner's map: planned a step
        # ahead, a slot is the new row's as soon as it is planned, while its
        # record still holds the old row's until the fetch (flush reads this).
        self.row_of_slot = torch.full((capacity,), -1, dtype=torch.int64)
        # Planned a step ahead: rows given a slot whose fetch waits for the
        # previous batch's update; until finish(), that update is theirs in
        # host memory.
        self.pending = torch.empty(0, dtype=torch.int64)
        self.moved = {"fetched_bytes": 0, "written_back_bytes": 0}
        # What a failed move to or from a table's files raised, as text
        # (see _fail), or None.
        self.failed = None
        # Rows updated outside the cache whose write to the files failed:
        # (host tensor, rows, values), written by flush().
        self.unwritten = []
        # GPU records (GpuRowCache): an event after the last work on them
        # (_ordered), and the device of the gradient rows the last update of
        # records read (tests check that a GPU cache was updated from the
        # GPU's sums).
        self._last_use = None
        self.last_update_from = None

    @property
    def capacity(self) -> int:
        return self.planner.capacity

    @property
    def stats(self) -> dict:
        """The planner's counts (batches, rows, hits, fetches, evictions,
        bypassed), and the bytes the records moved: fetched (into slots)
        and written back (evictions and flushes)."""
        return {**self.planner.stats, **self.moved}

    def _new_records(self, *, weight=False, like=None):
        """Records for the weight (in the table's dtype; made first), or
        zeroed ones for a state tensor shaped and typed `like` its host
        tensor (a value or a row per row: [num_rows] or [num_rows, width],
        in its compute dtype or a compact state's)."""
        capacity, dim = self.capacity, self.table.dim
        if self.device.type == "cpu":
            if weight:
                self.records = HostTable(capacity, dim, dtype=self.table.dtype, first_touch=False)
                return self.records.tensor
            return _zeros_like(self.records, like)
        if weight:
            return torch.zeros((capacity, dim), dtype=self.table.dtype, device=self.device)
        return torch.zeros((capacity, *like.shape[1:]), dtype=like.dtype, device=self.device)

    def _live_slots(self):
        return (self.row_of_slot >= 0).nonzero().view(-1)

    def _read_in(self, records, host):
        """Every live record's values read from its row of `host` (its own
        file, for a table on disk: the store's records of it given up first)."""
        for slots in self._live_slot_chunks():
            records[slots] = self.store.home_read(host, self.row_of_slot[slots])

    def _live_slot_chunks(self):
        """The live slots, a chunk at a time: moving them all at once would
        copy every record (gigabytes under a memory budget) twice."""
        slots = self._live_slots()
        return slots.split(_CHUNK_ROWS)

    def holds_newer(self, key: str) -> bool:
        """Whether host memory (or the files) lacks updates of `key` that
        the cache holds: flush() writes them."""
        return key in self.dirty or self.store.unflushed(key)

    def _check_usable(self):
        self.table.check_process()
        if self.failed is not None:
            raise RuntimeError(
                f"hostembed: this table's files failed in an earlier step ({self.failed}); nothing was updated from "
                "that step on. The rows of the last completed step are in the files and this cache: flush_cache() "
                "writes the cache's once the cause is fixed; then open the table again, or save a checkpoint")

    def _record_bytes(self):
        return sum(t[:1].nbytes for t in self.cached.values())

    def _sync(self):
        """Re-reads the records of every host tensor written since the
        cache last saw it (see the class)."""
        for key, host in self.host.items():
            if key not in self.stale and host._version == self.version[key]:
                continue
            if self.holds_newer(key) and key not in self.stale:
                raise CacheConflict(
                    f"hostembed: the {'rows' if key == 'weight' else repr(key) + ' state'} of a table with a row "
                    "cache were written in place while the cache held updates not yet in host memory; which values "
                    "are meant cannot be told. Write the weight through the module's `weight` attribute (reading "
                    "it writes the cache back first), or call flush_cache() before writing through a reference "
                    "kept from earlier")
            self.store.forget(keep=[k for k in self.host if k != key])
            self._read_in(self.cached[key], host)
            self.stale.discard(key)
            self.dirty.discard(key)
            self.version[key] = host._version

    def host_rows_written(self, key: str, rows: Tensor) -> None:
        """torch wrote `rows` of host tensor `key` in place, and nothing
        else since the cache last saw it (a torch optimizer's step on the
        row-sparse gradient): the records of those rows are read again
        from host memory (a table on disk: its mapping, where the write
        is), not every record, as _sync would for a write it cannot see
        the rows of. Anything else (a write besides, newer records, GPU
        records) is left to _sync."""
        self.table.check_process()
        host = self.host.get(key)
        if host is None or self.device.type != "cpu" or key in self.stale or self.holds_newer(key) \
                or host._version != self.version[key] + 1:
            return
        rows = torch.unique(rows.cpu())
        self.store.forget(rows=rows)
        slots = self.planner.slots_of(rows).long()
        # A slot planned a step ahead may not hold its row yet: its fetch
        # reads host memory after this step anyway.
        held = (slots >= 0) & (self.row_of_slot[slots.clamp(min=0)] == rows)
        self.cached[key][slots[held]] = host[rows[held]]
        self.version[key] = host._version

    def _seen(self):
        """Our own writes of host tensors (write-backs) are not news."""
        for key, host in self.host.items():
            self.version[key] = host._version

    def mark_stale(self, key: str = "weight") -> None:
        """Host memory of `key` was rewritten whole, by a write torch does
        not see (a load): the records are re-read from it, and their own
        updates, superseded, are dropped."""
        self.table.check_process()
        if key in self.host:
            self.store.forget(keep=[k for k in self.host if k != key])
            self.stale.add(key)
            self.dirty.discard(key)

    @_ordered
    def attach_state(self, key: str, host_tensor: Tensor) -> Tensor:
        """An optimizer state tensor of the table ([num_rows, dim], or
        [num_rows] per row) kept with the rows from now on: its cached
        rows' values are copied into new records (a tensor attached before
        under that key gets its own updates back first). Returns those
        records."""
        self.table.check_process()
        self._sync()
        if key in self.dirty:
            self.flush((key,))
        self.store.retire()  # its records' fields change
        records = self._new_records(like=host_tensor)
        self._read_in(records, host_tensor)
        self.host[key], self.cached[key] = host_tensor, records
        self.version[key] = host_tensor._version
        return records

    def detach_state(self) -> None:
        """Forgets every state tensor, its records unwritten: a load of the
        optimizer's state supersedes them (the next update attaches what
        it loaded)."""
        self.table.check_process()
        self.store.retire(keep=("weight",))
        for key in [k for k in self.host if k != "weight"]:
            del self.host[key], self.cached[key], self.version[key]
            self.dirty.discard(key)
            self.stale.discard(key)

    @_ordered
    def plan(self, unique: Tensor) -> CachePlan:
        """The plan of the batch with these unique rows, its evictions and
        fetches done (planned a step ahead, the flagged fetches wait for
        finish())."""
        self._check_usable()
        self._sync()
        plan = self.planner.plan(unique)
        evict_slot = plan.evict_slot.long()
        try:
            # The evicted records stay theirs (row_of_slot) until every
            # write is done: if one fails, flush() still has them.
            self.store.write(plan.evict_row, self.host, lambda key: _take(self.cached[key], evict_slot))
            self.moved["written_back_bytes"] += plan.evict_row.numel() * self._record_bytes()
            self._seen()
            self.row_of_slot[evict_slot] = -1
            self._fetch(plan, ~plan.fetch_after_update)
            if self.lookahead:
                self.pending = plan.fetch_row[plan.fetch_after_update]
            else:
                self._fetch(plan, plan.fetch_after_update)
            self.store.start_writes()
        except OSError as exc:
            self._fail(exc)
        return plan

    def _fail(self, exc):
        """A move to or from a table's files failed: the planner already
        counts this batch, so the cache takes no more batches (flush still
        writes what it holds)."""
        # Its text, not the exception: a traceback's frames would keep the
        # module (and so the table's files) alive.
        self.failed = f"{type(exc).__name__}: {exc}"
        raise exc

    @_ordered
    def finish(self, plan: CachePlan) -> None:
        """The fetches that waited for the previous batch's update."""
        if self.lookahead:
            self._check_usable()
            try:
                self._fetch(plan, plan.fetch_after_update)
            except OSError as exc:
                self._fail(exc)
            self.pending = self.pending[:0]

    def _fetch(self, plan, which):
        rows, slots = plan.fetch_row[which], plan.fetch_slot[which].long()
        self.store.read_into(self.host, rows, lambda key, values: self.cached[key].__setitem__(slots, values))
        self.row_of_slot[slots] = rows
        self.moved["fetched_bytes"] += rows.numel() * self._record_bytes()

    @_ordered
    def rows(self, plan: CachePlan, unique: Tensor) -> Tensor:
        """The batch's rows, unique[k]'s in row k: from its slot, or from
        host memory for a row that bypassed the cache."""
        self._check_usable()
        # Every row from its slot (a bypassed one from slot 0, then
        # replaced): the usual batch bypasses none.
        out = _take(self.cached["weight"], plan.slot.clamp(min=0).long())
        bypassed = (plan.slot < 0).nonzero().view(-1)
        if bypassed.numel():
            try:
                out[bypassed] = self.store.read(("weight",), unique[bypassed])["weight"]
            except OSError as exc:
                self._fail(exc)
        return out

    @_ordered
    def update(self, kind: int, state: dict, indices: Tensor, values: Tensor, **hyper) -> None:
        """Optimizer `kind`'s update (update_ops.update_rows) of rows `indices`
        (repeats summed) with `values`, of the weight and the state tensors
        `state` (name: host tensor, attached here if new): in their slots
        for the rows cached now, else in host memory. An index outside the
        table raises IndexError before anything is written."""
        if any(not isinstance(item, Tensor) and item[2] for item in state.values()):
            # The core draws a stochastic rounding from the row's number, and
            # a record's is its slot's: the bits would not be the uncached
            # table's.
            raise NotImplementedError("hostembed: a table with a row cache takes compact optimizer state rounded "
                                      "to nearest only (state_rounding='nearest'), not stochastically")
        self._check_usable()
        if self.table.files is not None:
            self.table.files.set_clean(False)  # the records will be newer than the files
        host_indices = indices.cpu()
        slots = self.planner.slots_of(host_indices).long()
        self._sync()
        for key, tensor in _tensors_of(state).items():
            if self.host.get(key) is not tensor:
                self.attach_state(key, tensor)
        self.last_update_from = values.device
        values = values.cpu()
        cached = (slots >= 0) & ~torch.isin(host_indices, self.pending)
        # No copies through masks when every row is in a slot (the usual
        # update without plan-ahead).
        bypass_indices, bypass_values = host_indices[:0], values[:0]
        if not bool(cached.all()):
            bypass_indices, bypass_values = host_indices[~cached], values[~cached]
            slots, values = slots[cached], values[cached]
        staged = None
        if self.table.files is not None and bypass_indices.numel():
            try:  # read before anything is updated: a failed read changes nothing
                staged = self._stage_from_files(state, bypass_indices)
            except OSError as exc:
                self._fail(exc)
        update_ops.update_rows(kind, self.records, _state_over(state, self.cached), slots, values, **hyper)
        self.dirty.update(("weight", *_tensors_of(state)))
        if self.table.files is None:
            update_ops.update_rows(kind, self.table, state, bypass_indices, bypass_values, **hyper)
        elif staged is not None:
            records, items, temporary, rows, inverse = staged
            update_ops.update_rows(kind, records, items, inverse, bypass_values, **hyper)
            # Until written, these rows' newest values are only here: a
            # failed write leaves them for flush() (the step is complete).
            self.unwritten = [(rows, temporary)]
            try:
                self._write_unwritten()
            except OSError as exc:
                self._fail(exc)

    def _stage_from_files(self, state, indices):
        """Rows of a table on disk that bypass the cache, read into records
        of their own to be updated there as the cache's are (the same bits)
        and written back: not through the files' mapping, whose page faults
        move 4 KiB pages one at a time."""
        rows, inverse = torch.unique(indices, return_inverse=True)
        records = HostTable(rows.numel(), self.table.dim, dtype=self.table.dtype, first_touch=False)
        hosts = {"weight": self.table.tensor, **_tensors_of(state)}
        temporary = {"weight": records.tensor}
        read = self.store.read(hosts, rows)
        for key, tensor in hosts.items():
            if key != "weight":
                temporary[key] = _zeros_like(records, tensor)
            temporary[key].copy_(read[key])
        return records, _state_over(state, temporary), temporary, rows, inverse.view(-1)

    def _write_unwritten(self):
        while self.unwritten:
            rows, values = self.unwritten[0]
            self.store.write(rows, values, values.__getitem__)
            self.unwritten.pop(0)
        self.store.start_writes()  # no read follows in this step

    @_ordered
    def flush(self, keys=None) -> None:
        """The records of `keys` (all by default) written back to their
        rows; they stay cached. Only in the process that made the table: a
        forked child has none of its memory (and must not write its files)."""
        self.table.check_process()
        self._sync()
        self._write_unwritten()
        # The store's newer rows first: the live records are newer still.
        self.store.flush_homes(keys)
        for key in self.host if keys is None else keys:
            if key in self.dirty:
                for slots in self._live_slot_chunks():
                    self.store.home_write(self.host[key], self.row_of_slot[slots], self.cached[key][slots])
                    self.moved["written_back_bytes"] += slots.numel() * self.cached[key][:1].nbytes
                self.dirty.discard(key)
        self._seen()
        if self.table.files is not None and not self.dirty and keys is None:
            self.table.files.set_clean(True)

    def write_back_size(self) -> tuple:
        """(rows, row writes) that a flush would write now, roughly: the
        store's rows newer than their files (a write per field) and the
        live records of each tensor updated in the cache."""
        rows, fields = self.store.newer_rows()
        live = int((self.row_of_slot >= 0).sum()) if self.dirty else 0
        return rows + live, rows * fields + live * len(self.dirty)


_CHUNK_ROWS = 1 << 16


def _scale_key(key):
    return f"{key}_scale"


def _zeros_like(records, like):
    """Zeroed state of a HostTable of records, shaped and typed `like` a
    host state tensor ([num_rows] or [num_rows, width])."""
    per_row = like.dim() == 1
    return records.zeros(per_row=per_row, dtype=like.dtype, width=None if per_row else like.shape[1])


def _state_over(state, tensors):
    """An update's state (update_ops' form: a tensor, or a compact state's
    (tensor, scales or None, stochastic)) with `tensors` (by key, as
    _tensors_of names them) standing for the host tensors: the cache's
    records, or the records of rows that bypass it."""
    over = {}
    for key, item in state.items():
        if isinstance(item, Tensor):
            over[key] = tensors[key]
        else:
            _, scale, stochastic = item
            over[key] = (tensors[key], None if scale is None else tensors[_scale_key(key)], stochastic)
    return over


def _tensors_of(state):
    """Every host tensor of an update's state, by key: a compact state's
    scales (its 8-bit codes' records move with them) under key_scale."""
    tensors = {}
    for key, item in state.items():
        if isinstance(item, Tensor):
            tensors[key] = item
            continue
        tensors[key] = item[0]
        if item[1] is not None:
            tensors[_scale_key(key)] = item[1]
    return tensors


def _cached_tables(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            table = table_of(p)
            if table is not None and table.cache is not None:
                yield table


# The write-back at a table's end is announced (a line on stderr, where
# progress goes) when it should take END_MESSAGE_SECONDS or more: a script
# that ends without flush_cache() otherwise sits silent for as long. Rows
# written a second (a row of one tensor each, in file order): 127K-160K
# measured here, SparseAdam on 400K rows x 128 with 318K rows to write.
END_MESSAGE_SECONDS = 3.0
_ROW_WRITES_PER_SECOND = 150_000

# This process's tables on disk still to be written back at their ends
# (the weakref.finalize over each module), for _write_back_at_exit.
_ends = []
# The process whose multiprocessing exit functions run _write_back_at_exit.
_hooked_pid = None


def flush_when_done(module, table) -> None:
    """A table kept on disk is written back when its module goes, or at
    the interpreter's exit if it is still alive then: a script that ends
    without flush_cache() leaves a table that opens again. The finalizer
    holds the table (not the module) until it runs."""
    global _hooked_pid
    _ends[:] = [end for end in _ends if end.alive]
    _ends.append(weakref.finalize(module, _flush_at_end, table))
    if _hooked_pid != os.getpid() and multiprocessing.parent_process() is not None:
        # A child of multiprocessing's fork context ends with os._exit: no
        # atexit, no weakref.finalize. Its own exit functions run this.
        from multiprocessing import util
        util.Finalize(None, _write_back_at_exit, exitpriority=0)
        _hooked_pid = os.getpid()


def _flush_at_end(table):
    _write_back([table], "at its module's end")


def _write_back_at_exit():
    """Every table of this process still open, written back, announced
    together, and its state files removed."""
    ends = {}
    for end in _ends:
        held = end.peek()  # (module, function, args, kwargs), or None where it ran already
        if held is not None:
            ends[id(held[2][0])] = end
    tables = [end.peek()[2][0] for end in ends.values()]
    _ends.clear()
    _write_back(tables, "before the process exits", ends)
    for table in tables:
        if table.pid == os.getpid() and table.files is not None:
            table.files.end_state()


# weakref.finalize registers its own exit function when its first finalizer
# is made; made here, it is registered before _write_back_at_exit, and atexit
# runs the later first: the state files' finalizers (which close them) must
# run after the write-back that writes them.
weakref.finalize(_write_back_at_exit, int)
atexit.register(_write_back_at_exit)


def _parents_tables_are_not_ours():
    _ends.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_parents_tables_are_not_ours)


def _write_back(tables, when, ends=None):
    """The tables' caches written back to their files, their records files
    removed (the files hold every row then; left behind, a records file
    would take the table's size on disk until the next open), and the
    caches let go. Only the tables this process made: a forked child's
    end leaves its parent's alone (their memory is not in the child, and
    their files and the writes in flight are the parent's). ends: {id(table):
    its module's finalizer}, each detached only as its table is written, so
    that a failure or an interrupt leaves the rest to weakref's own exit
    function."""
    tables = [t for t in tables if t.pid == os.getpid() and t.cache is not None and t.files is not None]
    if not tables:
        return
    try:
        sizes = [table.cache.write_back_size() for table in tables]
        rows, writes = sum(size[0] for size in sizes), sum(size[1] for size in sizes)
    except Exception:  # only the announcement needs the estimate
        rows = writes = 0
    seconds = writes / _ROW_WRITES_PER_SECOND
    announce = seconds >= END_MESSAGE_SECONDS and sys.stderr is not None
    if announce:
        what = f"the table in {tables[0].files.path}" if len(tables) == 1 else f"{len(tables)} tables on disk"
        print(f"hostembed: writing back {rows:,} rows of {what} {when} (about {seconds:.0f} s; flush_cache() "
              "during the run does it when you choose)", file=sys.stderr, flush=True)
    start = time.monotonic()
    for table in tables:
        end = (ends or {}).get(id(table))
        if end is not None:
            end.detach()
        _end(table)
    if announce:
        print(f"hostembed: written back in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def _end(table):
    cache = table.cache
    try:
        with table.lock:
            cache.flush()
            cache.store.retire()
            # The cache and the table refer to each other: let go of it, so
            # that the table (and the lock on its files) goes now, not at a
            # later garbage collection.
            table.cache = None
    except Exception as exc:  # a finalizer cannot raise to anyone
        warnings.warn(f"hostembed: writing back the table in {table.files.path} at its end failed ({exc}); "
                      "it will not open again: restore it from a checkpoint", RuntimeWarning)


def flush_optimizer_tables(optimizer) -> None:
    """Writes back the rows and state cached for the optimizer's tables:
    its state_dict() then holds the current values."""
    for table in _cached_tables(optimizer):
        with table.lock:
            table.cache.flush()


def forget_optimizer_state(optimizer) -> None:
    """The cached state of the optimizer's tables dropped, unwritten: a load
    of its state supersedes it."""
    for table in _cached_tables(optimizer):
        with table.lock:
            table.cache.detach_state()
