/* Backward of the GPU lookup: the coalesced sparse gradient, summed per
 * unique id in a fixed order, without atomics.
 *
 * Zipf traffic makes a few ids hot (the top id of a 1M-id batch can occur
 * ~80k times): one warp summing all of its rows would be the whole kernel's
 * tail. So an id with more than HE_CUDA_REDUCE_CHUNK positions is cut into
 * chunks of that many positions (in position order); one warp sums each
 * chunk into a partial row, and a second kernel sums each id's partials in
 * chunk order. Ids with few positions are summed directly by the second
 * kernel. The partition depends only on the batch, so the result is the same
 * on every run (not bitwise the CPU core's, whose sums run straight through:
 * both are within float32 rounding of the exact sum). */
#include <cub/device/device_scan.cuh>

#include <limits.h>

#include "he_cuda_common.cuh"
#include "he_cuda_vec.cuh"

#define CHUNK HE_CUDA_REDUCE_CHUNK

struct reduce_layout {
    size_t parts, part_base, partials, temp, temp_bytes, total;
    int64_t max_parts;
};

/* Ids with c > CHUNK positions get ceil(c / CHUNK) < 2c / CHUNK chunks, so
 * all of them together have fewer than 2 * count / CHUNK. */
static he_status plan(int64_t count, int64_t num_unique, int64_t dim, reduce_layout *l)
{
    size_t scan_bytes = 0;
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(NULL, scan_bytes, (const int32_t *)NULL, (int32_t *)NULL,
                                              (int)num_unique));
    l->max_parts = (2 * count + CHUNK - 1) / CHUNK;
    size_t at = 0;
    l->parts = at;
    at += he_cuda_align256((size_t)num_unique * sizeof(int32_t));
    l->part_base = at;
    at += he_cuda_align256((size_t)num_unique * sizeof(int32_t));
    l->partials = at;
    at += he_cuda_align256((size_t)l->max_parts * (size_t)dim * sizeof(float));
    l->temp = at;
    l->temp_bytes = scan_bytes;
    at += he_cuda_align256(scan_bytes);
    l->total = at;
    return HE_OK;
}

static he_status check_sizes(int64_t count, int64_t num_unique, int64_t dim)
{
    if (count < 0 || count > INT32_MAX || dim < 0 || num_unique < 0 || num_unique > count ||
        (count > 0 && num_unique == 0))
        return he_fail(HE_ERR_VALUE,
                       "grad reduce needs 0 <= count <= %d, 1 <= num_unique <= count (0 for an empty batch) and "
                       "dim >= 0; got count %lld, num_unique %lld, dim %lld",
                       INT32_MAX, (long long)count, (long long)num_unique, (long long)dim);
    return HE_OK;
}

extern "C" he_status he_cuda_grad_reduce_workspace(int64_t count, int64_t num_unique, int64_t dim, int device,
                                                   size_t *bytes)
{
    *bytes = 0;
    he_status st = check_sizes(count, num_unique, dim);
    if (st != HE_OK || count == 0)
        return st;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    reduce_layout l;
    st = plan(count, num_unique, dim, &l);
    if (st == HE_OK)
        *bytes = l.total;
    return st;
}

__global__ void count_parts(const int64_t *__restrict__ offsets, int64_t num_unique, int32_t *__restrict__ parts)
{
    for (int64_t k = he_thread_index(); k < num_unique; k += he_thread_count()) {
        int64_t c = offsets[k + 1] - offsets[k];
        parts[k] = c > CHUNK ? (int32_t)((c + CHUNK - 1) / CHUNK) : 0;
    }
}

/* Column chunk `col` of the sum of grad rows order[first..last), each
 * scaled by `scale` when scale_rows, in position order. The first row is
 * taken as is rather than added to zero, as the CPU core does. */
template <typename V>
__device__ __forceinline__ V sum_rows(const V *__restrict__ grad, int64_t chunks, const int32_t *__restrict__ order,
                                      int64_t first, int64_t last, int64_t col, int scale_rows, float scale)
{
    V row = grad[(int64_t)order[first] * chunks + col];
    V acc = scale_rows ? he_mul(row, scale) : row;
    for (int64_t i = first + 1; i < last; i++) {
        row = grad[(int64_t)order[i] * chunks + col];
        acc = he_add(acc, scale_rows ? he_mul(row, scale) : row);
    }
    return acc;
}

/* torch scales each row by 1/count before adding it (CPU and CUDA alike). */
__device__ __forceinline__ float frequency_scale(const int64_t *__restrict__ offsets, int64_t k)
{
    return (float)(1.0 / (double)(offsets[k + 1] - offsets[k]));
}

/* One warp per chunk of a hot id; writes partials[part]. */
template <typename V>
__global__ void sum_chunks(const V *__restrict__ grad, int64_t chunks, const int64_t *__restrict__ offsets,
                           const int32_t *__restrict__ order, const int32_t *__restrict__ parts,
                           const int32_t *__restrict__ part_base, int64_t num_unique, int64_t padding_slot,
                           int scale_rows, V *__restrict__ partials)
{
    int64_t lane = threadIdx.x % HE_CUDA_WARP;
    int64_t warps = he_thread_count() / HE_CUDA_WARP;
    int64_t total = (int64_t)part_base[num_unique - 1] + parts[num_unique - 1];
    for (int64_t p = he_thread_index() / HE_CUDA_WARP; p < total; p += warps) {
        /* The id owning chunk p: the last k with part_base[k] <= p. Ids
         * without chunks share their successor's part_base, so the last
         * such k is the one with chunks (part_base[0] = 0 <= p: k >= 0). */
        int64_t lo = 0, hi = num_unique;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (part_base[mid] <= p)
                lo = mid + 1;
            else
                hi = mid;
        }
        int64_t k = lo - 1;
        if (k == padding_slot)
            continue;
        int64_t first = offsets[k] + (p - part_base[k]) * CHUNK;
        int64_t last = first + CHUNK < offsets[k + 1] ? first + CHUNK : offsets[k + 1];
        float scale = frequency_scale(offsets, k);
        for (int64_t col = lane; col < chunks; col += HE_CUDA_WARP)
            partials[p * chunks + col] = sum_rows(grad, chunks, order, first, last, col, scale_rows, scale);
    }
}

