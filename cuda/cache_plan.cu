/* The row cache's planner on the GPU: csrc/cache_plan.c's decisions (its
 * host twin: the same state, the same policies, include/he_cache_policy.h)
 * made by kernels on the stream, so that planning never waits for the CPU.
 *
 * The clock policy: a round of the hand at once instead of one miss after
 * another. Within a round each slot is met once, and whether the hand
 * settles on it depends only on the state before the round; so one pass
 * marks the eligible slots, a prefix sum ranks them, and the i-th
 * remaining miss (ascending rows) meets the i-th eligible slot: the pairs
 * the CPU's hand would make. The hand stops after the slot the last miss
 * met; the slots it passed before that lose their second chance; a second
 * round, as the CPU's hand going round again, meets the misses left.
 * Every write of a round touches a place no other thread of it reads or
 * writes (distinct slots, distinct miss rows, evicted rows that are not in
 * the batch), so no atomics decide anything; the counts use them.
 *
 * The frequency policy: see its part below. */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "he_cache_policy.h"
#include "he_cuda_cache.cuh"
#include "he_cuda_common.cuh"

/* ---- the clock policy: a round of the hand at once */

struct clock_layout {
    size_t flags, ranks, temp, temp_bytes, total;
};

static he_status clock_layout_of(int64_t n, int64_t capacity, clock_layout *l)
{
    int64_t most = n > capacity ? n : capacity;
    size_t scan_bytes = 0;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(NULL, scan_bytes, (const int32_t *)NULL, (int32_t *)NULL, (int)most));
    size_t at = 0;
    l->flags = at;
    at += he_cuda_align256((size_t)most * sizeof(int32_t));
    l->ranks = at;
    at += he_cuda_align256((size_t)most * sizeof(int32_t));
    l->temp = at;
    l->temp_bytes = scan_bytes;
    at += he_cuda_align256(scan_bytes);
    l->total = at;
    return HE_OK;
}

/* Warp-aggregated count: one atomic per group of converged lanes. */
static __device__ __forceinline__ void count_add(int64_t *counter, unsigned value)
{
    unsigned mask = __activemask();
    unsigned sum = __reduce_add_sync(mask, value);
    if ((threadIdx.x & (HE_CUDA_WARP - 1)) == (unsigned)(__ffs(mask) - 1) && sum)
        atomicAdd((unsigned long long *)counter, (unsigned long long)sum);
}

__global__ void age_entries(uint32_t *__restrict__ entry, int64_t num_rows)
{
    for (int64_t r = he_thread_index(); r < num_rows; r += he_thread_count())
        entry[r] = he_cache_entry_aged(entry[r]);
}

/* Each row's use counted, its slot looked up, a hit's slot stamped in use;
 * flags[k] marks a miss. Rows are distinct, so are entries and slots. */
__global__ void touch_rows(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch,
                           he_cuda_cache_batch plan, int32_t *__restrict__ flags)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count()) {
        int64_t row = unique[k];
        uint32_t e = he_cache_entry_used(c.entry[row]);
        c.entry[row] = e;
        uint32_t s1 = he_cache_entry_slot1(e);
        plan.slot[k] = (int32_t)s1 - 1;
        plan.evict_row[k] = -1;
        flags[k] = s1 == 0;
        if (s1) {
            c.used_at[s1 - 1] = batch;
            c.referenced[s1 - 1] = 1;
        }
    }
}

__global__ void list_misses(const int32_t *__restrict__ flags, const int32_t *__restrict__ ranks, int64_t n,
                            int64_t *__restrict__ miss, int64_t *__restrict__ counters)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count()) {
        if (flags[k])
            miss[ranks[k]] = k;
        if (k == n - 1) {
            counters[HE_CUDA_CACHE_MISSES] = ranks[k] + flags[k];
            counters[HE_CUDA_CACHE_BASE] = 0;
        }
    }
}

static __device__ __forceinline__ int64_t slot_at(const he_cuda_cache &c, int64_t q)
{
    int64_t s = c.counters[HE_CUDA_CACHE_HAND] + q;
    return s >= c.capacity ? s - c.capacity : s;
}

