"""Streams, oracles and a policy simulator for benchmarks/cache/cache_plan.py's
--protocol mode: how far the row cache's policy is from what a cache of
the same size could keep.

A stream here is the list of the unique rows (sorted int64 numpy arrays)
of each batch planned, in planning order: warm-up batches first, then the
timed ones; hit rates are counted over the timed ones only, as
sum(rows already cached) / sum(unique rows), which is how the planner's
stats count them.

Oracles:
  * static: a fixed cache of the rows used by the most batches of the
    whole stream (ties: lower row first) -- what a frequency policy that
    never forgets converges to on a stationary stream; it is chosen with
    the timed batches' own counts and holds its rows from the start;
  * static_ranks: the same of the rows the generator's law makes most
    probable (FBGEMM's top ranks), knowing nothing of the draws;
  * belady: after each batch the cache holds the C rows, of those cached
    and those the batch used, whose next use comes soonest (rows never
    used again dropped). Per request that is Belady's rule with bypass
    (evict the row used farthest ahead; admit a miss only if it is used
    before that row), and since a batch's rows all come at the same
    time and the batch decides only what the next batches find, it is
    optimal for the batched stream too.

The simulator (simulate) replays policies in numpy: "sweep" is the clock
policy's CLOCK sweep (include/he_cache_policy.h), one vectorised pass per
round of the hand, as the GPU decides it; "sorted" pairs the misses, most
used first, with the eligible slots, least used first, as the frequency
policy does. SHIPPED names the two the planners implement; the simulator
makes their decisions exactly (tests/test_cache_plan_oracles.py). Both admit a miss
only against a row used less (fewer uses; or, where recency_ties says, as
many uses, the last longer ago); only a window (Policy.window, .gate)
takes rows the frequency rule turned away, in slots set apart for them."""
from dataclasses import dataclass

import numpy as np
import torch

import _anchor_streams as anchors


@dataclass
class Stream:
    protocol: str
    rows: int          # rows of the (folded) table
    batches: list      # sorted unique rows of each planned batch (np.int64)
    warmup: int        # how many of them are warm-up
    base: int          # the rows a cache fraction is of
    params: dict       # workload parameters for the report
    hottest: np.ndarray = None  # rows, most probable first, where the generator's law says (FBGEMM's)


def _unique(ids):
    return torch.unique(ids).numpy().astype(np.int64)


def load(protocol, scale=1.0, seed=0, tables=1):
    """The planning order of a protocol's stream (_anchor_streams), at
    `scale` of its rows and ids a step. dynamicemb: `tables` tables folded
    (the problem's measurements are of one); its cache base is the touched
    rows (cfr), FBGEMM's is all rows (its cache_load_factor), the
    reference streams' the rows they touch, the batch planned after the
    last timed one included (as benchmarks/gpu/cache_step.py counts them)."""
    if protocol == "dynamicemb":
        w = anchors.dynamicemb(scale, tables=tables, seed=seed)
    elif protocol == "fbgemm":
        w = anchors.fbgemm(scale, seed=seed)
    elif protocol in ("fresh", "replayed"):
        w = anchors.reference(protocol, scale, seed=seed)
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    distinct = [_unique(b) for b in w.batches]
    batches = [distinct[i] for i in w.warmup + w.timed]
    if protocol == "fbgemm":
        base = w.rows
    else:
        seen = np.zeros(w.rows, dtype=bool)
        for i in set(w.warmup) | set(w.timed) | ({w.after} if protocol != "dynamicemb" else set()):
            seen[distinct[i]] = True
        base = int(seen.sum())
    params = {"scale": scale, "seed": seed, "rows": w.rows, "warmup_batches": len(w.warmup),
              "timed_batches": len(w.timed), "cache_base_rows": base,
              "unique_per_step": float(np.mean([b.size for b in batches[len(w.warmup):]])),
              **{k: v for k, v in w.notes.items() if k != "unique_per_step"}}
    hottest = None if w.hottest is None else w.hottest.numpy().astype(np.int64)
    return Stream(protocol, w.rows, batches, len(w.warmup), base, params, hottest)


def hit_rate(hits, batches):
    return hits / max(1, sum(b.size for b in batches))