/* One warp per unique id: its row of the result. */
template <typename V>
__global__ void finish_rows(const V *__restrict__ grad, int64_t chunks, const int64_t *__restrict__ unique,
                            const int64_t *__restrict__ offsets, const int32_t *__restrict__ order,
                            const int32_t *__restrict__ parts, const int32_t *__restrict__ part_base,
                            const V *__restrict__ partials, int64_t num_unique, int64_t padding_slot, int scale_rows,
                            V *__restrict__ out_values, int64_t *__restrict__ out_indices)
{
    int64_t lane = threadIdx.x % HE_CUDA_WARP;
    int64_t warps = he_thread_count() / HE_CUDA_WARP;
    for (int64_t k = he_thread_index() / HE_CUDA_WARP; k < num_unique; k += warps) {
        if (k == padding_slot)
            continue;
        int64_t slot = padding_slot >= 0 && k > padding_slot ? k - 1 : k;
        if (lane == 0)
            out_indices[slot] = unique[k];
        int64_t n_parts = parts[k];
        if (n_parts == 0) {
            float scale = frequency_scale(offsets, k);
            for (int64_t col = lane; col < chunks; col += HE_CUDA_WARP)
                out_values[slot * chunks + col] =
                    sum_rows(grad, chunks, order, offsets[k], offsets[k + 1], col, scale_rows, scale);
        } else {
            const V *mine = partials + (int64_t)part_base[k] * chunks;
            for (int64_t col = lane; col < chunks; col += HE_CUDA_WARP) {
                V acc = mine[col];
                for (int64_t j = 1; j < n_parts; j++)
                    acc = he_add(acc, mine[j * chunks + col]);
                out_values[slot * chunks + col] = acc;
            }
        }
    }
}

template <typename V>
static he_status launch(const float *grad, int64_t chunks, const he_cuda_dedup_out *d, const int32_t *parts,
                        const int32_t *part_base, float *partials, int64_t max_parts, int64_t num_unique,
                        int64_t padding_slot, int scale_rows, float *out_values, int64_t *out_indices,
                        cudaStream_t stream)
{
    int64_t warps_per_block = HE_CUDA_THREADS / HE_CUDA_WARP;
    sum_chunks<V><<<he_cuda_blocks(max_parts, warps_per_block), HE_CUDA_THREADS, 0, stream>>>(
        (const V *)grad, chunks, d->offsets, d->order, parts, part_base, num_unique, padding_slot, scale_rows,
        (V *)partials);
    HE_CUDA_LAUNCHED(sum_chunks);
    finish_rows<V><<<he_cuda_blocks(num_unique, warps_per_block), HE_CUDA_THREADS, 0, stream>>>(
        (const V *)grad, chunks, d->unique, d->offsets, d->order, parts, part_base, (const V *)partials, num_unique,
        padding_slot, scale_rows, (V *)out_values, out_indices);
    HE_CUDA_LAUNCHED(finish_rows);
    return HE_OK;
}

extern "C" he_status he_cuda_grad_reduce(const float *grad, int64_t dim, int64_t count, const he_cuda_dedup_out *d,
                                         int64_t num_unique, int64_t padding_slot, int scale_grad_by_freq,
                                         void *workspace, size_t workspace_bytes, float *out_values,
                                         int64_t *out_indices, int device, void *stream_handle)
{
    he_status st = check_sizes(count, num_unique, dim);
    if (st != HE_OK || count == 0)
        return st;
    if (padding_slot < -1 || padding_slot >= num_unique)
        return he_fail(HE_ERR_VALUE, "padding_slot must be -1 or in [0, %lld), got %lld", (long long)num_unique,
                       (long long)padding_slot);
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    reduce_layout l;
    st = plan(count, num_unique, dim, &l);
    if (st != HE_OK)
        return st;
    if (workspace_bytes < l.total)
        return he_fail(HE_ERR_VALUE, "grad reduce workspace of %zu bytes is too small: %zu needed", workspace_bytes,
                       l.total);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    char *ws = (char *)workspace;
    int32_t *parts = (int32_t *)(ws + l.parts), *part_base = (int32_t *)(ws + l.part_base);
    float *partials = (float *)(ws + l.partials);
    size_t temp_bytes = l.temp_bytes;

    count_parts<<<he_cuda_blocks(num_unique, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(d->offsets, num_unique,
                                                                                           parts);
    HE_CUDA_LAUNCHED(count_parts);
    /* The same argument types as plan()'s size query (one template instance). */
    HE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(ws + l.temp, temp_bytes, (const int32_t *)parts, part_base,
                                              (int)num_unique, stream));
    if (dim % 4 == 0 && he_cuda_aligned16(grad) && he_cuda_aligned16(out_values) && he_cuda_aligned16(partials))
        return launch<float4>(grad, dim / 4, d, parts, part_base, partials, l.max_parts, num_unique, padding_slot,
                              scale_grad_by_freq, out_values, out_indices, stream);
    return launch<float>(grad, dim, d, parts, part_base, partials, l.max_parts, num_unique, padding_slot,
                         scale_grad_by_freq, out_values, out_indices, stream);
}