static __device__ __forceinline__ int64_t misses_left(const int64_t *counters)
{
    return counters[HE_CUDA_CACHE_MISSES] - counters[HE_CUDA_CACHE_BASE];
}

/* flags[q]: whether the hand settles on the q-th slot from it. */
__global__ void round_eligible(he_cuda_cache c, int64_t batch, int32_t *__restrict__ flags)
{
    /* With no miss left the round's later kernels return at once; the
     * flags are zeroed anyway, so that the scan reads written memory. */
    int any = misses_left(c.counters) > 0;
    for (int64_t q = he_thread_index(); q < c.capacity; q += he_thread_count()) {
        int64_t s = slot_at(c, q);
        flags[q] = any && he_cache_eligible(c.row_of[s], c.used_at[s], c.referenced[s], batch, c.protect);
    }
}

/* The i-th remaining miss meets the eligible slot of rank i. */
__global__ void round_assign(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t batch,
                             const int32_t *__restrict__ flags, const int32_t *__restrict__ ranks,
                             he_cuda_cache_batch plan)
{
    int64_t base = c.counters[HE_CUDA_CACHE_BASE], left = misses_left(c.counters);
    if (left <= 0)
        return;
    for (int64_t q = he_thread_index(); q < c.capacity; q += he_thread_count()) {
        unsigned took = 0, evicted = 0;
        if (flags[q] && ranks[q] < left) {
            int64_t rank = ranks[q], j = base + rank, k = plan.miss[j], row = unique[k], s = slot_at(c, q);
            if (rank == left - 1)
                c.counters[HE_CUDA_CACHE_STOP] = q;
            int64_t occupant = c.row_of[s];
            uint32_t me = c.entry[row], oe = occupant >= 0 ? c.entry[occupant] : 0;
            if (he_cache_admits(me, occupant, oe)) {
                if (occupant >= 0) {
                    c.entry[occupant] = he_cache_entry_uncached(oe);
                    plan.evict_row[j] = occupant;
                    evicted = 1;
                }
                c.entry[row] = he_cache_entry_with_slot(me, s);
                c.row_of[s] = row;
                c.used_at[s] = batch;
                c.referenced[s] = 1;
                plan.slot[k] = (int32_t)s;
                took = 1;
            }
        }
        count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
    }
}

static __device__ __forceinline__ int64_t round_eligible_count(const he_cuda_cache &c, const int32_t *flags,
                                                               const int32_t *ranks)
{
    return (int64_t)ranks[c.capacity - 1] + flags[c.capacity - 1];
}

/* The slots the hand passed without settling lose their second chance. */
__global__ void round_clear(he_cuda_cache c, int64_t batch, const int32_t *__restrict__ flags,
                            const int32_t *__restrict__ ranks)
{
    int64_t left = misses_left(c.counters);
    if (left <= 0)
        return;
    int64_t stop = left <= round_eligible_count(c, flags, ranks) ? c.counters[HE_CUDA_CACHE_STOP] : c.capacity - 1;
    for (int64_t q = he_thread_index(); q <= stop; q += he_thread_count()) {
        if (flags[q])
            continue;
        int64_t s = slot_at(c, q);
        if (he_cache_loses_reference(c.row_of[s], c.used_at[s], c.referenced[s], batch, c.protect))
            c.referenced[s] = 0;
    }
}

/* One thread: the hand moves past the last slot met, or goes round. */
__global__ void round_end(he_cuda_cache c, const int32_t *__restrict__ flags, const int32_t *__restrict__ ranks)
{
    int64_t left = misses_left(c.counters);
    if (left <= 0)
        return;
    int64_t eligible = round_eligible_count(c, flags, ranks);
    if (left <= eligible) {
        int64_t hand = c.counters[HE_CUDA_CACHE_HAND] + c.counters[HE_CUDA_CACHE_STOP] + 1;
        c.counters[HE_CUDA_CACHE_HAND] = hand % c.capacity;
        c.counters[HE_CUDA_CACHE_BASE] = c.counters[HE_CUDA_CACHE_MISSES];
    } else {
        c.counters[HE_CUDA_CACHE_BASE] += eligible;
    }
}

