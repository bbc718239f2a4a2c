/* A row cache in GPU memory: the planner (which row sits in which slot)
 * and the records (a row and its optimizer state) both on the GPU, so a
 * cached step never waits for the CPU.
 *
 * The planner makes csrc/cache_plan.c's decisions (the host twin: the
 * same state, the same policy, include/he_cache_policy.h), but a round of
 * the hand at once instead of one miss after another. Within a round each
 * slot is met once, and whether the hand settles on it depends only on
 * the state before the round; so one pass marks the eligible slots, a
 * prefix sum ranks them, and the i-th remaining miss (ascending rows)
 * meets the i-th eligible slot: the pairs the CPU's hand would make. The
 * hand stops after the slot the last miss met; the slots it passed before
 * that lose their second chance; a second round, as the CPU's hand going
 * round again, meets the misses left. Every write of a round touches a
 * place no other thread of it reads or writes (distinct slots, distinct
 * miss rows, evicted rows that are not in the batch), so no atomics decide
 * anything; the counts use them.
 *
 * Records move over the pinned mapping (zero-copy): a miss's slot writes
 * its old record back and reads its row's in one kernel, with the loads of
 * all arrays in flight together (a read over PCIe takes about a
 * microsecond). Rows that bypass the cache are read and updated over the
 * mapping too, all on the stream: nothing is staged by the CPU. */
#include <cub/device/device_scan.cuh>

#include "he_cache_policy.h"
#include "he_cuda_adam.cuh"
#include "he_cuda_common.cuh"
#include "he_cuda_compact.cuh"

/* ---- the planner */

struct plan_layout {
    size_t flags, ranks, temp, temp_bytes, total;
};

static he_status plan_layout_of(int64_t n, int64_t capacity, plan_layout *l)
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

static he_status check_cache(const he_cuda_cache *c)
{
    if (c->num_rows < 0 || c->capacity < 1 || c->capacity >= (int64_t)HE_CACHE_SLOT_MASK ||
        (c->protect != 1 && c->protect != 2))
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache needs num_rows >= 0, 1 <= capacity < %lld and protect 1 or 2, got %lld, %lld "
                       "and %d",
                       (long long)HE_CACHE_SLOT_MASK, (long long)c->num_rows, (long long)c->capacity, c->protect);
    return HE_OK;
}

extern "C" he_status he_cuda_cache_plan_workspace(int64_t n, int64_t capacity, int device, size_t *bytes)
{
    if (n < 0 || n > INT32_MAX || capacity < 1 || capacity >= (int64_t)HE_CACHE_SLOT_MASK)
        return he_fail(HE_ERR_VALUE, "a GPU cache plan needs 0 <= n < 2^31 and 1 <= capacity < %lld, got %lld and %lld",
                       (long long)HE_CACHE_SLOT_MASK, (long long)n, (long long)capacity);
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;
    plan_layout l = {};
    st = plan_layout_of(n, capacity, &l);
    if (st == HE_OK)
        *bytes = l.total;
    return st;
}

extern "C" he_status he_cuda_cache_plan(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                                        const he_cuda_cache_batch *plan, void *workspace, size_t workspace_bytes,
                                        int device, void *stream_handle)
{
    he_status st = check_cache(c);
    if (st != HE_OK)
        return st;
    if (n < 0 || n > INT32_MAX || batch < 1)
        return he_fail(HE_ERR_VALUE, "a GPU cache plan needs 0 <= n < 2^31 and batch >= 1, got %lld and %lld",
                       (long long)n, (long long)batch);
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    plan_layout l = {};
    st = plan_layout_of(n, c->capacity, &l);
    if (st != HE_OK)
        return st;
    if (workspace_bytes < l.total)
        return he_fail(HE_ERR_VALUE, "a GPU cache plan of %lld rows needs %zu bytes of workspace, got %zu",
                       (long long)n, l.total, workspace_bytes);
    cudaStream_t stream = (cudaStream_t)stream_handle;
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
    plan_done<<<1, 1, 0, stream>>>(c->counters, n);
    HE_CUDA_LAUNCHED(plan_done);
    return HE_OK;
}

