"""A row cache's planner and records in GPU memory (cuda/cache_plan.cu,
cuda/cache.cu), over torch tensors: the planner's state (GpuCacheState),
a batch's plan, the moves of records over the pinned mapping, the
lookup's gather, the updates of SparseAdam, SGD, Adagrad and row-wise
Adagrad where each row is now. Everything is queued on torch's current
stream of the cache's device; nothing here waits for the GPU, except
counts()."""
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _C
from ..table import STATE_CODES
from .cache_plan import POLICIES
from .common import address

# cuda/he_cuda.h's he_cuda_cache counters, in order (recent: the gate's
# span of include/he_cache_policy.h, 3).
_COUNTERS = ("hand", "base", "misses", "stop", "batches", "rows", "hits", "fetches", "evictions", "window",
             "window_hand", "eligible", "back", "turned", "least", "reuse", "main", "recent0", "recent1", "recent2",
             "taken", "host_reads")


class CachePlanOnDevice(NamedTuple):
    """One batch's plan in the cache's device arrays, for its n unique rows:
    slot[k] (int32) the slot of unique[k], -1 where it bypasses the cache;
    miss[:misses] (int64) the positions of the misses, ascending;
    evict_row[j] the row whose record the j-th miss's slot wrote back (-1:
    none). The count of misses stays on the device."""
    slot: Tensor
    miss: Tensor
    evict_row: Tensor


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


