/* The row cache's update of SGD, Adagrad and row-wise Adagrad records on
 * the GPU (he_cuda_cache_update in cache.cu): csrc/optimizer_rows.inc's
 * float32 row functions (sgd_row, adagrad_row; mean_square,
 * rowwise_prelude and rowwise_row) with the same operations in the same
 * order, each rounded on its own: the _rn intrinsics are never fused, and
 * where the core calls fmaf (torch's CPU kernels fuse `w + g * alpha`),
 * __fmaf_rn rounds once as fmaf does. A row updated in its slot so gets
 * the bits the core gives the rows the cache does not hold, and the
 * records can move between the tiers at any step.
 *
 * Defined in a header, as he_cuda_compact.cuh's kernel is, so that
 * tests/test_optim_kernel_twin.py runs it on the host (g++ over
 * tests/kernel_twin/device_shim.h) against the core without a GPU:
 * include it in one .cu only. The kernels never include csrc/, so the
 * lane count and the per-step scalars are restated here; the twin test
 * compares the result with the core's, scalars included. */
#ifndef HE_CUDA_OPTIM_CACHED_CUH
#define HE_CUDA_OPTIM_CACHED_CUH

#include <cuda_runtime.h>

#include <stdint.h>

#include "he_cache_policy.h"
#include "he_cuda_common.cuh"
#include "he_optim.h"

/* csrc/optimizer_rows.inc's HE_ROWWISE_LANES: row-wise Adagrad sums a
 * row's squares in 8 lanes, column j in lane j % 8, each lane in column
 * order. Here the lanes are 8 threads of a warp, one row each group. */
#define HE_CUDA_ROW_LANES 8

/* One step's scalars as the core's float32 row functions use them: the
 * core computes them in double (csrc/optimizers.c's *_consts) and rounds
 * each to float where a row function reads it; so does this. */
typedef struct he_cuda_optim_consts {
    int kind;    /* HE_OPTIM_SGD, HE_OPTIM_ADAGRAD or HE_OPTIM_ROWWISE_ADAGRAD */
    float alpha; /* SGD: -lr (+lr to maximize); Adagrad: -lr / (1 + (step - 1) * lr_decay) */
    float sign;  /* Adagrad, row-wise: -1 to maximize */
    float eps;   /* Adagrad, row-wise */
    float lr;    /* row-wise */
    float dim;   /* row-wise: the row's length, the mean's divisor */
} he_cuda_optim_consts;

/* csrc/optimizers.c's sgd_consts, adagrad_consts and rowwise_consts for
 * hp->kind (checked by the caller). weight_decay is not read: the core's
 * rules for these three take none (the Python optimizers refuse it). */
static inline he_cuda_optim_consts he_cuda_optim_make_consts(const he_optim_params *hp, int64_t dim)
{
    he_cuda_optim_consts c;
    c.kind = hp->kind;
    c.alpha = 0.0f;
    c.sign = hp->maximize ? -1.0f : 1.0f;
    c.eps = (float)hp->eps;
    c.lr = (float)hp->lr;
    c.dim = (float)(double)dim;
    if (hp->kind == HE_OPTIM_SGD) /* maximize's negation is exact: folded into alpha, as the core does */
        c.alpha = (float)(hp->maximize ? hp->lr : -hp->lr);
    else if (hp->kind == HE_OPTIM_ADAGRAD)
        c.alpha = (float)-(hp->lr / (1.0 + (double)(hp->step - 1) * hp->lr_decay));
    return c;
}

/* adagrad_row's element: sum += g*g; w += (g / (sqrt(sum) + eps)) * alpha,
 * the last a fused multiply-add. */
static __device__ __forceinline__ void he_adagrad_element(float g_in, float &w, float &sum,
                                                          const he_cuda_optim_consts &c)
{
    float g = __fmul_rn(g_in, c.sign);
    float s1 = __fadd_rn(sum, __fmul_rn(g, g));
    sum = s1;
    w = __fmaf_rn(__fdiv_rn(g, __fadd_rn(__fsqrt_rn(s1), c.eps)), c.alpha, w);
}