/* ---- moving and reading records */

template <typename V> struct arrays_of {
    V *records[HE_CUDA_CACHE_ARRAYS];
    V *host[HE_CUDA_CACHE_ARRAYS];
    int count;
};

template <typename V> static arrays_of<V> arrays_as(const he_cuda_cache_arrays *a)
{
    arrays_of<V> out;
    for (int i = 0; i < HE_CUDA_CACHE_ARRAYS; i++) {
        out.records[i] = (V *)a->records[i];
        out.host[i] = (V *)a->host[i];
    }
    out.count = a->count;
    return out;
}

/* 16-byte accesses when every row of every array starts 16-byte aligned. */
static int vectorised(const he_cuda_cache_arrays *a, const float *also)
{
    if (a->dim % 4 != 0 || (also && !he_cuda_aligned16(also)))
        return 0;
    for (int i = 0; i < a->count; i++)
        if (!he_cuda_aligned16(a->records[i]) || !he_cuda_aligned16(a->host[i]))
            return 0;
    return 1;
}

static he_status check_arrays(const he_cuda_cache_arrays *a, int at_least)
{
    if (a->count < at_least || a->count > HE_CUDA_CACHE_ARRAYS || a->dim < 0)
        return he_fail(HE_ERR_VALUE, "a GPU cache's arrays: %d to %d of them and dim >= 0, got %d and %lld", at_least,
                       HE_CUDA_CACHE_ARRAYS, a->count, (long long)a->dim);
    return HE_OK;
}

/* Item i: column chunk i % chunks of the (i / chunks)-th miss. */
template <typename V>
__global__ void move_records(arrays_of<V> a, int64_t chunks, const int64_t *__restrict__ unique,
                             he_cuda_cache_batch plan, const int64_t *__restrict__ counters, int64_t items)
{
    int64_t misses = counters[HE_CUDA_CACHE_MISSES];
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t j = i / chunks;
        if (j >= misses)
            break; /* items ascend with j */
        int64_t k = plan.miss[j];
        int32_t s = plan.slot[k];
        if (s < 0)
            continue;
        int64_t col = i - j * chunks, old = plan.evict_row[j];
        int64_t at = (int64_t)s * chunks + col, from = unique[k] * chunks + col;
        V record[HE_CUDA_CACHE_ARRAYS], row[HE_CUDA_CACHE_ARRAYS];
#pragma unroll
        for (int x = 0; x < HE_CUDA_CACHE_ARRAYS; x++) {
            if (x < a.count) {
                row[x] = a.host[x][from];
                if (old >= 0)
                    record[x] = a.records[x][at];
            }
        }
#pragma unroll
        for (int x = 0; x < HE_CUDA_CACHE_ARRAYS; x++) {
            if (x < a.count) {
                if (old >= 0)
                    a.host[x][old * chunks + col] = record[x];
                a.records[x][at] = row[x];
            }
        }
    }
}

extern "C" he_status he_cuda_cache_move(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *unique,
                                        int64_t n, const he_cuda_cache_batch *plan, int device, void *stream_handle)
{
    he_status st = check_arrays(a, 1);
    if (st == HE_OK)
        st = check_cache(c);
    if (st != HE_OK)
        return st;
    if (n < 0)
        return he_fail(HE_ERR_VALUE, "a GPU cache's moves need n >= 0, got %lld", (long long)n);
    if (n == 0 || a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    cudaStream_t stream = (cudaStream_t)stream_handle;
    if (vectorised(a, NULL)) {
        int64_t chunks = a->dim / 4, items = n * chunks;
        move_records<float4><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float4>(a), chunks, unique, *plan, c->counters, items);
    } else {
        int64_t items = n * a->dim;
        move_records<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float>(a), a->dim, unique, *plan, c->counters, items);
    }
    HE_CUDA_LAUNCHED(move_records);
    return HE_OK;
}

#define CACHE_GATHER_UNROLL 4

