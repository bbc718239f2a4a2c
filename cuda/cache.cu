/* A row cache in GPU memory: its records (a row and its optimizer state)
 * on the GPU, moved, read and updated where the planner (cache_plan.cu,
 * also on the GPU) puts them, so a cached step never waits for the CPU.
 *
 * Records move over the pinned mapping (zero-copy): a miss's slot writes
 * its old record back and reads its row's in one kernel, with the loads of
 * all arrays in flight together (a read over PCIe takes about a
 * microsecond). Rows that bypass the cache are read and updated over the
 * mapping too, all on the stream: nothing is staged by the CPU. */
#include "he_cache_policy.h"
#include "he_cuda_adam.cuh"
#include "he_cuda_cache.cuh"
#include "he_cuda_common.cuh"
#include "he_cuda_compact.cuh"
#include "he_cuda_optim_cached.cuh"

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

/* Item i: column chunk i % chunks of the (i / chunks)-th miss. A miss that
 * bypasses the cache is updated in host memory, and an evicted row is
 * written back: both mark their rows written (the first chunk's thread).
 * A fetched row not written since the state came to the cache gets zeros
 * for the arrays of zero_fill, unread. */
template <typename V>
__global__ void move_records(arrays_of<V> a, int64_t chunks, const int64_t *__restrict__ unique,
                             he_cuda_cache_batch plan, int64_t *__restrict__ counters, int64_t items,
                             uint8_t *__restrict__ written, unsigned zero_fill)
{
    int64_t misses = counters[HE_CUDA_CACHE_MISSES];
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t j = i / chunks;
        if (j >= misses)
            break; /* items ascend with j */
        int64_t k = plan.miss[j], col = i - j * chunks;
        int32_t s = plan.slot[k];
        if (s < 0) {
            if (written && col == 0)
                written[unique[k]] = 1;
            continue;
        }
        int64_t old = plan.evict_row[j];
        int64_t at = (int64_t)s * chunks + col, from = unique[k] * chunks + col;
        unsigned zeros = written && !written[unique[k]] ? zero_fill : 0u, reads = 0;
        V record[HE_CUDA_CACHE_ARRAYS], row[HE_CUDA_CACHE_ARRAYS];
#pragma unroll
        for (int x = 0; x < HE_CUDA_CACHE_ARRAYS; x++) {
            if (x < a.count) {
                if (zeros >> x & 1u) {
                    row[x] = V();
                } else {
                    row[x] = a.host[x][from];
                    reads++;
                }
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
        if (col == 0) {
            if (written && old >= 0)
                written[old] = 1;
            he_cuda_count_add(&counters[HE_CUDA_CACHE_HOST_READS], reads);
        }
    }
}

extern "C" he_status he_cuda_cache_move(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *unique,
                                        int64_t n, const he_cuda_cache_batch *plan, int device, void *stream_handle)
{
    he_status st = check_arrays(a, 1);
    if (st == HE_OK)
        st = he_cuda_check_cache(c);
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
            arrays_as<float4>(a), chunks, unique, *plan, c->counters, items, a->written, a->zero_fill);
    } else {
        int64_t items = n * a->dim;
        move_records<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float>(a), a->dim, unique, *plan, c->counters, items, a->written, a->zero_fill);
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
        st = he_cuda_check_cache(c);
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
    he_status st = he_cuda_check_cache(c);
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

/* SGD, Adagrad and row-wise Adagrad: the kernel, optim_cached, is in
 * he_cuda_optim_cached.cuh, where a CI test runs it on the host
 * (tests/test_optim_kernel_twin.py). */

/* The arrays of hp->kind's update (its state, include/he_optim.h's
 * layout), and the arguments the core checks too. */
static he_status check_update(const he_cuda_cache_arrays *a, int64_t nnz, const he_optim_params *hp)
{
    const char *name, *arrays;
    switch (hp->kind) {
    case HE_OPTIM_SGD:
        name = "SGD";
        arrays = "weight";
        break;
    case HE_OPTIM_ADAGRAD:
        name = "Adagrad";
        arrays = "weight, sum";
        break;
    case HE_OPTIM_ROWWISE_ADAGRAD:
        name = "row-wise Adagrad";
        arrays = "weight, row_sum";
        break;
    default:
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache's he_cuda_cache_update takes kind %d (SGD), %d (Adagrad) or %d (row-wise "
                       "Adagrad), got %d%s",
                       HE_OPTIM_SGD, HE_OPTIM_ADAGRAD, HE_OPTIM_ROWWISE_ADAGRAD, hp->kind,
                       hp->kind == HE_OPTIM_ADAM ? " (SparseAdam's is he_cuda_cache_adam)" : "");
    }
    int count = hp->kind == HE_OPTIM_SGD ? 1 : 2;
    if (a->count != count || a->dim < 0)
        return he_fail(HE_ERR_VALUE, "a GPU cache's %s update takes %d arrays (%s) and dim >= 0, got %d and %lld",
                       name, count, arrays, a->count, (long long)a->dim);
    if (nnz < 0)
        return he_fail(HE_ERR_VALUE, "%s needs nnz >= 0, got %lld", name, (long long)nnz);
    if (hp->kind == HE_OPTIM_ADAGRAD && hp->step < 1) /* its lr decay counts steps from 1, as the core's */
        return he_fail(HE_ERR_VALUE, "Adagrad needs step >= 1, got %lld", (long long)hp->step);
    return HE_OK;
}

extern "C" he_status he_cuda_cache_update(const he_cuda_cache *c, const he_cuda_cache_arrays *a,
                                          const int64_t *indices, const float *values, int64_t nnz,
                                          const he_optim_params *hp, int device, void *stream_handle)
{
    he_status st = check_update(a, nnz, hp);
    if (st == HE_OK)
        st = he_cuda_check_cache(c);
    if (st != HE_OK)
        return st;
    if (nnz == 0 || a->dim == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    he_cuda_optim_consts oc = he_cuda_optim_make_consts(hp, a->dim);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    int64_t lanes = nnz * HE_CUDA_ROW_LANES;
    optim_cached<<<he_cuda_blocks(lanes, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(*a, c->entry, indices,
                                                                                         values, nnz, oc);
    HE_CUDA_LAUNCHED(optim_cached);
    return HE_OK;
}

template <typename V>
__global__ void sync_records(arrays_of<V> a, const int64_t *__restrict__ row_of, int64_t chunks, int64_t items,
                             int to_host, uint8_t *__restrict__ written)
{
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t s = i / chunks, col = i - s * chunks, row = row_of[s];
        if (row < 0)
            continue;
        if (to_host && written && col == 0) /* written back: no longer as the state came */
            written[row] = 1;
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
        st = he_cuda_check_cache(c);
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
            arrays_as<float4>(a), c->row_of, chunks, items, to_host, a->written);
    } else {
        int64_t items = c->capacity * a->dim;
        sync_records<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            arrays_as<float>(a), c->row_of, a->dim, items, to_host, a->written);
    }
    HE_CUDA_LAUNCHED(sync_records);
    return HE_OK;
}