def static_top(stream, capacity):
    """Hit rate over the timed batches of a fixed cache of the `capacity`
    rows used by the most batches (ties: lower row first)."""
    counts = np.zeros(stream.rows, dtype=np.int32)
    for b in stream.batches:
        counts[b] += 1
    capacity = min(capacity, stream.rows)
    # The count at the boundary, and how many rows of it fit: no sort of
    # every row (60M of them for the reference stream).
    hist = np.bincount(counts)
    above = np.cumsum(hist[::-1])[::-1]  # above[c]: rows used by >= c batches
    edge = int(np.nonzero(above >= capacity)[0].max())
    cached = counts > edge
    room = capacity - int(cached.sum())
    cached[np.nonzero(counts == edge)[0][:room]] = True
    timed = stream.batches[stream.warmup:]
    return hit_rate(sum(int(cached[b].sum()) for b in timed), timed)


def static_ranks(stream, capacity):
    """Hit rate over the timed batches of a fixed cache of the `capacity`
    most probable rows by the stream's law (FBGEMM's top ranks)."""
    cached = np.zeros(stream.rows, dtype=bool)
    cached[stream.hottest[:capacity]] = True
    timed = stream.batches[stream.warmup:]
    return hit_rate(sum(int(cached[b].sum()) for b in timed), timed)


def next_uses(batches, rows):
    """For each batch, the index of the next batch using each of its rows
    (len(batches) where none does)."""
    after = np.full(rows, len(batches), dtype=np.int32)
    out = [None] * len(batches)
    for t in range(len(batches) - 1, -1, -1):
        out[t] = after[batches[t]]
        after[batches[t]] = t
    return out


def belady(stream, capacity):
    """Hit rate over the timed batches of Belady's rule with bypass."""
    batches, never = stream.batches, len(stream.batches)
    nxt = next_uses(batches, stream.rows)
    in_cache = np.zeros(stream.rows, dtype=bool)
    rows = np.empty(0, dtype=np.int64)
    keys = np.empty(0, dtype=np.int32)  # next use of each cached row
    hits = 0
    for t, b in enumerate(batches):
        hit = in_cache[b]
        if t >= stream.warmup:
            hits += int(hit.sum())
        # Candidates: the cached rows the batch did not use (their next
        # use unchanged) and the batch's rows (next use from here).
        stay = keys > t
        cand_rows = np.concatenate([rows[stay], b])
        cand_keys = np.concatenate([keys[stay], nxt[t]])
        live = cand_keys < never
        cand_rows, cand_keys = cand_rows[live], cand_keys[live]
        if cand_rows.size > capacity:
            keep = np.argpartition(cand_keys, capacity - 1)[:capacity]
            cand_rows, cand_keys = cand_rows[keep], cand_keys[keep]
        in_cache[rows] = False
        in_cache[cand_rows] = True
        rows, keys = cand_rows, cand_keys
    timed = batches[stream.warmup:]
    return hit_rate(hits, timed)


@dataclass(frozen=True)
class Policy:
    """A candidate policy for the simulator.
    victim: "sweep" (the CLOCK hand of he_cache_policy.h: each miss, in
      ascending row order, meets the next eligible slot) or "sorted" (the
      misses, most used first, meet the eligible slots, least used first:
      see _sorted).
    count_max: the saturating per-row count's ceiling (15: 4 bits).
    age_period: every that many batches each count halves (0: never).
    reference: CLOCK's second chance (sweep: a slot used since the hand
      last passed it is skipped once).
    before: the miss's count is compared without this batch's use (the
      occupant has none: it is not in the batch), so a row is not admitted
      over one used as often merely because it is the one used now.
    recency_ties: at equal counts up to this, the miss is admitted if its
      previous use is more recent than the occupant's last (needs a
      last-use stamp a row); above it ties keep the occupant.
    mru_victims: sorted: among equal counts above recency_ties, the most
      recently used slot is offered first (least recently used otherwise).
    margin: above recency_ties, the miss's count must exceed the
      occupant's by more than this.
    window: a fraction of the slots set apart as a FIFO ring that takes
      the misses the frequency rule turned away, ascending, displacing its
      oldest unprotected rows whatever their counts (one round of its own
      hand a batch); rows hit there stay there.
    gate: a window opened only while it pays (see _gate), for the misses
      turned away in the last gate_span batches, of at most this fraction
      of the slots."""
    name: str
    victim: str = "sweep"
    count_max: int = 15
    age_period: int = 10
    reference: bool = True
    rounds: int = 2
    before: bool = False
    recency_ties: int = 0
    mru_victims: bool = False
    margin: int = 0
    window: float = 0.0
    gate: float = 0.0
    gate_span: int = 2