class GpuCacheState:
    """The planner of a cache of `capacity` slots over num_rows rows, in GPU
    memory: the arrays of csrc/cache_plan.c (its host twin) and counters.
    protect: as the CPU planner's (2: batches are planned a step ahead);
    policy: a name of cache_plan.POLICIES."""

    def __init__(self, num_rows: int, capacity: int, protect: int, device, policy: str = "frequency"):
        self.device = torch.device(device)
        if self.device.index is None:  # "cuda": the current one, as torch takes it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_rows, self.capacity, self.protect = num_rows, capacity, protect
        on = {"device": self.device}
        # One uint32 a row (int32 here: torch's uint32 lacks kernels); the
        # kernels read the bits.
        self.entry = torch.zeros(max(num_rows, 1), dtype=torch.int32, **on)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64, **on)
        self.used_at = torch.full((capacity,), -1, dtype=torch.int64, **on)
        self.referenced = torch.zeros(capacity, dtype=torch.uint8, **on)
        self.counters = torch.zeros(len(_COUNTERS), dtype=torch.int64, **on)
        self.batch = 0  # batches planned; the host counts them, so it knows when the counts age
        # A byte a row: its host state may differ from what it was when the
        # state came to the cache (the moves' zero_fill).
        self.written = torch.zeros(max(num_rows, 1), dtype=torch.uint8, **on)
        if policy not in POLICIES:
            raise ValueError(f"hostembed: a cache policy is one of {sorted(POLICIES)}, got {policy!r}")
        self.policy = policy
        # The frequency policy's per row uses, last use and last turning
        # away, and per slot uses (uint16 and uint32 bits in int16, int32).
        frequency = policy == "frequency"
        rows, slots = (max(num_rows, 1), capacity) if frequency else (0, 0)
        self.count = torch.zeros(rows, dtype=torch.int16, **on)
        self.last = torch.zeros(rows, dtype=torch.int32, **on)
        self.turned_at = torch.zeros(rows, dtype=torch.int32, **on)
        self.slot_count = torch.zeros(slots, dtype=torch.int16, **on)

    def _cache(self):
        extra = (address(self.count), address(self.last), address(self.turned_at), address(self.slot_count)) \
            if self.policy == "frequency" else (0, 0, 0, 0)
        return (address(self.entry), self.num_rows, address(self.row_of), address(self.used_at),
                address(self.referenced), self.capacity, address(self.counters), self.protect,
                POLICIES[self.policy], *extra)

    def plan(self, unique: Tensor, n: int) -> CachePlanOnDevice:
        """Plans the next batch, unique[:n] (a GPU dedup's: ascending,
        distinct, in range)."""
        on = {"device": self.device}
        size = max(n, 1)
        plan = CachePlanOnDevice(torch.empty(size, dtype=torch.int32, **on), torch.empty(size, dtype=torch.int64, **on),
                                 torch.empty(size, dtype=torch.int64, **on))
        ws_bytes = _C.cuda_cache_plan_workspace(n=n, capacity=self.capacity, policy=POLICIES[self.policy],
                                                device=self.device.index)
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, **on)
        _C.cuda_cache_plan(cache=self._cache(), unique=address(unique), n=n, batch=self.batch + 1,
                           slot=address(plan.slot), miss=address(plan.miss), evict_row=address(plan.evict_row),
                           workspace=address(workspace), workspace_bytes=ws_bytes, device=self.device.index,
                           stream=_stream(self.device))
        self.batch += 1
        return plan

    def move(self, plan: CachePlanOnDevice, unique: Tensor, n: int, records, hosts, dim: int,
             zero_fill: int = 0) -> None:
        """The plan's write-backs and fetches, for each records tensor and
        the registered HostBuffer of the rows it caches; rows bypassed or
        written back are marked written, and a fetched row not written since
        its state came gets zeros, unread, for the arrays of the zero_fill
        bits (cuda/he_cuda.h)."""
        _C.cuda_cache_move(cache=self._cache(), records=tuple(address(r) for r in records), host=tuple(hosts),
                           dim=dim, unique=address(unique), n=n, slot=address(plan.slot), miss=address(plan.miss),
                           evict_row=address(plan.evict_row), written=address(self.written), zero_fill=zero_fill,
                           device=self.device.index, stream=_stream(self.device))

    def gather(self, records: Tensor, host, plan: CachePlanOnDevice, unique: Tensor, n: int, dim: int) -> Tensor:
        """unique[:n]'s rows, from their slots or over the mapping."""
        rows = torch.empty(n, dim, dtype=torch.float32, device=self.device)
        _C.cuda_cache_gather(records=(address(records),), host=(host,), num_rows=self.num_rows, dim=dim,
                             unique=address(unique), slot=address(plan.slot), n=n, out=address(rows),
                             device=self.device.index, stream=_stream(self.device))
        return rows

    def adam(self, records, hosts, indices: Tensor, values: Tensor, *, lr, beta1, beta2, eps, step, maximize,
             weight_decay=0.0, lr_decay=0.0) -> None:
        """SparseAdam of distinct rows `indices` (int64, on the device) with
        gradient rows `values`, each where the cache says it is now.
        records, hosts: weight, exp_avg, exp_avg_sq."""
        dim = values.shape[1] if values.dim() == 2 else 0
        _C.cuda_cache_adam(cache=self._cache(), records=tuple(address(r) for r in records), host=tuple(hosts),
                           dim=dim, indices=address(indices), values=address(values), nnz=indices.numel(), lr=lr,
                           beta1=beta1, beta2=beta2, eps=eps, step=step, maximize=maximize,
                           weight_decay=weight_decay, device=self.device.index, stream=_stream(self.device))

    def adam_compact(self, records, hosts, forms, indices: Tensor, values: Tensor, *, lr, beta1, beta2, eps, step,
                     maximize, weight_decay=0.0, lr_decay=0.0) -> None:
        """adam with compact moments (forms: exp_avg's and exp_avg_sq's
        dtype, bfloat16 or 8-bit) rounded to nearest, to the CPU core's bits.
        records, hosts: weight, exp_avg, exp_avg_sq (and the 8-bit moments'
        scales)."""
        dim = values.shape[1] if values.dim() == 2 else 0
        _C.cuda_cache_adam_compact(cache=self._cache(), records=tuple(address(r) for r in records),
                                   host=tuple(hosts), dim=dim, m_dtype=STATE_CODES[forms[0]],
                                   v_dtype=STATE_CODES[forms[1]], indices=address(indices), values=address(values),
                                   nnz=indices.numel(), lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step,
                                   maximize=maximize, weight_decay=weight_decay, device=self.device.index,
                                   stream=_stream(self.device))

    def update(self, kind: int, records, hosts, indices: Tensor, values: Tensor, *, lr, step, maximize, eps=0.0,
               lr_decay=0.0, weight_decay=0.0, beta1=0.0, beta2=0.0) -> None:
        """SGD's, Adagrad's or row-wise Adagrad's update (kind: update_ops'
        SGD, ADAGRAD, ROWWISE_ADAGRAD) of distinct rows `indices` (int64, on
        the device) with gradient rows `values`, each where the cache says it
        is now, with the CPU core's bits. records, hosts: the weight, then
        the state (none; sum; row_sum, one value a row). beta1, beta2: not
        these optimizers'; weight_decay: none of these takes it (as in the
        core)."""
        dim = values.shape[1] if values.dim() == 2 else 0
        _C.cuda_cache_update(cache=self._cache(), records=tuple(address(r) for r in records), host=tuple(hosts),
                             dim=dim, kind=kind, indices=address(indices), values=address(values),
                             nnz=indices.numel(), lr=lr, eps=eps, lr_decay=lr_decay, step=step, maximize=maximize,
                             weight_decay=weight_decay, device=self.device.index, stream=_stream(self.device))

    def sync_records(self, records, hosts, dim: int, *, to_host: bool) -> None:
        """Every occupied slot's records written to (or read from) its host rows."""
        _C.cuda_cache_sync_records(cache=self._cache(), records=tuple(address(r) for r in records),
                                   host=tuple(hosts), dim=dim, to_host=to_host, written=address(self.written),
                                   device=self.device.index, stream=_stream(self.device))

    def snapshot(self) -> Tensor:
        """The counts now, kept on the device for counts() (no wait)."""
        return self.counters.clone()

    def counts(self, snapshot=None) -> dict:
        """The counts since the cache was made, or at a snapshot (waits for
        the device)."""
        values = dict(zip(_COUNTERS, (self.counters if snapshot is None else snapshot).tolist()))
        return {"batches": values["batches"], "rows": values["rows"], "hits": values["hits"],
                "fetches": values["fetches"], "evictions": values["evictions"],
                "bypassed": values["rows"] - values["hits"] - values["fetches"], "host_reads": values["host_reads"]}

    def occupied(self) -> int:
        """Slots holding a row (waits for the device)."""
        return int((self.row_of >= 0).sum())
