/* Zero-copy gather of unique rows from registered host memory.
 *
 * The rows cross PCIe once each, read by the GPU's own loads; the caller
 * then expands them to the batch (output = rows[inverse]) in device memory.
 *
 * Work is flattened to (row, 16-byte column chunk) items, consecutive
 * threads on consecutive chunks of a row: at D = 128 a warp reads exactly
 * one 512-byte row (one warp per row), while at D = 16 a warp covers eight
 * rows instead of leaving 28 lanes idle. Each thread issues UNROLL loads
 * before its first store, since a read over PCIe takes about a microsecond
 * and the link only fills with many requests in flight. */
#include "he_cuda_common.cuh"

#define GATHER_UNROLL 4

template <typename V>
__global__ void gather_rows(const V *__restrict__ table, int64_t chunks_per_row, const int64_t *__restrict__ rows,
                            int64_t items, V *__restrict__ out)
{
    int64_t stride = he_thread_count();
    for (int64_t first = he_thread_index(); first < items; first += stride * GATHER_UNROLL) {
        V v[GATHER_UNROLL];
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; u++) {
            int64_t i = first + u * stride;
            if (i < items) {
                int64_t k = i / chunks_per_row;
                int64_t c = i - k * chunks_per_row;
                v[u] = table[rows[k] * chunks_per_row + c];
            }
        }
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; u++) {
            int64_t i = first + u * stride;
            if (i < items)
                out[i] = v[u];
        }
    }
}

extern "C" he_status he_cuda_gather(const float *table, int64_t dim, const int64_t *rows, int64_t count, float *out,
                                    int device, void *stream_handle)
{
    if (dim < 0 || count < 0)
        return he_fail(HE_ERR_VALUE, "gather needs dim >= 0 and count >= 0, got %lld and %lld", (long long)dim,
                       (long long)count);
    if (dim == 0 || count == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;
    cudaStream_t stream = (cudaStream_t)stream_handle;
    /* 16-byte loads need every row start 16-byte aligned: an aligned base
     * and a row length that is a multiple of 4 floats. */
    if (dim % 4 == 0 && he_cuda_aligned16(table) && he_cuda_aligned16(out)) {
        int64_t chunks = dim / 4, items = count * chunks;
        gather_rows<float4><<<he_cuda_blocks(items, (int64_t)HE_CUDA_THREADS * GATHER_UNROLL), HE_CUDA_THREADS, 0,
                              stream>>>((const float4 *)table, chunks, rows, items, (float4 *)out);
    } else {
        int64_t items = count * dim;
        gather_rows<float><<<he_cuda_blocks(items, (int64_t)HE_CUDA_THREADS * GATHER_UNROLL), HE_CUDA_THREADS, 0,
                             stream>>>(table, dim, rows, items, out);
    }
    HE_CUDA_LAUNCHED(gather_rows);
    return HE_OK;
}
