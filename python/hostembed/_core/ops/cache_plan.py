"""The row cache's planner (the core's, csrc/cache_plan.h), its arrays
wrapped in tensors: which of a table's rows sit in which slot of a cache
(records holding a row and its optimizer state), and what each batch must
move. _cache.RowCache carries the plans out."""
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _C


# The planner's limit (csrc/cache_plan.h: 28-bit slot numbers).
MAX_CACHE_ROWS = 2**28 - 1
# include/he_cache_policy.h's policies, by name: "frequency" (the default)
# counts every row's uses over the whole stream; "clock" is the policy
# before it (4-bit counts halved every 10 batches), kept for the GPU
# planner's recorded plans (tests/fixtures/gpu_cache_plans.pt).
POLICIES = {"frequency": _C.CACHE_FREQUENCY, "clock": _C.CACHE_CLOCK}


class CachePlan(NamedTuple):
    """One batch's moves, carried out in this order: evictions (slot
    evict_slot[i]'s record written back to host row evict_row[i]), then
    fetches (host row fetch_row[i]'s record into slot fetch_slot[i]; where
    fetch_after_update[i], only after the previous step's update, which
    changed that row in host memory), then the batch: unique row k is in
    slot[k], or in host memory where slot[k] is -1."""
    slot: Tensor                # int32 [num_unique]
    fetch_row: Tensor           # int64 [fetches], ascending
    fetch_slot: Tensor          # int32 [fetches]
    fetch_after_update: Tensor  # bool [fetches]
    evict_slot: Tensor          # int32 [evictions]
    evict_row: Tensor           # int64 [evictions]


class CachePlanner:
    """Plans batches for a cache of `capacity` slots over a table of
    num_rows rows. lookahead=True: each batch is planned while the previous
    step may still run, so the previous batch's slots stay too (protect 2
    in the core's terms). policy: a name of POLICIES."""

    def __init__(self, num_rows: int, capacity: int, *, lookahead: bool = False, policy: str = "frequency"):
        if policy not in POLICIES:
            raise ValueError(f"hostembed: a cache policy is one of {sorted(POLICIES)}, got {policy!r}")
        self.policy = policy
        self._planner = _C.CachePlanner(num_rows=num_rows, capacity=capacity, protect=2 if lookahead else 1,
                                        policy=POLICIES[policy])

    @property
    def capacity(self) -> int:
        return self._planner.capacity

    @property
    def stats(self) -> dict:
        """Counts since the planner was made: batches, rows (unique rows
        planned), hits, fetches, evictions, bypassed."""
        return self._planner.stats

    def slots_of(self, rows: Tensor) -> Tensor:
        """The slot (int32) holding each of `rows` (int64, CPU) now, or -1."""
        rows = rows.to(torch.int64).contiguous()
        slots = torch.empty(rows.numel(), dtype=torch.int32)
        self._planner.slots_of(rows=rows.data_ptr(), count=rows.numel(), slots=slots.data_ptr())
        return slots

    def plan(self, unique: Tensor) -> CachePlan:
        """The plan of a batch whose unique rows are `unique` (a 1-D int64
        CPU tensor, ascending and distinct, as a Dedup gives them).
        IndexError for a row outside the table, ValueError for rows not
        ascending; the planner is then unchanged."""
        if unique.dtype != torch.int64 or unique.dim() != 1 or unique.device.type != "cpu":
            raise TypeError(f"hostembed: a cache plan takes a 1-D int64 CPU tensor of unique rows, got a "
                            f"{unique.dim()}-D {unique.dtype} tensor on {unique.device}")
        unique = unique.contiguous()
        n = unique.numel()
        slot = torch.empty(n, dtype=torch.int32)
        fetch_row, evict_row = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        fetch_slot, evict_slot = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
        fetch_after_update = torch.empty(n, dtype=torch.uint8)
        fetches, evictions = self._planner.plan(
            unique=unique.data_ptr(), num_unique=n, slot=slot.data_ptr(), fetch_row=fetch_row.data_ptr(),
            fetch_slot=fetch_slot.data_ptr(), fetch_after_update=fetch_after_update.data_ptr(),
            evict_slot=evict_slot.data_ptr(), evict_row=evict_row.data_ptr())
        return CachePlan(slot, fetch_row[:fetches], fetch_slot[:fetches], fetch_after_update[:fetches].bool(),
                         evict_slot[:evictions], evict_row[:evictions])
