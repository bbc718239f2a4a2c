"""GpuRowCache: a row cache whose planner and records both live on a GPU,
so that a cached step never waits for the CPU; and HostTwinState, the same
planner's host twin, which runs the same executor on the CPU (the tests).

A batch: plan_batch(unique, n) plans it and moves records (evictions
written back, fetches read, over the pinned mapping), gather(plan, unique,
n) reads its rows for the forward (from their slots, or host memory where
they bypass the cache), update(...) is the optimizer's step (SparseAdam,
SGD, Adagrad or row-wise Adagrad) of rows wherever they are at that moment
(a compact state's codes and scales are records too, moved as float32
words; a per-row state's records are one word wide). Nothing of it reads
a device value on the host: the lookup's dedup, which sizes the batch, is
the one wait of a step (done by prefetch() when the next batch is known,
else by the lookup).

Why the update asks the map, not the plan: a batch planned a step ahead
runs its plan (and its fetches) before the current step's update. A row
the current batch bypassed and the next one fetched is then in a slot,
and the update finds it there; a row the plan evicted is not one of the
current batch's (protect 2 keeps those), and any other is written back
before the update reads it. So no fetch has to wait for an update."""
import warnings

import torch
from torch import Tensor

from .._core.ops import update as update_ops
from .._core.ops.cache_plan import CachePlanner
from .._core.ops.gpu_cache import CachePlanOnDevice, GpuCacheState
from .row_cache import RowCache, _ordered, _scale_key, _tensors_of
from .row_store import HostRows

# Arrays one move of the kernels takes (cuda/he_cuda.h's HE_CUDA_CACHE_ARRAYS).
_MOVED_AT_ONCE = 3
_SCALE_KEYS = (_scale_key("exp_avg"), _scale_key("exp_avg_sq"))
# Compact moments the GPU update takes, as (exp_avg's dtype, exp_avg_sq's):
# csrc/quantize.h's 8-bit forms (scales a block) and bfloat16.
_DEVICE_FORMS = {(torch.bfloat16, torch.bfloat16): 2, (torch.int8, torch.uint8): 4}
# The other optimizers the GPU updates (cuda/he_cuda_optim_cached.cuh), with
# their float32 state's keys in the kernel's order: SGD none, Adagrad a
# value an element, row-wise Adagrad a value a row ([num_rows] on the host,
# [capacity] in the records).
_DEVICE_STATE = {update_ops.SGD: (), update_ops.ADAGRAD: ("sum",), update_ops.ROWWISE_ADAGRAD: ("row_sum",)}


def _words(records):
    """A record's row width in float32 words (its bytes / 4)."""
    return records[:1].nbytes // 4 if records.dim() > 1 else 1


def _all_zero_bits(tensor, rows_at_once=1 << 16):
    """Whether every bit of `tensor` is zero (new state; -0.0 is not),
    reading it a chunk of rows at a time and stopping at the first set."""
    flat = tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)
    for at in range(0, flat.shape[0], rows_at_once):
        if flat[at:at + rows_at_once].contiguous().view(torch.uint8).any():
            return False
    return True


def _compact_state(arrays):
    """update_ops' compact state over (weight, exp_avg, exp_avg_sq[, their
    scales]), rounded to nearest."""
    scales = arrays[3:] or (None, None)
    return {"exp_avg": (arrays[1], scales[0], False), "exp_avg_sq": (arrays[2], scales[1], False)}


def _compact_forms(state, dim):
    """(exp_avg's, exp_avg_sq's) state dtype of a compact SparseAdam state
    that a cache updates on its device, or None: moments a value per column
    rounded to nearest (stochastic rounding draws from the row's number,
    and a record's is its slot's), of a form the kernel takes, whose rows
    are whole float32 words (the moves move words)."""
    items = [state.get("exp_avg"), state.get("exp_avg_sq")]
    if len(state) != 2 or any(isinstance(item, Tensor) or item is None for item in items):
        return None
    if any(item[2] or item[0].dim() != 2 for item in items):
        return None
    forms = (items[0][0].dtype, items[1][0].dtype)
    per_word = _DEVICE_FORMS.get(forms)
    if per_word is None or dim % per_word:
        return None
    if (forms[0] == torch.int8) != all(item[1] is not None for item in items):
        return None
    return forms