__global__ void plan_done(int64_t *counters, int64_t n)
{
    if (n == 0) /* no list_misses ran: the last batch's would stay */
        counters[HE_CUDA_CACHE_MISSES] = counters[HE_CUDA_CACHE_BASE] = 0;
    counters[HE_CUDA_CACHE_BATCHES] += 1;
    counters[HE_CUDA_CACHE_ROWS] += n;
    counters[HE_CUDA_CACHE_HITS] += n - (n ? counters[HE_CUDA_CACHE_MISSES] : 0);
}

static he_status plan_clock(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                            const he_cuda_cache_batch *plan, void *workspace, const clock_layout &l,
                            cudaStream_t stream)
{
    char *ws = (char *)workspace;
    int32_t *flags = (int32_t *)(ws + l.flags), *ranks = (int32_t *)(ws + l.ranks);
    const unsigned threads = HE_CUDA_THREADS;
    if (he_cache_ages(batch)) {
        age_entries<<<he_cuda_blocks(c->num_rows, threads), threads, 0, stream>>>(c->entry, c->num_rows);
        HE_CUDA_LAUNCHED(age_entries);
    }
    if (n > 0) {
        touch_rows<<<he_cuda_blocks(n, threads), threads, 0, stream>>>(*c, unique, n, batch, *plan, flags);
        HE_CUDA_LAUNCHED(touch_rows);
        size_t temp_bytes = l.temp_bytes;
        HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, flags, ranks, (int)n, stream));
        list_misses<<<he_cuda_blocks(n, threads), threads, 0, stream>>>(flags, ranks, n, plan->miss, c->counters);
        HE_CUDA_LAUNCHED(list_misses);
        unsigned slots = he_cuda_blocks(c->capacity, threads);
        for (int round = 0; round < HE_CACHE_ROUNDS; round++) {
            round_eligible<<<slots, threads, 0, stream>>>(*c, batch, flags);
            HE_CUDA_LAUNCHED(round_eligible);
            temp_bytes = l.temp_bytes;
            HE_CUDA_TRY(
                cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, flags, ranks, (int)c->capacity, stream));
            round_assign<<<slots, threads, 0, stream>>>(*c, unique, batch, flags, ranks, *plan);
            HE_CUDA_LAUNCHED(round_assign);
            round_clear<<<slots, threads, 0, stream>>>(*c, batch, flags, ranks);
            HE_CUDA_LAUNCHED(round_clear);
            round_end<<<1, 1, 0, stream>>>(*c, flags, ranks);
            HE_CUDA_LAUNCHED(round_end);
        }
    }
    return HE_OK;
}


/* ---- the frequency policy: sorts instead of a hand
 *
 * The CPU planner pairs misses and slots by keys whose order is total
 * (he_cache_miss_key, he_cache_victim_key), so a radix sort of each side
 * here gives its pairs, and each pair's decision reads only state no other
 * pair writes (distinct slots, distinct miss rows, evicted rows not in the
 * batch). The window's ring is ranked as a round of the clock's hand is:
 * a prefix sum over its free slots from the hand, the i-th row turned
 * away meeting the i-th. Sizes the host does not know (misses, eligible
 * slots, the window) stay in counters: kernels read them, nothing waits. */

struct frequency_layout {
    size_t flags, ranks, turned, turned_ranks, turned_list, miss_keys, miss_sorted, keys, sorted, ring, ring_ranks,
        temp, temp_bytes, total;
};

