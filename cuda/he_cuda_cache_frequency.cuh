/* The row cache's frequency planner on the GPU (include/he_cache_policy.h):
 * its kernels and the order they run in, kept in a header so that the
 * same source runs on the host too (tests/kernel_twin/cache_frequency.cpp,
 * over device_shim.h), where tests/test_cache_frequency_twin.py compares
 * its plans with the CPU planner's batch by batch.
 *
 * The CPU planner pairs its misses and victims by keys whose order is
 * total (he_cache_miss_key, he_cache_victim_key), so a radix sort of each
 * side gives its pairs, and each pair's decision reads only state no other
 * pair writes (distinct slots, distinct miss rows, evicted rows not in the
 * batch). The window's ring is ranked as a round of the clock's hand is:
 * a prefix sum over its free slots from the hand, the i-th row turned away
 * meeting the i-th. Sizes the host does not know (misses, eligible slots,
 * the window) stay in counters: kernels read them, nothing waits.
 *
 * he_cache_plan_frequency takes its primitives from the includer (Prims):
 * blocks(items) for a grid, launch(kernel, grid, block, args...), scan
 * (an exclusive prefix sum of int32) and sort (uint64 keys ascending): CUB
 * on the stream in cache_plan.cu, plain loops in the twin. Kernels meant to
 * run once test their thread index, as the twin runs whole warps. */
#ifndef HE_CUDA_CACHE_FREQUENCY_CUH
#define HE_CUDA_CACHE_FREQUENCY_CUH

#include "he_cache_policy.h"
#include "he_cuda.h"
#include "he_cuda_cache.cuh"
#include "he_cuda_common.cuh"

/* The positions of a batch's misses, ascending; their count. */
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

/* One thread: a plan's counts. */
__global__ void plan_done(int64_t *counters, int64_t n)
{
    if (he_thread_index() != 0)
        return;
    if (n == 0) /* no list_misses ran: the last batch's would stay */
        counters[HE_CUDA_CACHE_MISSES] = counters[HE_CUDA_CACHE_BASE] = 0;
    counters[HE_CUDA_CACHE_BATCHES] += 1;
    counters[HE_CUDA_CACHE_ROWS] += n;
    counters[HE_CUDA_CACHE_HITS] += n - (n ? counters[HE_CUDA_CACHE_MISSES] : 0);
}

/* One thread: a batch's counts cleared before its kernels add to them. */
__global__ void frequency_begin(int64_t *counters)
{
    if (he_thread_index() != 0)
        return;
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
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_ELIGIBLE], (unsigned)eligible);
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
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
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
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_BACK], back);
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_TURNED], now);
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
    if (he_thread_index() != 0)
        return;
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
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
    }
}

/* One thread: the window's hand after the last slot taken. */
__global__ void frequency_ring_end(int64_t *counters)
{
    if (he_thread_index() != 0)
        return;
    int64_t taken = counters[HE_CUDA_CACHE_TAKEN], window = counters[HE_CUDA_CACHE_WINDOW];
    if (taken >= 0)
        counters[HE_CUDA_CACHE_WINDOW_HAND] = taken + 1 == window ? 0 : taken + 1;
}

__global__ void frequency_last_use(he_cuda_cache c, const int64_t *__restrict__ unique, int64_t n, int64_t batch)
{
    for (int64_t k = he_thread_index(); k < n; k += he_thread_count())
        c.last[unique[k]] = (uint32_t)batch;
}

/* A plan's scratch in device memory, sized for n rows and the slots. */
struct he_cache_frequency_buffers {
    int32_t *flags, *ranks, *turned, *turned_ranks; /* [n] */
    int64_t *turned_list;                           /* [n] */
    uint64_t *miss_keys, *miss_sorted;              /* [n] */
    uint64_t *keys, *sorted;                        /* [capacity] */
    int32_t *ring, *ring_ranks;                     /* [capacity] */
};

#define HE_CACHE_PRIM(call)                                                                                          \
    do {                                                                                                             \
        he_status st_ = (call);                                                                                      \
        if (st_ != HE_OK)                                                                                            \
            return st_;                                                                                              \
    } while (0)

/* Batch number `batch` of n unique rows, as csrc/cache_plan.c plans it
 * with the frequency policy; plan_done's counts not included. */
template <typename Prims>
static he_status he_cache_plan_frequency(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                                         const he_cuda_cache_batch *plan, const he_cache_frequency_buffers &b,
                                         const Prims &p)
{
    unsigned rows = p.blocks(n), slots = p.blocks(c->capacity), threads = p.threads;
    HE_CACHE_PRIM(p.launch(frequency_begin, 1, 1, c->counters));
    if (n == 0) { /* the gate still counts the batch, as the CPU's does */
        HE_CACHE_PRIM(p.launch(frequency_gate_slots, slots, threads, *c));
        return p.launch(frequency_gate_end, 1, 1, *c, batch);
    }
    HE_CACHE_PRIM(p.launch(frequency_touch, rows, threads, *c, unique, n, batch, *plan, b.flags));
    HE_CACHE_PRIM(p.scan(b.flags, b.ranks, n));
    HE_CACHE_PRIM(p.launch(list_misses, rows, threads, b.flags, b.ranks, n, plan->miss, c->counters));
    HE_CACHE_PRIM(p.launch(frequency_miss_keys, rows, threads, *c, unique, n, batch, b.flags, b.ranks, b.miss_keys));
    HE_CACHE_PRIM(p.launch(frequency_victim_keys, slots, threads, *c, batch, b.keys));
    HE_CACHE_PRIM(p.sort(b.miss_keys, b.miss_sorted, n));
    HE_CACHE_PRIM(p.sort(b.keys, b.sorted, c->capacity));
    HE_CACHE_PRIM(p.launch(frequency_pairs, rows, threads, *c, unique, n, batch, b.miss_sorted, b.sorted, b.ranks,
                           *plan));
    HE_CACHE_PRIM(p.launch(frequency_gate_rows, rows, threads, *c, unique, n, batch, *plan, b.turned));
    HE_CACHE_PRIM(p.launch(frequency_gate_slots, slots, threads, *c));
    HE_CACHE_PRIM(p.launch(frequency_gate_end, 1, 1, *c, batch));
    HE_CACHE_PRIM(p.scan(b.turned, b.turned_ranks, n));
    HE_CACHE_PRIM(p.launch(frequency_turned_list, rows, threads, b.turned, b.turned_ranks, n, b.turned_list));
    HE_CACHE_PRIM(p.launch(frequency_ring_flags, slots, threads, *c, batch, b.ring));
    HE_CACHE_PRIM(p.scan(b.ring, b.ring_ranks, c->capacity));
    HE_CACHE_PRIM(p.launch(frequency_ring_assign, slots, threads, *c, unique, batch, b.ring, b.ring_ranks,
                           b.turned_list, b.ranks, *plan));
    HE_CACHE_PRIM(p.launch(frequency_ring_end, 1, 1, c->counters));
    return p.launch(frequency_last_use, rows, threads, *c, unique, n, batch);
}

#endif