/* As gather.cu's gather_rows, each row from its slot or over the mapping. */
template <typename V>
__global__ void gather_cached(const V *__restrict__ records, const V *__restrict__ host, int64_t chunks,
                              const int64_t *__restrict__ unique, const int32_t *__restrict__ slot, int64_t items,
                              V *__restrict__ out)
{
    int64_t stride = he_thread_count();
    for (int64_t first = he_thread_index(); first < items; first += stride * CACHE_GATHER_UNROLL) {
        V v[CACHE_GATHER_UNROLL];
#pragma unroll
        for (int u = 0; u < CACHE_GATHER_UNROLL; u++) {
            int64_t i = first + u * stride;
            if (i < items) {
                int64_t k = i / chunks, col = i - k * chunks;
                int32_t s = slot[k];
                v[u] = s >= 0 ? records[(int64_t)s * chunks + col] : host[unique[k] * chunks + col];
            }
        }
#pragma unroll
        for (int u = 0; u < CACHE_GATHER_UNROLL; u++) {
            int64_t i = first + u * stride;
            if (i < items)
                out[i] = v[u];
        }
    }
}

extern "C" he_status he_cuda_cache_gather(const he_cuda_cache_arrays *a, const int64_t *unique, const int32_t *slot,
                                          int64_t n, float *out, int device, void *stream_handle)
{
    he_status st = check_arrays(a, 1);
    if (st != HE_OK)
        return st;
    if (n < 0)
        return he_fail(HE_ERR_VALUE, "a GPU cache's gather needs n >= 0, got %lld", (long long)n);
    if (n == 0 || a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    cudaStream_t stream = (cudaStream_t)stream_handle;
    int64_t per_block = (int64_t)HE_CUDA_THREADS * CACHE_GATHER_UNROLL;
    if (a->dim % 4 == 0 && he_cuda_aligned16(a->records[0]) && he_cuda_aligned16(a->host[0]) &&
        he_cuda_aligned16(out)) {
        int64_t chunks = a->dim / 4, items = n * chunks;
        gather_cached<float4><<<he_cuda_blocks(items, per_block), HE_CUDA_THREADS, 0, stream>>>(
            (const float4 *)a->records[0], (const float4 *)a->host[0], chunks, unique, slot, items, (float4 *)out);
    } else {
        int64_t items = n * a->dim;
        gather_cached<float><<<he_cuda_blocks(items, per_block), HE_CUDA_THREADS, 0, stream>>>(
            a->records[0], a->host[0], a->dim, unique, slot, items, out);
    }
    HE_CUDA_LAUNCHED(gather_cached);
    return HE_OK;
}

/* Each gradient row's update where its row is now: its slot, or host
 * memory over the mapping (a row that bypassed the cache, or one a later
 * plan evicted before this update). */
template <typename V>
__global__ void adam_cached(arrays_of<V> a, const uint32_t *__restrict__ entry, int64_t chunks,
                            const int64_t *__restrict__ indices, const V *__restrict__ values, int64_t items,
                            he_adam_consts hc)
{
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t k = i / chunks, col = i - k * chunks, row = indices[k];
        uint32_t s1 = he_cache_entry_slot1(entry[row]);
        V *w = s1 ? a.records[0] : a.host[0], *m = s1 ? a.records[1] : a.host[1], *v = s1 ? a.records[2] : a.host[2];
        int64_t at = (s1 ? (int64_t)(s1 - 1) : row) * chunks + col;
        V wv = w[at], mv = m[at], vv = v[at];
        he_adam_vector(values[i], wv, mv, vv, hc);
        w[at] = wv;
        m[at] = mv;
        v[at] = vv;
    }
}

static he_status check_adam(int64_t nnz, const he_adam_params *hp)
{
    if (nnz < 0)
        return he_fail(HE_ERR_VALUE, "SparseAdam needs nnz >= 0, got %lld", (long long)nnz);
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %lld", (long long)hp->step);
    return HE_OK;
}

