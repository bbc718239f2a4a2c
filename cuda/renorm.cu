/* max_norm on the GPU: the referenced rows renormed in place in registered
 * host memory, before the gather reads them (same stream, so in order).
 *
 * The same arithmetic as csrc/renorm.c: the norm accumulated in double and
 * rounded to float, scale = (float)(max_norm / (norm + 1e-7)), one float
 * multiply per element; for p other than 0, 1, 2 and inf the scaled norm
 * m * (sum (|x|/m)^p)^(1/p) with m = max|x|, which neither overflows nor
 * underflows (|x|^300 overflows double for |x| > 10.9). Only the order of
 * the double sum differs (lanes, then a butterfly), which after rounding to
 * float almost never shows. */
#include <math.h>

#include "he_cuda_common.cuh"

enum norm_kind { NORM_2, NORM_1, NORM_INF, NORM_0, NORM_P };

__device__ __forceinline__ double accumulate(double acc, float x, norm_kind kind)
{
    double a = fabs((double)x);
    switch (kind) {
    case NORM_2: return acc + (double)x * (double)x;
    case NORM_1: return acc + a;
    case NORM_INF: return fmax(acc, a);
    case NORM_0: return acc + (x != 0.0f ? 1.0 : 0.0);
    default: return acc; /* NORM_P never comes here: renorm_rows sums it scaled */
    }
}

/* The warp's combined value: every lane ends with it. */
__device__ __forceinline__ double warp_combine(double acc, bool take_max)
{
    for (int offset = HE_CUDA_WARP / 2; offset > 0; offset /= 2) {
        double other = __shfl_xor_sync(0xffffffffu, acc, offset);
        acc = take_max ? fmax(acc, other) : acc + other;
    }
    return acc;
}

/* One warp per row; every lane ends with the whole row's value. */
__global__ void renorm_rows(float *table, int64_t dim, const int64_t *__restrict__ rows, int64_t count,
                            double max_norm, double p, norm_kind kind)
{
    int lane = threadIdx.x % HE_CUDA_WARP;
    int64_t warps = he_thread_count() / HE_CUDA_WARP;
    /* The loop bound is the same for all lanes of a warp, so the full-mask
     * shuffles below always see every lane. */
    for (int64_t k = he_thread_index() / HE_CUDA_WARP; k < count; k += warps) {
        float *row = table + rows[k] * dim;
        float norm;
        if (kind == NORM_P) {
            /* m is the same in every lane, so every lane takes the same
             * branch and the shuffles below see the whole warp. */
            double m = 0.0;
            for (int64_t j = lane; j < dim; j += HE_CUDA_WARP)
                m = fmax(m, fabs((double)row[j]));
            m = warp_combine(m, true);
            if (!(m > 0.0) || isinf(m)) {
                norm = (float)m;
            } else {
                double acc = 0.0;
                for (int64_t j = lane; j < dim; j += HE_CUDA_WARP)
                    acc += pow(fabs((double)row[j]) / m, p);
                acc = warp_combine(acc, false);
                norm = (float)(m * pow(acc, 1.0 / p));
            }
        } else {
            double acc = 0.0;
            for (int64_t j = lane; j < dim; j += HE_CUDA_WARP)
                acc = accumulate(acc, row[j], kind);
            acc = warp_combine(acc, kind == NORM_INF);
            norm = kind == NORM_2 ? (float)sqrt(acc) : (float)acc;
        }
        if ((double)norm > max_norm) {
            float scale = (float)(max_norm / ((double)norm + 1e-7));
            for (int64_t j = lane; j < dim; j += HE_CUDA_WARP)
                row[j] = __fmul_rn(row[j], scale);
        }
    }
}

extern "C" he_status he_cuda_renorm(float *table, int64_t dim, const int64_t *rows, int64_t count, double max_norm,
                                    double norm_type, int device, void *stream_handle)
{
    if (!(norm_type >= 0.0))
        return he_fail(HE_ERR_VALUE, "norm_type must be >= 0 (or inf), got %g", norm_type);
    if (!(max_norm >= 0.0))
        return he_fail(HE_ERR_VALUE, "max_norm must be >= 0, got %g", max_norm);
    if (dim < 0 || count < 0)
        return he_fail(HE_ERR_VALUE, "renorm needs dim >= 0 and count >= 0, got %lld and %lld", (long long)dim,
                       (long long)count);
    if (count == 0 || dim == 0)
        return HE_OK; /* dim 0: every norm is 0, and an empty table has no registered rows */
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;
    norm_kind kind = norm_type == 2.0 ? NORM_2
                   : norm_type == 1.0 ? NORM_1
                   : isinf(norm_type) ? NORM_INF
                   : norm_type == 0.0 ? NORM_0
                                      : NORM_P;
    cudaStream_t stream = (cudaStream_t)stream_handle;
    int64_t rows_per_block = HE_CUDA_THREADS / HE_CUDA_WARP;
    renorm_rows<<<he_cuda_blocks(count, rows_per_block), HE_CUDA_THREADS, 0, stream>>>(table, dim, rows, count,
                                                                                       max_norm, norm_type, kind);
    HE_CUDA_LAUNCHED(renorm_rows);
    return HE_OK;
}