/* rowwise_prelude of one row, by its group of HE_CUDA_ROW_LANES lanes
 * (lane = the caller's lane in it; n = the row's length, 0 where the group
 * has no row, which still takes part: the shuffles need every lane of the
 * warp): the row's accumulator *sum updated and the step its columns take
 * returned, to every lane.
 *
 * The order is mean_square's, which the bits depend on: lane l sums the
 * squares of columns l, l + 8, ... in column order, from 0 (the core's
 * lane l exactly, its tail included: a tail column j goes to lane j % 8
 * there too); then the lanes are added ((0+1)+(2+3))+((4+5)+(6+7)), which
 * is what the xor butterfly does at lane 0: distance 1 pairs (0,1) (2,3)
 * ..., distance 2 pairs those sums, distance 4 the two halves, each time
 * with lane 0's operand first, as the core's. The other lanes add the same
 * pairs the other way round, the same bits (float addition commutes), so
 * every lane has the total without another shuffle. Then sum += total /
 * dim and step = -(lr / (sqrt(sum) + eps)) * sign, as rowwise_prelude. */
static __device__ __forceinline__ float he_rowwise_step(float *sum, const float *g, int64_t n, int lane,
                                                        const he_cuda_optim_consts &c)
{
    float old = n > 0 ? *sum : 0.0f;
    float squares = 0.0f;
    for (int64_t j = lane; j < n; j += HE_CUDA_ROW_LANES)
        squares = __fadd_rn(squares, __fmul_rn(g[j], g[j]));
#pragma unroll
    for (int d = 1; d < HE_CUDA_ROW_LANES; d *= 2)
        squares = __fadd_rn(squares, __shfl_xor_sync(0xFFFFFFFFu, squares, d, HE_CUDA_ROW_LANES));
    float total = __fadd_rn(old, __fdiv_rn(squares, c.dim));
    /* Every lane of the group has read the old value before lane 0 writes
     * the new one (__syncwarp orders the memory accesses, not only the lanes). */
    __syncwarp(0xFFFFFFFFu);
    if (n > 0 && lane == 0)
        *sum = total;
    return __fmul_rn(-__fdiv_rn(c.lr, __fadd_rn(__fsqrt_rn(total), c.eps)), c.sign);
}

/* Each gradient row's update where its row is now, as adam_cached: its
 * slot if the cache holds it (he_cache_entry_slot1 != 0), else its host
 * row over the mapping. a: the weight [*, dim], then Adagrad's sum
 * [*, dim] or row-wise Adagrad's row_sum [*, 1] (SGD has no state).
 *
 * One kernel, the optimizer a per-row variation: a group of
 * HE_CUDA_ROW_LANES lanes a row, lane l holding columns l, l + 8, ...,
 * which is row-wise Adagrad's summation order (above) and serves the
 * element-wise rules as well as any. The loop runs as many times in every
 * lane of a warp (its four groups take rows k0 .. k0 + 3 together), so
 * that the whole warp meets at row-wise Adagrad's shuffles. */
__global__ void optim_cached(he_cuda_cache_arrays a, const uint32_t *__restrict__ entry,
                             const int64_t *__restrict__ indices, const float *__restrict__ values, int64_t nnz,
                             he_cuda_optim_consts c)
{
    const int64_t per_warp = HE_CUDA_WARP / HE_CUDA_ROW_LANES;
    int lane = (int)(threadIdx.x % HE_CUDA_ROW_LANES);
    int64_t group = he_thread_index() / HE_CUDA_ROW_LANES, groups = he_thread_count() / HE_CUDA_ROW_LANES;
    int64_t in_warp = group % per_warp;
    for (int64_t k0 = group - in_warp; k0 < nnz; k0 += groups) {
        int64_t k = k0 + in_warp;
        bool live = k < nnz;
        int64_t row = live ? indices[k] : 0, n = live ? a.dim : 0;
        uint32_t s1 = live ? he_cache_entry_slot1(entry[row]) : 0;
        int64_t r = s1 ? (int64_t)(s1 - 1) : row;
        float *w = (s1 ? a.records[0] : a.host[0]) + r * a.dim;
        const float *g = values + (live ? k : 0) * a.dim;
        if (c.kind == HE_OPTIM_ROWWISE_ADAGRAD) {
            float step = he_rowwise_step((s1 ? a.records[1] : a.host[1]) + r, g, n, lane, c);
            for (int64_t j = lane; j < n; j += HE_CUDA_ROW_LANES)
                w[j] = __fadd_rn(w[j], __fmul_rn(g[j], step));
        } else if (c.kind == HE_OPTIM_ADAGRAD) {
            float *sum = (s1 ? a.records[1] : a.host[1]) + r * a.dim;
            for (int64_t j = lane; j < n; j += HE_CUDA_ROW_LANES)
                he_adagrad_element(g[j], w[j], sum[j], c);
        } else {
            for (int64_t j = lane; j < n; j += HE_CUDA_ROW_LANES)
                w[j] = __fmaf_rn(g[j], c.alpha, w[j]);
        }
    }
}

#endif