static he_status frequency_layout_of(int64_t n, int64_t capacity, frequency_layout *l)
{
    int64_t most = n > capacity ? n : capacity;
    size_t scan_bytes = 0, sort_n = 0, sort_c = 0;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(NULL, scan_bytes, (const int32_t *)NULL, (int32_t *)NULL, (int)most));
    HE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(NULL, sort_n, (const uint64_t *)NULL, (uint64_t *)NULL,
                                               (int)(n > 0 ? n : 1)));
    HE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(NULL, sort_c, (const uint64_t *)NULL, (uint64_t *)NULL, (int)capacity));
    size_t temp = scan_bytes > sort_n ? scan_bytes : sort_n;
    temp = temp > sort_c ? temp : sort_c;
    size_t rows = (size_t)(n > 0 ? n : 1), at = 0;
    size_t *fields[] = {&l->flags, &l->ranks, &l->turned, &l->turned_ranks};
    for (size_t *f : fields) {
        *f = at;
        at += he_cuda_align256(rows * sizeof(int32_t));
    }
    l->turned_list = at;
    at += he_cuda_align256(rows * sizeof(int64_t));
    l->miss_keys = at;
    at += he_cuda_align256(rows * sizeof(uint64_t));
    l->miss_sorted = at;
    at += he_cuda_align256(rows * sizeof(uint64_t));
    l->keys = at;
    at += he_cuda_align256((size_t)capacity * sizeof(uint64_t));
    l->sorted = at;
    at += he_cuda_align256((size_t)capacity * sizeof(uint64_t));
    l->ring = at;
    at += he_cuda_align256((size_t)capacity * sizeof(int32_t));
    l->ring_ranks = at;
    at += he_cuda_align256((size_t)capacity * sizeof(int32_t));
    l->temp = at;
    l->temp_bytes = temp;
    at += he_cuda_align256(temp);
    l->total = at;
    return HE_OK;
}

/* One thread: a batch's counts cleared before its kernels add to them. */
__global__ void frequency_begin(int64_t *counters)
{
    counters[HE_CUDA_CACHE_ELIGIBLE] = 0;
    counters[HE_CUDA_CACHE_BACK] = 0;
    counters[HE_CUDA_CACHE_TURNED] = 0;
    counters[HE_CUDA_CACHE_LEAST] = HE_CACHE_COUNT_MAX + 1;
    counters[HE_CUDA_CACHE_TAKEN] = -1;
}

/* One more use of each row, its slot looked up, a hit's slot stamped in
 * use (and its count); flags[k] marks a miss. */
__global__ void frequency_touch(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch,
                                he_cuda_cache_batch plan, int32_t *__restrict__ flags)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count()) {
        int64_t row = unique[k];
        uint32_t uses = c.count[row];
        if (uses < HE_CACHE_COUNT_MAX)
            c.count[row] = (uint16_t)++uses;
        uint32_t s1 = he_cache_entry_slot1(c.entry[row]);
        plan.slot[k] = (int32_t)s1 - 1;
        plan.evict_row[k] = -1;
        flags[k] = s1 == 0;
        if (s1) {
            c.used_at[s1 - 1] = batch;
            c.slot_count[s1 - 1] = (uint16_t)uses;
        }
    }
}

/* Each miss's key at its rank among the misses; the rest of the n keys
 * sort last. */
__global__ void frequency_miss_keys(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch,
                                    const int32_t *__restrict__ flags, const int32_t *__restrict__ ranks,
                                    uint64_t *__restrict__ keys)
{
    int64_t misses = c.counters[HE_CUDA_CACHE_MISSES];
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count()) {
        if (flags[k]) {
            int64_t row = unique[k];
            keys[ranks[k]] = he_cache_miss_key(c.count[row], c.last[row], batch, k);
        }
        if (k >= misses)
            keys[k] = UINT64_MAX;
    }
}

/* Each eligible main slot's key; the others (the window's, those in use)
 * sort last. */
__global__ void frequency_victim_keys(he_cuda_cache c, int64_t batch, uint64_t *__restrict__ keys)
{
    int64_t window = c.counters[HE_CUDA_CACHE_WINDOW];
    for (int64_t s = he_thread_index(); s < c.capacity; s += he_thread_count()) {
        uint64_t key = UINT64_MAX;
        int64_t row = c.row_of[s];
        int eligible = s >= window && (row < 0 || !he_cache_protected(c.used_at[s], batch, c.protect));
        if (eligible)
            key = he_cache_victim_key(row >= 0 ? c.slot_count[s] : 0, c.used_at[s], batch, s);
        keys[s] = key;
        count_add(&c.counters[HE_CUDA_CACHE_ELIGIBLE], (unsigned)eligible);
    }
}