def _float32_state(kind, state):
    """Whether optimizer `kind` with `state` is one a cache updates on its
    device besides SparseAdam: SGD, Adagrad or row-wise Adagrad with its
    state as plain float32 tensors (a compact one moves to host records)."""
    keys = _DEVICE_STATE.get(kind)
    return keys is not None and set(state) == set(keys) and \
        all(isinstance(t, Tensor) and t.dtype == torch.float32 for t in state.values())


class HostTwinState:
    """GpuCacheState's interface on the CPU: the CPU planner (the GPU
    planner's host twin: the same decisions) and the same moves, gathers
    and updates with torch indexing and the core, on host-memory records.
    It lets the tests run GpuRowCache's executor without a GPU."""

    def __init__(self, table, capacity: int, protect: int, policy: str = "frequency"):
        self.table, self.capacity = table, capacity
        self.planner = CachePlanner(table.num_rows, capacity, lookahead=protect == 2, policy=policy)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.record_table = None  # set by the cache: the HostTable of its records
        # As GpuCacheState's: rows whose host state may have changed since
        # it came to the cache, and the rows of arrays the moves read.
        self.written = torch.zeros(table.num_rows, dtype=torch.bool)
        self.host_reads = 0

    def plan(self, unique: Tensor, n: int) -> CachePlanOnDevice:
        unique = unique[:n]
        p = self.planner.plan(unique)
        fetched = torch.searchsorted(unique, p.fetch_row)
        miss = torch.sort(torch.cat([fetched, (p.slot < 0).nonzero().view(-1)])).values
        evicted_from = torch.full((self.capacity,), -1, dtype=torch.int64)
        evicted_from[p.evict_slot.long()] = p.evict_row
        miss_slot = p.slot[miss].long()
        evict_row = torch.where(miss_slot >= 0, evicted_from[miss_slot.clamp(min=0)], -1)
        self.row_of[p.evict_slot.long()] = -1
        self.row_of[p.fetch_slot.long()] = p.fetch_row
        return CachePlanOnDevice(p.slot, miss, evict_row)

    def move(self, plan, unique, n, records, hosts, dim, zero_fill=0):
        rows = unique[plan.miss]
        slot = plan.slot[plan.miss].long()
        evicting, taken = plan.evict_row >= 0, slot >= 0
        self.written[rows[~taken]] = True  # bypassed: updated in host memory
        fresh = taken & ~self.written[rows]
        for i, (record, host) in enumerate(zip(records, hosts)):
            host[plan.evict_row[evicting]] = record[slot[evicting]]
            read = taken & ~fresh if zero_fill >> i & 1 else taken
            record[slot[taken & ~read]] = 0
            record[slot[read]] = host[rows[read]]
            self.host_reads += int(read.sum())
        self.written[plan.evict_row[evicting]] = True

    def gather(self, records, host, plan, unique, n, dim):
        slot = plan.slot.long()
        return torch.where((slot >= 0).unsqueeze(1), records[slot.clamp(min=0)], host[unique[:n]])

    def adam(self, records, hosts, indices, values, **hyper):
        self._adam(lambda arrays: {"exp_avg": arrays[1], "exp_avg_sq": arrays[2]}, records, hosts, indices, values,
                   **hyper)

    def adam_compact(self, records, hosts, forms, indices, values, **hyper):
        """adam's, with compact moments (GpuCacheState.adam_compact's
        arrays)."""
        self._adam(_compact_state, records, hosts, indices, values, **hyper)

    def update(self, kind, records, hosts, indices, values, **hyper):
        """GpuCacheState.update's: SGD, Adagrad or row-wise Adagrad
        (records, hosts: the weight, then its state)."""
        keys = _DEVICE_STATE[kind]
        self._update(kind, lambda arrays: dict(zip(keys, arrays[1:])), records, hosts, indices, values, **hyper)

    def _adam(self, state_of, records, hosts, indices, values, **hyper):
        self._update(update_ops.ADAM, state_of, records, hosts, indices, values, **hyper)

    def _update(self, kind, state_of, records, hosts, indices, values, **hyper):
        """The core's update of each row where it is now: its slot's
        records, or its host row; state_of(arrays) is update_ops' state
        over the weight and the state's arrays (a compact state's scales
        among them)."""
        slots = self.planner.slots_of(indices).long()
        cached = slots >= 0
        update_ops.update_rows(kind, self.record_table, state_of(records), slots[cached], values[cached], **hyper)
        update_ops.update_rows(kind, self.table, state_of(hosts), indices[~cached], values[~cached], **hyper)

    def sync_records(self, records, hosts, dim, *, to_host):
        slots = (self.row_of >= 0).nonzero().view(-1)
        rows = self.row_of[slots]
        if to_host:
            self.written[rows] = True
        for record, host in zip(records, hosts):
            if to_host:
                host[rows] = record[slots]
            else:
                record[slots] = host[rows]

    def snapshot(self) -> dict:
        return self.counts()

    def counts(self, snapshot=None) -> dict:
        if snapshot is not None:
            return snapshot
        stats = dict(self.planner.stats)
        return {**{k: stats[k] for k in ("batches", "rows", "hits", "fetches", "evictions", "bypassed")},
                "host_reads": self.host_reads}

    def occupied(self) -> int:
        return int((self.row_of >= 0).sum())