CLOCK = Policy("clock (the planners' policy=\"clock\"): 4-bit, /2 every 10, sweep")
M16 = 2**16 - 1
_LFU = dict(count_max=M16, age_period=0)
_BEST = dict(victim="sorted", before=True, recency_ties=1, mru_victims=True, margin=1, **_LFU)
# The candidates the report replays (--candidates picks by index), in the
# order they were tried: each fixes what the one before it got wrong.
CANDIDATES = [
    CLOCK,
    Policy("16-bit, no aging, sweep", **_LFU),
    Policy("16-bit, no aging, sweep, no second chance", reference=False, **_LFU),
    Policy("16-bit, no aging, sweep, count before the batch", before=True, **_LFU),
    Policy("16-bit, no aging, sorted, count before", victim="sorted", before=True, **_LFU),
    Policy("16-bit, no aging, sweep, count before, recency ties at 1", before=True, recency_ties=1, **_LFU),
    Policy("16-bit, no aging, sorted, count before, recency ties at 1, MRU victims above",
           **{**_BEST, "margin": 0}),
    Policy("F = 16-bit, no aging, sorted, count before, recency ties at 1, MRU victims above, margin 1 above",
           **_BEST),
    Policy("F, counts halved every 128 batches", **{**_BEST, "age_period": 128}),
    Policy("F + fixed 10% FIFO window for turned-away misses", window=0.10, **_BEST),
    Policy("F + fixed 17% FIFO window for turned-away misses", window=0.17, **_BEST),
    Policy("F + gated window (last batch's turned away, <= 30% of slots)", gate=0.3, gate_span=1, **_BEST),
    Policy("F + gated window (last 2 batches' turned away, <= 30% of slots)", gate=0.3, gate_span=2, **_BEST),
    Policy("frequency (the planners' default): F + gated window (last 3 batches' turned away, <= 30% of "
           "slots)", gate=0.3, gate_span=3, **_BEST),
]
FREQUENCY = CANDIDATES[-1]
# The planners' policies (include/he_cache_policy.h), by CachePlanner's names.
SHIPPED = {"clock": CLOCK, "frequency": FREQUENCY}


class _Cache:
    """The simulator's state: a count a row, the row <-> slot maps, each
    slot's last use and second-chance bit, and the hands."""

    def __init__(self, rows, capacity, policy):
        self.count = np.zeros(rows, dtype=np.uint32)  # wide enough that count + 1 never wraps
        self.slot_of = np.full(rows, -1, dtype=np.int64)
        self.row_of = np.full(capacity, -1, dtype=np.int64)
        self.used_at = np.full(capacity, -1, dtype=np.int64)
        self.referenced = np.zeros(capacity, dtype=bool)
        self.last = np.full(rows, -1, dtype=np.int64)  # each row's last use (recency_ties)
        self.window = int(round(policy.window * capacity)) if capacity > 1 else 0
        self.turned_at = np.full(rows, -1 << 40, dtype=np.int64)  # when last turned away (gate)
        self.recent_turned = []  # how many were, in each of the last gate_span batches
        self.reuse_rate = self.main_rate = 0  # fixed point, 32 fraction bits
        self.window_opened = False
        self.hand = self.window  # main slots: [window, capacity)
        self.window_hand = 0

    def place(self, rows, slots, batch):
        occupant = self.row_of[slots]
        self.slot_of[occupant[occupant >= 0]] = -1
        self.slot_of[rows] = slots
        self.row_of[slots] = rows
        self.used_at[slots] = batch
        self.referenced[slots] = True

    def admits(self, policy, rows, slots):
        """Whether each miss takes the slot it met: an empty one, or one
        whose row was used less (policy's rule)."""
        occupant = self.row_of[slots]
        mine = self.count[rows].astype(np.int64) - policy.before
        theirs = self.count[np.maximum(occupant, 0)].astype(np.int64)
        # The margin only above the counts whose ties go by recency.
        margin = np.where(theirs > policy.recency_ties, policy.margin, 0)
        admit = (occupant < 0) | (mine > theirs + margin)
        if policy.recency_ties:
            # Equal counts: (count, last use) compared as one key, the
            # miss's without this batch: a strict order, so two rows never
            # swap back and forth.
            newer = self.last[rows] > self.used_at[slots]
            admit |= (mine == theirs) & (theirs <= policy.recency_ties) & newer
        return admit