extern "C" he_status he_cuda_cache_adam(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *indices,
                                        const float *values, int64_t nnz, const he_adam_params *hp, int device,
                                        void *stream_handle)
{
    he_status st = check_arrays(a, 3);
    if (st == HE_OK)
        st = check_cache(c);
    if (st != HE_OK)
        return st;
    st = check_adam(nnz, hp);
    if (st != HE_OK)
        return st;
    if (nnz == 0 || a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    he_adam_consts hc = he_adam_make_consts(hp);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    if (vectorised(a, values)) {
        int64_t chunks = a->dim / 4, items = nnz * chunks;
        adam_cached<float4><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float4>(a), c->entry, chunks, indices, (const float4 *)values, items, hc);
    } else {
        int64_t items = nnz * a->dim;
        adam_cached<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float>(a), c->entry, a->dim, indices, values, items, hc);
    }
    HE_CUDA_LAUNCHED(adam_cached);
    return HE_OK;
}

/* The compact kernel, adam_compact_cached, is in he_cuda_compact.cuh, where
 * a CI test runs it on the host (tests/test_compact_kernel_twin.py). */

/* exp_avg may be int8, never the fourth root (it takes negative values);
 * exp_avg_sq either: the 8-bit forms the CPU core allows them. */
static int compact_moment(int dtype, int nonneg)
{
    return dtype == HE_BF16 || dtype == HE_Q8 || (nonneg && dtype == HE_Q8_NONNEG);
}

extern "C" he_status he_cuda_cache_adam_compact(const he_cuda_cache *c, const he_cuda_cache_compact *a,
                                                const int64_t *indices, const float *values, int64_t nnz,
                                                const he_adam_params *hp, int device, void *stream_handle)
{
    he_status st = check_cache(c);
    if (st != HE_OK)
        return st;
    if (a->dim < 0 || !compact_moment(a->m_dtype, 0) || !compact_moment(a->v_dtype, 1))
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache's compact SparseAdam needs dim >= 0, exp_avg bfloat16 or int8 and exp_avg_sq "
                       "bfloat16, int8 or uint8 (fourth root), got %lld, %s (%d) and %s (%d)",
                       (long long)a->dim, he_dtype_name(a->m_dtype), a->m_dtype, he_dtype_name(a->v_dtype),
                       a->v_dtype);
    st = check_adam(nnz, hp);
    if (st != HE_OK)
        return st;
    if (nnz == 0 || a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    he_adam_consts hc = he_adam_make_consts(hp);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    int64_t blocks = (a->dim + HE_CUDA_Q8_BLOCK - 1) / HE_CUDA_Q8_BLOCK, items = nnz * blocks;
    adam_compact_cached<<<he_cuda_blocks(items, HE_CUDA_THREADS / HE_CUDA_WARP), HE_CUDA_THREADS, 0, stream>>>(
        *a, c->entry, blocks, indices, values, items, hc);
    HE_CUDA_LAUNCHED(adam_compact_cached);
    return HE_OK;
}

template <typename V>
__global__ void sync_records(arrays_of<V> a, const int64_t *__restrict__ row_of, int64_t chunks, int64_t items,
                             int to_host)
{
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t s = i / chunks, col = i - s * chunks, row = row_of[s];
        if (row < 0)
            continue;
        for (int x = 0; x < a.count; x++) {
            if (to_host)
                a.host[x][row * chunks + col] = a.records[x][s * chunks + col];
            else
                a.records[x][s * chunks + col] = a.host[x][row * chunks + col];
        }
    }
}

extern "C" he_status he_cuda_cache_sync_records(const he_cuda_cache *c, const he_cuda_cache_arrays *a, int to_host,
                                                int device, void *stream_handle)
{
    he_status st = check_arrays(a, 1);
    if (st == HE_OK)
        st = check_cache(c);
    if (st != HE_OK)
        return st;
    if (a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    cudaStream_t stream = (cudaStream_t)stream_handle;
    if (vectorised(a, NULL)) {
        int64_t chunks = a->dim / 4, items = c->capacity * chunks;
        sync_records<float4><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float4>(a), c->row_of, chunks, items, to_host);
    } else {
        int64_t items = c->capacity * a->dim;
        sync_records<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float>(a), c->row_of, a->dim, items, to_host);
    }
    HE_CUDA_LAUNCHED(sync_records);
    return HE_OK;
}