class GpuRowCache(RowCache):
    """A float32 table's row cache on `device` (a GPU; "cpu": the host
    twin, for tests): RowCache's coherence with host memory (dirty, stale,
    flush, attach_state) over a planner and records that stay on the
    device, updated there with the CPU core's bits by SparseAdam (float32
    state, or compact moments: bfloat16, or 8-bit with a scale a block,
    rounded to nearest), SGD, Adagrad and row-wise Adagrad (FBGEMM's
    default, exact row-wise Adagrad; float32 state). Another optimizer's
    first update (SparseAdam with a row-wise second moment), or another
    state (Adagrad's compact sum, stochastic rounding), moves the cache to
    host memory (a RowCache of host records), with a warning."""

    def __init__(self, table, capacity: int, *, device, policy: str = "frequency"):
        self.table = table
        self.lookahead = True
        self.policy = policy
        self.device = torch.device(device)
        if table.dtype != torch.float32:
            raise ValueError(f"hostembed: a row cache in GPU memory takes float32 tables (its kernels do), not "
                             f"{table.dtype}")
        self._capacity = capacity
        self.records = None
        self.ops = GpuCacheState(table.num_rows, capacity, 2, self.device, policy) if self.device.type == "cuda" \
            else HostTwinState(table, capacity, 2, policy)
        self.host = {"weight": table.tensor}
        self.store = HostRows(self.host)  # records move through host memory's mapping, a table on disk's too
        self.cached = {"weight": self._new_records(weight=True)}
        if self.device.type == "cpu":
            self.ops.record_table = self.records
        self.version = {"weight": table.tensor._version}
        self.dirty, self.stale = set(), set()
        # State keys whose host tensor held all zero bits when attached (the
        # fetches' zero_fill; the ops mark rows written since).
        self.zero_known = set()
        # Bytes moved: written back by flushes, and the record's size from
        # each snapshot of the counts on (a record grows when state is
        # attached), read only when stats are (the counts are on the device).
        self.moved = {"fetched_bytes": 0, "written_back_bytes": 0}
        self._record_sizes = [(None, self._record_bytes())]
        self._last_use = None
        self.last_update_from = None
        # Times the host waited for the device on this cache's behalf (on
        # the host twin: took a path that would wait on a GPU): the
        # lookups' dedups, which the lookup counts, and the executor's own
        # waits, none on a step's path (a gradient the update must check on
        # the host, a flush, reading stats). Tests read it.
        self.host_waits = 0
        # The last backward's row indices on the device, distinct by
        # construction (a dedup's), which the update takes as they are.
        self._distinct = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def stats(self) -> dict:
        """As RowCache.stats; reading it waits for the device."""
        self.host_waits += 1
        counts = self.ops.counts()
        moved = dict(self.moved)
        ends = [self.ops.counts(s) for s, _ in self._record_sizes[1:]] + [counts]
        before = {"fetches": 0, "evictions": 0}
        for (_, record), end in zip(self._record_sizes, ends):
            moved["fetched_bytes"] += (end["fetches"] - before["fetches"]) * record
            moved["written_back_bytes"] += (end["evictions"] - before["evictions"]) * record
            before = end
        return {**counts, **moved}

    def _host_of(self, tensor):
        """What the ops take for a host tensor of the table (its rows or
        state): its registered buffer on a GPU, the tensor on the host twin."""
        if self.device.type == "cpu":
            return tensor
        buf = self.table.pinned_buffer(tensor, self.device, "a GPU row cache")
        if buf is None:
            raise RuntimeError("hostembed: a row cache in GPU memory reads and writes host rows through CUDA's "
                               "mapping of them, and CUDA refused to pin this table; build the module without "
                               "cache_rows")
        return buf

    def _arrays(self, keys):
        return [self.cached[k] for k in keys], [self._host_of(self.host[k]) for k in keys]

    def _as_words(self, records):
        """Records as the kernels move them, float32 words (the host twin
        moves them with torch, as they are, beside host tensors of theirs)."""
        if self.device.type == "cpu" or records.dtype == torch.float32:
            return records
        return records.view(torch.float32)

    def _word_groups(self, keys):
        """(records, hosts, width, zero_fill) for the moves of `keys`'
        records: the kernels move rows of float32 words, so records are
        grouped by their row's width in words (a compact state's codes and
        scales are bits to them), at most _MOVED_AT_ONCE a group; bit i of
        zero_fill set where the group's i-th array was all zero bits when it
        came to the cache (a row not written since is fetched as zeros)."""
        groups = {}
        for key in keys:
            groups.setdefault(_words(self.cached[key]), []).append(key)
        for width, group in groups.items():
            for at in range(0, len(group), _MOVED_AT_ONCE):
                part = group[at:at + _MOVED_AT_ONCE]
                zero_fill = sum(1 << i for i, k in enumerate(part) if k in self.zero_known)
                yield ([self._as_words(self.cached[k]) for k in part], [self._host_of(self.host[k]) for k in part],
                       width, zero_fill)

    def _host_memory_next(self):
        """Before the ops read or write host memory: after any GPU work on
        the rows on another stream (an uncached lookup's, say)."""
        if self.device.type == "cuda":
            self.table.order_after_gpu_use(torch.cuda.current_stream(self.device))

    def _host_memory_used(self):
        """After the ops' own reads and writes of host memory: later GPU or
        CPU work on the rows is ordered after them (HostTable), and the host
        tensors' versions (which the twin's writes move) are not news."""
        if self.device.type == "cuda":
            self.table.record_gpu_use(torch.cuda.current_stream(self.device))
        self._seen()

    def _read_in(self, records, host):
        # Reads host memory only; not _host_memory_used(): _sync() calls this
        # a key at a time, and marking every key seen would hide another
        # key's write that it has yet to look at.
        self._host_memory_next()
        self.ops.sync_records([self._as_words(records)], [self._host_of(host)], _words(records), to_host=False)
        if self.device.type == "cuda":
            self.table.record_gpu_use(torch.cuda.current_stream(self.device))
        # Read again: host memory was written where the cache did not see it.
        self.zero_known -= {k for k, h in self.host.items() if h is host}

    def attach_state(self, key, host_tensor):
        records = super().attach_state(key, host_tensor)
        self._record_sizes.append((self.ops.snapshot(), self._record_bytes()))
        # New state: its rows need not be read until written. A tensor
        # attached under a key known zero before may hold anything.
        if _all_zero_bits(host_tensor):
            self.zero_known.add(key)
        else:
            self.zero_known.discard(key)
        return records

    def detach_state(self) -> None:
        super().detach_state()
        self.zero_known.clear()

    def host_rows_written(self, key: str, rows: Tensor) -> None:
        self.zero_known.discard(key)
        super().host_rows_written(key, rows)

    def note_distinct(self, indices: Tensor) -> None:
        """indices (a backward's unique rows, on the device) will come back to
        update() as they are: it need not check them for repeats."""
        self._distinct = (indices.data_ptr(), indices.numel(), indices.device)

    def _known_distinct(self, indices):
        return self._distinct == (indices.data_ptr(), indices.numel(), indices.device)

    # ---- a batch

    @_ordered
    def plan_batch(self, unique: Tensor, n: int) -> CachePlanOnDevice:
        """Plans the batch of unique rows unique[:n] (ascending, distinct, in
        range) and moves the records it needs."""
        self._sync()
        self._host_memory_next()
        plan = self.ops.plan(unique, n)
        for records, hosts, width, zero_fill in self._word_groups(list(self.host)):
            self.ops.move(plan, unique, n, records, hosts, width, zero_fill)
        self._host_memory_used()
        return plan

    @_ordered
    def gather(self, plan: CachePlanOnDevice, unique: Tensor, n: int) -> Tensor:
        """The planned batch's rows [n, dim], unique[k]'s in row k."""
        self._sync()
        self._host_memory_next()
        rows = self.ops.gather(self.cached["weight"], self._host_of(self.host["weight"]), plan, unique, n,
                               self.table.dim)
        self._host_memory_used()
        return rows

    @_ordered
    def update(self, kind: int, state: dict, indices: Tensor, values: Tensor, **hyper) -> None:
        """RowCache.update on the device, each row in its slot if cached now,
        else in host memory: SparseAdam's with float32 state or compact
        moments (bfloat16, or 8-bit with their scales) rounded to nearest;
        SGD's, Adagrad's and row-wise Adagrad's with float32 state. Another
        optimizer or state moves the cache to host memory first. An index
        outside the table raises IndexError before anything is written."""
        compact = not all(isinstance(item, Tensor) for item in state.values())
        adam = kind == update_ops.ADAM
        forms = _compact_forms(state, self.table.dim) if compact and adam else None
        on_device = (forms is not None or not compact) if adam else _float32_state(kind, state)
        if not on_device:
            if compact:
                why = "this compact optimizer state"
            elif kind == update_ops.ROWWISE_ADAM:
                why = "SparseAdam's row-wise second moment"
            else:
                why = update_ops.optimizer_name(kind)
            self._to_host_cache(why).update(kind, state, indices, values, **hyper)
            return
        self.last_update_from = values.device
        distinct, self._distinct = indices.device == self.device and self._known_distinct(indices), None
        if not distinct:
            indices, values = self._distinct_rows(indices, values)
        self._sync()
        tensors = _tensors_of(state)
        for key, tensor in tensors.items():
            if self.host.get(key) is not tensor:
                self.attach_state(key, tensor)
        if adam:
            keys = ("weight", "exp_avg", "exp_avg_sq") + tuple(k for k in _SCALE_KEYS if k in tensors)
        else:
            keys = ("weight", *_DEVICE_STATE[kind])
        records, hosts = self._arrays(keys)
        values = values.to(torch.float32).contiguous()
        self._host_memory_next()
        if not adam:
            self.ops.update(kind, records, hosts, indices, values, **hyper)
        elif compact:
            self.ops.adam_compact(records, hosts, forms, indices, values, **hyper)
        else:
            self.ops.adam(records, hosts, indices, values, **hyper)
        self._host_memory_used()
        self.dirty.update(keys)

    def _distinct_rows(self, indices, values):
        """A gradient that may repeat rows (several lookups, or weight.grad on
        the CPU), checked and summed as the core sums repeats, on the device."""
        self.host_waits += 1
        host_indices = indices.cpu()
        bad = (host_indices < 0) | (host_indices >= self.table.num_rows)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise IndexError(f"hostembed: row {int(host_indices[at])} at {at} is not in [0, {self.table.num_rows})")
        if host_indices.numel() > 1 and not bool((host_indices[1:] > host_indices[:-1]).all()) \
                and torch.unique(host_indices).numel() != host_indices.numel():
            host_indices, values = update_ops.sum_repeated_rows(self.table, host_indices, values.cpu())
        return host_indices.to(self.device), values.to(self.device)

    def _to_host_cache(self, why) -> RowCache:
        """Replaces this cache by one of host-memory records (empty), its
        rows written back first, for an optimizer without a GPU update."""
        warnings.warn(f"hostembed: {why} has no GPU update of a row cache's records; they move to host memory, "
                      "where a step through the cache is slower than one without it (build the module without "
                      "cache_rows for this optimizer; on the GPU, SGD, Adagrad and RowWiseAdagrad update them "
                      "with float32 state, SparseAdam with float32 state or bfloat16 or 8-bit moments rounded to "
                      "nearest whose rows fill whole float32 words)",
                      stacklevel=5)
        self.flush()
        cache = RowCache(self.table, self.capacity, lookahead=True, policy=self.policy)
        self.table.cache, self.table.planned = cache, None
        return cache

    @_ordered
    def flush(self, keys=None) -> None:
        self._sync()
        todo = [k for k in (self.host if keys is None else keys) if k in self.dirty]
        if todo:
            self._host_memory_next()
            for records, hosts, width, _ in self._word_groups(todo):
                self.ops.sync_records(records, hosts, width, to_host=True)
            self.host_waits += 1
            if self.device.type == "cuda":
                # Host memory is read next (state_dict, save, the weight).
                torch.cuda.current_stream(self.device).synchronize()
            occupied = self.ops.occupied()
            self.moved["written_back_bytes"] += occupied * sum(self.cached[k][:1].nbytes for k in todo)
            self.dirty.difference_update(todo)
        self._seen()

    # RowCache's CPU-planner executor has no use here.
    def plan(self, unique):
        raise NotImplementedError("GpuRowCache plans with plan_batch")

    def rows(self, plan, unique):
        raise NotImplementedError("GpuRowCache reads rows with gather")