def simulate(stream, capacity, policy, protect=1, report=None):
    """Hit rate over the timed batches of `policy` with a cache of
    `capacity` slots; protect as the planner's (1, or 2 when planned a
    step ahead). report: a dict to fill with whether a window opened and
    its size after each batch ("windows")."""
    c = _Cache(stream.rows, capacity, policy)
    hits, windows = 0, []
    for batch, b in enumerate(stream.batches, start=1):
        if policy.age_period and batch % policy.age_period == 0:
            c.count >>= 1
        # Every row the batch uses counts one more use; hits are stamped
        # (protected) before any miss looks for a slot.
        c.count[b] = np.minimum(c.count[b] + 1, policy.count_max)
        s = c.slot_of[b]
        hit = s >= 0
        c.used_at[s[hit]] = batch
        c.referenced[s[hit]] = True
        if batch > stream.warmup:
            hits += int(hit.sum())
        misses = b[~hit]
        if policy.victim == "sweep":
            turned = _sweep(c, policy, misses, batch, protect)
        else:
            turned = _sorted(c, policy, misses, batch, protect)
        if policy.gate:
            _gate(c, policy, b, turned, batch)
        if c.window and turned.size:
            _window(c, turned, batch, protect)
        c.last[b] = batch
        windows.append(c.window)
    if report is not None:
        report["window_opened"] = c.window_opened
        report["windows"] = windows
    return hit_rate(hits, stream.batches[stream.warmup:])


def _sweep(c, policy, misses, batch, protect):
    """One batch's misses, ascending, against the hand over the main
    slots: a round at a time, since a slot is met once a round and so its
    eligibility does not depend on the round's decisions (the GPU
    planner's argument). Returns the misses turned away."""
    first, size = c.window, c.row_of.size - c.window
    visits, turned = policy.rounds * size, []
    while misses.size and visits > 0:
        length = min(visits, size)
        pos = first + (c.hand - first + np.arange(length)) % size
        occupied = c.row_of[pos] >= 0
        unprotected = c.used_at[pos] <= batch - protect
        ref = c.referenced[pos] if policy.reference else np.zeros(length, dtype=bool)
        eligible = ~occupied | (unprotected & ~ref)
        met = np.nonzero(eligible)[0]
        k = min(misses.size, met.size)
        stop = met[k - 1] + 1 if k == misses.size else length  # slots the hand passes
        lose = occupied[:stop] & unprotected[:stop] & ref[:stop]
        c.referenced[pos[:stop][lose]] = False
        slots, rows = pos[met[:k]], misses[:k]
        admit = c.admits(policy, rows, slots)
        c.place(rows[admit], slots[admit], batch)
        turned.append(rows[~admit])
        misses = misses[k:]
        visits -= stop
        c.hand = first + (c.hand - first + stop) % size
    turned.append(misses)
    return np.sort(np.concatenate(turned))


# include/he_cache_policy.h's sort keys: ages saturate at 2^20 - 1 batches,
# the slot or the miss's place in its batch in the low 28 bits.
AGE_BITS, INDEX_BITS = 20, 28
AGE_MAX = (1 << AGE_BITS) - 1


def _key(count, recency, index):
    return (count.astype(np.uint64) << np.uint64(AGE_BITS + INDEX_BITS)) | \
        (recency.astype(np.uint64) << np.uint64(INDEX_BITS)) | index.astype(np.uint64)


