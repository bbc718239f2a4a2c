/* Compact optimizer state on the GPU: csrc/convert.c's bfloat16 and
 * csrc/quantize.c's 8-bit block forms (roots coded, a scale a block),
 * decoded to float and encoded back with the CPU core's operations, each
 * rounded on its own and only ever to nearest (the CPU's stochastic
 * branch draws from a row's number, and a record's is its slot's): a row
 * cache's records updated on the GPU keep the bits the core would give
 * them. The kernels never include csrc/, so the block size is restated.
 *
 * cache.cu's kernel on compact moments is defined here too, not there, so
 * that tests/kernel_twin runs it on the host (g++, one thread a lane)
 * against the core without a GPU: include this header in one .cu only. */
#ifndef HE_CUDA_COMPACT_CUH
#define HE_CUDA_COMPACT_CUH

#include <cuda_runtime.h>

#include <stdint.h>

#include "he_cache_policy.h"
#include "he_cuda_adam.cuh"
#include "he_cuda_common.cuh"
#include "he_dtype.h"

/* csrc/quantize.h's HE_Q8_BLOCK (HE_REDUCE_BLOCK): the columns of a scale,
 * and of the CPU's update_blocks, a warp's unit here. */
#define HE_CUDA_Q8_BLOCK 256
#define HE_CUDA_Q8_PER_LANE (HE_CUDA_Q8_BLOCK / HE_CUDA_WARP)

/* convert.c's f32_to_bf16: torch's nearest even, NaN to the quiet 0x7FC0. */
static __device__ __forceinline__ uint16_t he_bf16_of_f32(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The value of element j of a compact row (he_q8_to_f32 for the 8-bit
 * forms, the code widened exactly: the product is the CPU's first). */
static __device__ __forceinline__ float he_compact_value(int dtype, const void *codes, int64_t j, float scale)
{
    if (dtype == HE_BF16)
        return __uint_as_float((uint32_t)((const uint16_t *)codes)[j] << 16);
    if (dtype == HE_Q8) {
        float r = __fmul_rn((float)((const int8_t *)codes)[j], scale);
        return __fmul_rn(r, fabsf(r));
    }
    float r = __fmul_rn((float)((const uint8_t *)codes)[j], scale);
    return __fmul_rn(__fmul_rn(r, r), __fmul_rn(r, r));
}

/* quantize.c's signed_root and fourth_root (sqrtf there is sqrtss,
 * correctly rounded, as __fsqrt_rn is). */
static __device__ __forceinline__ float he_q8_root(int dtype, float x)
{
    return dtype == HE_Q8 ? copysignf(__fsqrt_rn(fabsf(x)), x) : __fsqrt_rn(__fsqrt_rn(x));
}

/* encode_nearest of element j: x the value, root its root. */
static __device__ __forceinline__ void he_q8_store(int dtype, void *codes, int64_t j, float x, float root, float inv)
{
    float q = rintf(__fmul_rn(root, inv)); /* round half even, as the CPU's rintf */
    if (dtype == HE_Q8) {
        ((int8_t *)codes)[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        return;
    }
    float least = x > 0.0f ? 1.0f : 0.0f;
    q = q > 255.0f ? 255.0f : q;
    ((uint8_t *)codes)[j] = (uint8_t)(q < least ? least : q);
}

/* Columns [0, n) (n <= HE_CUDA_Q8_BLOCK) of one block of a compact row,
 * lane l of the warp holding columns l, l + 32, ... in x[j]: widened. */
static __device__ __forceinline__ void he_compact_load(int dtype, const void *codes, const float *scale, int lane,
                                                       int n, float (&x)[HE_CUDA_Q8_PER_LANE])
{
    float s = dtype == HE_BF16 ? 0.0f : *scale;
#pragma unroll
    for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++) {
        int col = lane + j * HE_CUDA_WARP;
        x[j] = col < n ? he_compact_value(dtype, codes, col, s) : 0.0f;
    }
}

/* The block stored back: bfloat16 element by element; an 8-bit form
 * requantized whole, as he_q8_from_f32 does: the largest root's bits (an
 * integer maximum, exact in any order, so one warp reduction gives the
 * CPU's) make the scale. The whole warp must call it. */
static __device__ __forceinline__ void he_compact_store(int dtype, void *codes, float *scale, int lane, int n,
                                                        const float (&x)[HE_CUDA_Q8_PER_LANE])
{
    if (dtype == HE_BF16) {
#pragma unroll
        for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++)
            if (lane + j * HE_CUDA_WARP < n)
                ((uint16_t *)codes)[lane + j * HE_CUDA_WARP] = he_bf16_of_f32(x[j]);
        return;
    }
    float root[HE_CUDA_Q8_PER_LANE];
    uint32_t peak = 0;
#pragma unroll
    for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++) {
        root[j] = he_q8_root(dtype, x[j]);
        uint32_t b = __float_as_uint(root[j]) & 0x7FFFFFFFu;
        peak = lane + j * HE_CUDA_WARP < n && b > peak ? b : peak;
    }
    peak = __reduce_max_sync(0xFFFFFFFFu, peak);
    float top = dtype == HE_Q8 ? 127.0f : 255.0f, m = __uint_as_float(peak);
    bool finite = peak < 0x7F800000u; /* no NaN or infinity (nor, for the fourth root, a negative value) */
    if (!finite || m == 0.0f) {
        if (lane == 0)
            *scale = finite ? 0.0f : __uint_as_float(0x7FC00000u); /* the CPU's NAN */
#pragma unroll
        for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++)
            if (lane + j * HE_CUDA_WARP < n)
                ((uint8_t *)codes)[lane + j * HE_CUDA_WARP] = 0;
        return;
    }
    if (lane == 0)
        *scale = __fdiv_rn(m, top);
    float inv = __fdiv_rn(top, m);