/* unique[k] takes slot s, its record written back first (the j-th miss's
 * eviction, j = ranks[k]). */
static __device__ __forceinline__ unsigned frequency_place(he_cuda_cache &c, he_cuda_cache_batch &plan,
                                                           const int32_t *ranks, int64_t k, int64_t row, int64_t s,
                                                           int64_t batch)
{
    int64_t occupant = c.row_of[s];
    if (occupant >= 0) {
        c.entry[occupant] = he_cache_entry_uncached(c.entry[occupant]);
        plan.evict_row[ranks[k]] = occupant;
    }
    c.entry[row] = he_cache_entry_with_slot(c.entry[row], s);
    c.row_of[s] = row;
    c.used_at[s] = batch;
    c.slot_count[s] = c.count[row];
    plan.slot[k] = (int32_t)s;
    return occupant >= 0;
}

/* The i-th miss, most valuable first, meets the i-th eligible slot, least
 * valuable first. */
__global__ void frequency_pairs(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch,
                                const uint64_t *__restrict__ misses, const uint64_t *__restrict__ victims,
                                const int32_t *__restrict__ ranks, he_cuda_cache_batch plan)
{
    int64_t pairs = c.counters[HE_CUDA_CACHE_MISSES], eligible = c.counters[HE_CUDA_CACHE_ELIGIBLE];
    pairs = pairs < eligible ? pairs : eligible;
    for (int64_t i = he_thread_index(); i < n; i += he_thread_count()) {
        unsigned took = 0, evicted = 0;
        if (i < pairs) {
            int64_t k = he_cache_key_index(misses[i]), s = he_cache_key_index(victims[i]), row = unique[k];
            int64_t occupant = c.row_of[s];
            if (he_cache_takes(c.count[row], c.last[row], occupant, occupant >= 0 ? c.slot_count[s] : 0,
                               c.used_at[s])) {
                evicted = frequency_place(c, plan, ranks, k, row, s, batch);
                took = 1;
            }
        }
        count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
    }
}

/* The gate's counts over the batch: its rows turned away lately (before
 * this batch's are stamped) and now; turned[k] marks those. */
__global__ void frequency_gate_rows(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch,
                                    he_cuda_cache_batch plan, int32_t *__restrict__ turned)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count()) {
        int64_t row = unique[k];
        unsigned back = he_cache_turned_lately(c.turned_at[row], batch), now = plan.slot[k] < 0;
        if (now)
            c.turned_at[row] = (uint32_t)batch;
        turned[k] = (int32_t)now;
        count_add(&c.counters[HE_CUDA_CACHE_BACK], back);
        count_add(&c.counters[HE_CUDA_CACHE_TURNED], now);
    }
}

/* The least used main row's uses: a min a warp, an atomic a warp. */
__global__ void frequency_gate_slots(he_cuda_cache c)
{
    int64_t window = c.counters[HE_CUDA_CACHE_WINDOW];
    unsigned least = HE_CACHE_COUNT_MAX + 1;
    for (int64_t s = window + he_thread_index(); s < c.capacity; s += he_thread_count())
        if (c.row_of[s] >= 0 && c.slot_count[s] < least)
            least = c.slot_count[s];
    least = __reduce_min_sync(0xffffffffu, least);
    if ((threadIdx.x & (HE_CUDA_WARP - 1)) == 0 && least <= HE_CACHE_COUNT_MAX)
        atomicMin((unsigned long long *)&c.counters[HE_CUDA_CACHE_LEAST], (unsigned long long)least);
}

/* One thread: the window's size for the next batch, as the CPU's
 * he_cache_gate_update gives it. */