def _sorted(c, policy, misses, batch, protect):
    """The misses, most used first (then, with recency_ties, most recently
    used before; then lower row), paired with the eligible (empty or
    unprotected) main slots: empty first, then least used, then by last
    use (see Policy.mru_victims), then lower slot; the i-th miss takes the
    i-th slot if admits() says so. Both orders are total, as the keys of
    include/he_cache_policy.h (he_cache_miss_key, he_cache_victim_key)
    make them, so the planners' sorts and this one pair alike. Returns the
    misses turned away, ascending."""
    eligible = c.window + np.nonzero((c.row_of[c.window:] < 0) | (c.used_at[c.window:] <= batch - protect))[0]
    k = min(misses.size, eligible.size)
    if k == 0:
        return misses
    occ = c.row_of[eligible]
    vcount = np.where(occ < 0, 0, c.count[np.maximum(occ, 0)]).astype(np.int64)
    age = np.minimum(batch - c.used_at[eligible], AGE_MAX)
    if policy.mru_victims:
        recency = np.where(vcount > policy.recency_ties, age, AGE_MAX - age)
    else:
        recency = AGE_MAX - age
    vkey = _key(vcount, np.where(occ < 0, 0, recency), eligible)
    part = np.argpartition(vkey, k - 1)[:k] if k < eligible.size else np.arange(eligible.size)
    victims = eligible[part[np.argsort(vkey[part])]]
    mcount = np.minimum(c.count[misses].astype(np.int64), policy.count_max)
    mage = np.minimum(batch - np.maximum(c.last[misses], 0), AGE_MAX) if policy.recency_ties else 0 * mcount
    mkey = _key(policy.count_max - mcount, mage, np.arange(misses.size))
    order = np.argsort(mkey)
    rows = misses[order[:k]]
    admit = c.admits(policy, rows, victims)
    c.place(rows[admit], victims[admit], batch)
    return np.sort(np.concatenate([rows[~admit], misses[order[k:]]]))


def _gate(c, policy, rows, turned, batch):
    """Sizes the window by the marginal value of a slot. A window of the
    misses turned away in the last gate_span batches would have been hit,
    per slot and batch, by the batch's rows turned away that recently (a
    stamp a row says which) over those turned away; a main slot given up
    loses the least used main row's uses per batch (its count / batches).
    Both as moving averages (4/5 of the last and 1/5 of the new, in fixed
    point with 32 fraction bits, as he_cache_gate_update computes them),
    whether the window is open or not; while the first is higher the window
    holds those rows (at most gate of the slots), otherwise it shuts (its
    slots back to the main rule, their rows kept). On a replayed stream,
    whose rows come back a period later, it stays shut."""
    C, span = c.row_of.size, int(policy.gate_span)
    recent = sum(c.recent_turned)
    if recent:
        back = int((c.turned_at[rows] >= batch - span).sum())
        main = c.row_of[c.window:]
        main = main[main >= 0]
        least = int(c.count[main].min()) if main.size else 0
        c.reuse_rate = (4 * c.reuse_rate + (back << 32) // recent) // 5
        c.main_rate = (4 * c.main_rate + (least << 32) // batch) // 5
    c.turned_at[turned] = batch
    c.recent_turned = (c.recent_turned + [turned.size])[-span:]
    most = C * int(round(policy.gate * 100)) // 100
    want = min(most, sum(c.recent_turned)) if c.reuse_rate > c.main_rate else 0
    c.window = want
    c.window_hand = c.window_hand % want if want else 0
    c.window_opened = c.window_opened or want > 0


def _window(c, rows, batch, protect):
    """The turned-away misses, ascending, into the window ring: each takes
    the next unprotected window slot, one round of its hand a batch."""
    pos = (c.window_hand + np.arange(c.window)) % c.window
    met = np.nonzero(c.used_at[pos] <= batch - protect)[0]
    k = min(rows.size, met.size)
    if k == 0:
        return
    c.place(rows[:k], pos[met[:k]], batch)
    c.window_hand = int((pos[met[k - 1]] + 1) % c.window)
