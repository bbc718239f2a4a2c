/* SparseAdam on the GPU, in place on registered host memory.
 *
 * Each element of w, m and v crosses PCIe twice (read, then written back)
 * and the gradient is already on the GPU: 3 x 4 bytes each way per element,
 * the link being full duplex. The arithmetic is csrc/sparse_adam.c's, in the
 * same order with the same per-step scalars (he_adam_make_consts), every
 * operation rounded on its own, sqrt and division correctly rounded: the
 * same bits as the CPU core. */
#include "he_cuda_adam.cuh"
#include "he_cuda_common.cuh"

/* Flat (row, column chunk) items as in gather.cu; the three loads of an
 * item are independent, so each thread has three PCIe reads in flight. */
template <typename V>
__global__ void adam_rows(V *__restrict__ weight, V *__restrict__ exp_avg, V *__restrict__ exp_avg_sq,
                          int64_t chunks, const int64_t *__restrict__ indices, const V *__restrict__ values,
                          int64_t items, he_adam_consts c)
{
    for (int64_t i = he_thread_index(); i < items; i += he_thread_count()) {
        int64_t k = i / chunks;
        int64_t at = indices[k] * chunks + (i - k * chunks);
        V w = weight[at], m = exp_avg[at], v = exp_avg_sq[at];
        he_adam_vector(values[i], w, m, v, c);
        weight[at] = w;
        exp_avg[at] = m;
        exp_avg_sq[at] = v;
    }
}

extern "C" he_status he_cuda_sparse_adam(float *weight, float *exp_avg, float *exp_avg_sq, int64_t dim,
                                         const int64_t *indices, const float *values, int64_t nnz,
                                         const he_adam_params *hp, int device, void *stream_handle)
{
    if (dim < 0 || nnz < 0)
        return he_fail(HE_ERR_VALUE, "SparseAdam needs dim >= 0 and nnz >= 0, got %lld and %lld", (long long)dim,
                       (long long)nnz);
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %lld", (long long)hp->step);
    if (dim == 0 || nnz == 0)
        return HE_OK;
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;
    he_adam_consts c = he_adam_make_consts(hp);
    cudaStream_t stream = (cudaStream_t)stream_handle;
    if (dim % 4 == 0 && he_cuda_aligned16(weight) && he_cuda_aligned16(exp_avg) && he_cuda_aligned16(exp_avg_sq) &&
        he_cuda_aligned16(values)) {
        int64_t chunks = dim / 4, items = nnz * chunks;
        adam_rows<float4><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            (float4 *)weight, (float4 *)exp_avg, (float4 *)exp_avg_sq, chunks, indices, (const float4 *)values, items,
            c);
    } else {
        int64_t items = nnz * dim;
        adam_rows<float><<<he_cuda_blocks(items, HE_CUDA_THREADS), HE_CUDA_THREADS, 0, stream>>>(
            weight, exp_avg, exp_avg_sq, dim, indices, values, items, c);
    }
    HE_CUDA_LAUNCHED(adam_rows);
    return HE_OK;
}