__global__ void frequency_gate_end(he_cuda_cache c, int64_t batch)
{
    int64_t *counters = c.counters;
    he_cache_gate g;
    g.reuse = (uint64_t)counters[HE_CUDA_CACHE_REUSE];
    g.main = (uint64_t)counters[HE_CUDA_CACHE_MAIN];
    for (int i = 0; i < HE_CACHE_GATE_SPAN; i++)
        g.recent[i] = counters[HE_CUDA_CACHE_RECENT + i];
    int64_t least = counters[HE_CUDA_CACHE_LEAST];
    int64_t window = he_cache_gate_update(&g, counters[HE_CUDA_CACHE_BACK], counters[HE_CUDA_CACHE_TURNED],
                                          least > HE_CACHE_COUNT_MAX ? 0u : (uint32_t)least, batch, c.capacity);
    counters[HE_CUDA_CACHE_REUSE] = (int64_t)g.reuse;
    counters[HE_CUDA_CACHE_MAIN] = (int64_t)g.main;
    for (int i = 0; i < HE_CACHE_GATE_SPAN; i++)
        counters[HE_CUDA_CACHE_RECENT + i] = g.recent[i];
    counters[HE_CUDA_CACHE_WINDOW] = window;
    counters[HE_CUDA_CACHE_WINDOW_HAND] = window ? counters[HE_CUDA_CACHE_WINDOW_HAND] % window : 0;
}

__global__ void frequency_turned_list(const int32_t *__restrict__ turned, const int32_t *__restrict__ ranks, int64_t n,
                                      int64_t *__restrict__ list)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count())
        if (turned[k])
            list[ranks[k]] = k;
}

static __device__ __forceinline__ int64_t ring_slot(const he_cuda_cache &c, int64_t q)
{
    int64_t window = c.counters[HE_CUDA_CACHE_WINDOW], s = c.counters[HE_CUDA_CACHE_WINDOW_HAND] + q;
    return s >= window ? s - window : s;
}

/* ring[q]: whether the q-th window slot from its hand is free (not in use
 * by this batch or, planned ahead, the last). */
__global__ void frequency_ring_flags(he_cuda_cache c, int64_t batch, int32_t *__restrict__ ring)
{
    int64_t window = c.counters[HE_CUDA_CACHE_WINDOW];
    int any = c.counters[HE_CUDA_CACHE_TURNED] > 0;
    for (int64_t q = he_thread_index(); q < c.capacity; q += he_thread_count())
        ring[q] = any && q < window && !he_cache_protected(c.used_at[ring_slot(c, q)], batch, c.protect);
}

/* The i-th row turned away (ascending) takes the i-th free window slot. */
__global__ void frequency_ring_assign(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t batch,
                                      const int32_t *__restrict__ ring, const int32_t *__restrict__ ring_ranks,
                                      const int64_t *__restrict__ list, const int32_t *__restrict__ ranks,
                                      he_cuda_cache_batch plan)
{
    int64_t window = c.counters[HE_CUDA_CACHE_WINDOW], turned = c.counters[HE_CUDA_CACHE_TURNED];
    int64_t free_slots = window > 0 ? (int64_t)ring_ranks[window - 1] + ring[window - 1] : 0;
    int64_t taking = turned < free_slots ? turned : free_slots;
    for (int64_t q = he_thread_index(); q < c.capacity; q += he_thread_count()) {
        unsigned took = 0, evicted = 0;
        if (q < window && ring[q] && ring_ranks[q] < taking) {
            int64_t t = ring_ranks[q], k = list[t], s = ring_slot(c, q);
            evicted = frequency_place(c, plan, ranks, k, unique[k], s, batch);
            took = 1;
            if (t == taking - 1)
                c.counters[HE_CUDA_CACHE_TAKEN] = s;
        }
        count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
    }
}

/* One thread: the window's hand after the last slot taken. */
__global__ void frequency_ring_end(int64_t *counters)
{
    int64_t taken = counters[HE_CUDA_CACHE_TAKEN], window = counters[HE_CUDA_CACHE_WINDOW];
    if (taken >= 0)
        counters[HE_CUDA_CACHE_WINDOW_HAND] = taken + 1 == window ? 0 : taken + 1;
}

