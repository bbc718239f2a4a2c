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
 * The frequency policy: he_cuda_cache_frequency.cuh (its kernels, and the
 * order they run in, which its host twin runs too), on CUB's scans and
 * radix sorts here. */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "he_cache_policy.h"
#include "he_cuda_cache.cuh"
#include "he_cuda_cache_frequency.cuh"
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
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_FETCHES], took);
        he_cuda_count_add(&c.counters[HE_CUDA_CACHE_EVICTIONS], evicted);
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


/* ---- the frequency policy (he_cuda_cache_frequency.cuh): its scratch,
 * and CUB for its primitives */

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

/* he_cache_plan_frequency's primitives on the GPU: kernels and CUB on the
 * stream, CUB's scratch at temp. */
struct cub_prims {
    void *temp;
    size_t temp_bytes;
    cudaStream_t stream;
    unsigned threads = HE_CUDA_THREADS;

    unsigned blocks(int64_t items) const
    {
        return he_cuda_blocks(items, HE_CUDA_THREADS);
    }

    template <typename... P, typename... A>
    he_status launch(void (*kernel)(P...), unsigned grid, unsigned block, A... args) const
    {
        kernel<<<grid, block, 0, stream>>>(args...);
        HE_CUDA_TRY_AS(cudaGetLastError(), "launch of a frequency planner kernel");
        return HE_OK;
    }

    he_status scan(const int32_t *in, int32_t *out, int64_t n) const
    {
        size_t bytes = temp_bytes;
        HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp, bytes, in, out, (int)n, stream));
        return HE_OK;
    }

    he_status sort(const uint64_t *in, uint64_t *out, int64_t n) const
    {
        size_t bytes = temp_bytes;
        HE_CUDA_TRY(cub::DeviceRadixSort::SortKeys(temp, bytes, in, out, (int)n, 0, 64, stream));
        return HE_OK;
    }
};

static he_status plan_frequency(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                                const he_cuda_cache_batch *plan, void *workspace, const frequency_layout &l,
                                cudaStream_t stream)
{
    char *ws = (char *)workspace;
    he_cache_frequency_buffers b;
    b.flags = (int32_t *)(ws + l.flags);
    b.ranks = (int32_t *)(ws + l.ranks);
    b.turned = (int32_t *)(ws + l.turned);
    b.turned_ranks = (int32_t *)(ws + l.turned_ranks);
    b.turned_list = (int64_t *)(ws + l.turned_list);
    b.miss_keys = (uint64_t *)(ws + l.miss_keys);
    b.miss_sorted = (uint64_t *)(ws + l.miss_sorted);
    b.keys = (uint64_t *)(ws + l.keys);
    b.sorted = (uint64_t *)(ws + l.sorted);
    b.ring = (int32_t *)(ws + l.ring);
    b.ring_ranks = (int32_t *)(ws + l.ring_ranks);
    cub_prims p = {ws + l.temp, l.temp_bytes, stream};
    return he_cache_plan_frequency(c, unique, n, batch, plan, b, p);
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