#pragma unroll
    for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++)
        if (lane + j * HE_CUDA_WARP < n)
            he_q8_store(dtype, codes, lane + j * HE_CUDA_WARP, x[j], root[j], inv);
}

/* adam_cached on compact moments: a warp a (row, block of
 * HE_CUDA_Q8_BLOCK columns), the CPU's unit, lane l holding columns l,
 * l + 32, ... of it in registers, so that an 8-bit moment's block is
 * requantized whole from its new values with one warp reduction. */
__global__ void adam_compact_cached(he_cuda_cache_compact a, const uint32_t *__restrict__ entry, int64_t blocks,
                                    const int64_t *__restrict__ indices, const float *__restrict__ values,
                                    int64_t items, he_adam_consts hc)
{
    int lane = threadIdx.x & (HE_CUDA_WARP - 1);
    int64_t warps = he_thread_count() / HE_CUDA_WARP;
    /* i is the same for the whole warp: every lane reaches the reduction. */
    for (int64_t i = he_thread_index() / HE_CUDA_WARP; i < items; i += warps) {
        int64_t k = i / blocks, block = i - k * blocks, row = indices[k], col = block * HE_CUDA_Q8_BLOCK;
        int n = (int)(a.dim - col < HE_CUDA_Q8_BLOCK ? a.dim - col : HE_CUDA_Q8_BLOCK);
        uint32_t s1 = he_cache_entry_slot1(entry[row]);
        char *base[HE_CUDA_COMPACT_ARRAYS];
#pragma unroll
        for (int x = 0; x < HE_CUDA_COMPACT_ARRAYS; x++)
            base[x] = (char *)(s1 ? a.records[x] : a.host[x]);
        int64_t r = s1 ? (int64_t)(s1 - 1) : row, at = r * a.dim + col;
        float *w = (float *)base[0] + at;
        char *mc = base[1] + at * (a.m_dtype == HE_BF16 ? 2 : 1), *vc = base[2] + at * (a.v_dtype == HE_BF16 ? 2 : 1);
        /* A bfloat16 moment has no scales (its pointer is NULL, never offset). */
        float *ms = a.m_dtype != HE_BF16 ? (float *)base[3] + r * blocks + block : NULL;
        float *vs = a.v_dtype != HE_BF16 ? (float *)base[4] + r * blocks + block : NULL;
        const float *g = values + k * a.dim + col;
        float m[HE_CUDA_Q8_PER_LANE], v[HE_CUDA_Q8_PER_LANE];
        he_compact_load(a.m_dtype, mc, ms, lane, n, m);
        he_compact_load(a.v_dtype, vc, vs, lane, n, v);
#pragma unroll
        for (int j = 0; j < HE_CUDA_Q8_PER_LANE; j++) {
            int c = lane + j * HE_CUDA_WARP;
            if (c < n) {
                float wv = w[c];
                he_adam_element(g[c], wv, m[j], v[j], hc);
                w[c] = wv;
            }
        }
        he_compact_store(a.m_dtype, mc, ms, lane, n, m);
        he_compact_store(a.v_dtype, vc, vs, lane, n, v);
    }
}

#endif