__global__ void frequency_last_use(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count())
        c.last[unique[k]] = (uint32_t)batch;
}

static he_status plan_frequency(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                                const he_cuda_cache_batch *plan, void *workspace, const frequency_layout &l,
                                cudaStream_t stream)
{
    char *ws = (char *)workspace;
    int32_t *flags = (int32_t *)(ws + l.flags), *ranks = (int32_t *)(ws + l.ranks);
    int32_t *turned = (int32_t *)(ws + l.turned), *turned_ranks = (int32_t *)(ws + l.turned_ranks);
    int32_t *ring = (int32_t *)(ws + l.ring), *ring_ranks = (int32_t *)(ws + l.ring_ranks);
    int64_t *turned_list = (int64_t *)(ws + l.turned_list);
    uint64_t *miss_keys = (uint64_t *)(ws + l.miss_keys), *miss_sorted = (uint64_t *)(ws + l.miss_sorted);
    uint64_t *keys = (uint64_t *)(ws + l.keys), *sorted = (uint64_t *)(ws + l.sorted);
    const unsigned threads = HE_CUDA_THREADS;
    unsigned rows = he_cuda_blocks(n, threads), slots = he_cuda_blocks(c->capacity, threads);
    frequency_begin<<<1, 1, 0, stream>>>(c->counters);
    HE_CUDA_LAUNCHED(frequency_begin);
    if (n == 0) { /* the gate still counts the batch, as the CPU's does */
        frequency_gate_slots<<<slots, threads, 0, stream>>>(*c);
        HE_CUDA_LAUNCHED(frequency_gate_slots);
        frequency_gate_end<<<1, 1, 0, stream>>>(*c, batch);
        HE_CUDA_LAUNCHED(frequency_gate_end);
        return HE_OK;
    }
    frequency_touch<<<rows, threads, 0, stream>>>(*c, unique, n, batch, *plan, flags);
    HE_CUDA_LAUNCHED(frequency_touch);
    size_t temp_bytes = l.temp_bytes;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, flags, ranks, (int)n, stream));
    list_misses<<<rows, threads, 0, stream>>>(flags, ranks, n, plan->miss, c->counters);
    HE_CUDA_LAUNCHED(list_misses);
    frequency_miss_keys<<<rows, threads, 0, stream>>>(*c, unique, n, batch, flags, ranks, miss_keys);
    HE_CUDA_LAUNCHED(frequency_miss_keys);
    frequency_victim_keys<<<slots, threads, 0, stream>>>(*c, batch, keys);
    HE_CUDA_LAUNCHED(frequency_victim_keys);
    temp_bytes = l.temp_bytes;
    HE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(ws + l.temp, temp_bytes, miss_keys, miss_sorted, (int)n, 0, 64, stream));
    temp_bytes = l.temp_bytes;
    HE_CUDA_TRY(
        cub::DeviceRadixSort::SortKeys(ws + l.temp, temp_bytes, keys, sorted, (int)c->capacity, 0, 64, stream));
    frequency_pairs<<<rows, threads, 0, stream>>>(*c, unique, n, batch, miss_sorted, sorted, ranks, *plan);
    HE_CUDA_LAUNCHED(frequency_pairs);
    frequency_gate_rows<<<rows, threads, 0, stream>>>(*c, unique, n, batch, *plan, turned);
    HE_CUDA_LAUNCHED(frequency_gate_rows);
    frequency_gate_slots<<<slots, threads, 0, stream>>>(*c);
    HE_CUDA_LAUNCHED(frequency_gate_slots);
    frequency_gate_end<<<1, 1, 0, stream>>>(*c, batch);
    HE_CUDA_LAUNCHED(frequency_gate_end);
    temp_bytes = l.temp_bytes;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, turned, turned_ranks, (int)n, stream));
    frequency_turned_list<<<rows, threads, 0, stream>>>(turned, turned_ranks, n, turned_list);
    HE_CUDA_LAUNCHED(frequency_turned_list);
    frequency_ring_flags<<<slots, threads, 0, stream>>>(*c, batch, ring);
    HE_CUDA_LAUNCHED(frequency_ring_flags);
    temp_bytes = l.temp_bytes;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, ring, ring_ranks, (int)c->capacity, stream));
    frequency_ring_assign<<<slots, threads, 0, stream>>>(*c, unique, batch, ring, ring_ranks, turned_list, ranks,
                                                         *plan);
    HE_CUDA_LAUNCHED(frequency_ring_assign);
    frequency_ring_end<<<1, 1, 0, stream>>>(c->counters);
    HE_CUDA_LAUNCHED(frequency_ring_end);
    frequency_last_use<<<rows, threads, 0, stream>>>(*c, unique, n, batch);
    HE_CUDA_LAUNCHED(frequency_last_use);
    return HE_OK;
}

extern "C" he_status he_cuda_cache_plan_workspace(int64_t n, int64_t capacity, int policy, int device, size_t *bytes)
{
    if (n < 0 || n > INT32_MAX || capacity < 1 || capacity >= (int64_t)HE_CACHE_SLOT_MASK ||
        (policy != HE_CACHE_CLOCK && policy != HE_CACHE_FREQUENCY) ||
        (policy == HE_CACHE_FREQUENCY && n > (int64_t)HE_CACHE_KEY_INDEX_MASK))
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache plan needs 0 <= n < 2^31 (2^28 with the frequency policy), 1 <= capacity < %lld "
                       "and policy %d or %d, got %lld, %lld and %d",
                       (long long)HE_CACHE_SLOT_MASK, HE_CACHE_CLOCK, HE_CACHE_FREQUENCY, (long long)n,
                       (long long)capacity, policy);
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;
    if (policy == HE_CACHE_FREQUENCY) {
        frequency_layout l = {};
        st = frequency_layout_of(n, capacity, &l);
        if (st == HE_OK)
            *bytes = l.total;
        return st;
    }
    clock_layout l = {};
    st = clock_layout_of(n, capacity, &l);
    if (st == HE_OK)
        *bytes = l.total;
    return st;
}

extern "C" he_status he_cuda_cache_plan(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                                        const he_cuda_cache_batch *plan, void *workspace, size_t workspace_bytes,
                                        int device, void *stream_handle)
{
    he_status st = he_cuda_check_cache(c);
    if (st != HE_OK)
        return st;
    if (n < 0 || n > INT32_MAX || batch < 1 ||
        (c->policy == HE_CACHE_FREQUENCY && (n > (int64_t)HE_CACHE_KEY_INDEX_MASK || batch > (int64_t)UINT32_MAX)))
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache plan needs 0 <= n < 2^31 and batch >= 1 (with the frequency policy n < 2^28 and "
                       "batch < 2^32), got %lld and %lld",
                       (long long)n, (long long)batch);
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    size_t needed = 0;
    frequency_layout fl = {};
    clock_layout cl = {};
    st = c->policy == HE_CACHE_FREQUENCY ? frequency_layout_of(n, c->capacity, &fl) : clock_layout_of(n, c->capacity, &cl);
    if (st != HE_OK)
        return st;
    needed = c->policy == HE_CACHE_FREQUENCY ? fl.total : cl.total;
    if (workspace_bytes < needed)
        return he_fail(HE_ERR_VALUE, "a GPU cache plan of %lld rows needs %zu bytes of workspace, got %zu",
                       (long long)n, needed, workspace_bytes);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    st = c->policy == HE_CACHE_FREQUENCY ? plan_frequency(c, unique, n, batch, plan, workspace, fl, stream)
                                         : plan_clock(c, unique, n, batch, plan, workspace, cl, stream);
    if (st != HE_OK)
        return st;
    plan_done<<<1, 1, 0, stream>>>(c->counters, n);
    HE_CUDA_LAUNCHED(plan_done);
    return HE_OK;
}
