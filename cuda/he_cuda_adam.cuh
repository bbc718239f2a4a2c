/* SparseAdam's element update on the GPU, for the kernels that update
 * host rows through the pinned mapping (sparse_adam.cu) and a row cache's
 * records (cache.cu): csrc/sparse_adam.c's float32 operations in the same
 * order, each rounded on its own (the _rn intrinsics are never fused into
 * FMAs), sqrt and division correctly rounded: the CPU core's bits. */
#ifndef HE_CUDA_ADAM_CUH
#define HE_CUDA_ADAM_CUH

#include <cuda_runtime.h>

#include "he_cuda.h" /* he_adam.h, with the C linkage its functions have */

static __device__ __forceinline__ void he_adam_element(float g_in, float &w, float &m, float &v, const he_adam_consts &c)
{
    float g = __fmul_rn(g_in, c.sign);
    float u1 = __fmul_rn(__fsub_rn(g, m), c.one_minus_beta1);
    float u2 = __fmul_rn(__fsub_rn(__fmul_rn(g, g), v), c.one_minus_beta2);
    float m1 = __fadd_rn(m, u1);
    float v1 = __fadd_rn(v, u2);
    float denom = __fadd_rn(__fsqrt_rn(v1), c.eps);
    m = m1;
    v = v1;
    w = __fadd_rn(__fmul_rn(w, c.decay), __fmul_rn(__fdiv_rn(m1, denom), c.neg_step_size));
}

static __device__ __forceinline__ void he_adam_vector(float g, float &w, float &m, float &v, const he_adam_consts &c)
{
    he_adam_element(g, w, m, v, c);
}

static __device__ __forceinline__ void he_adam_vector(float4 g, float4 &w, float4 &m, float4 &v, const he_adam_consts &c)
{
    he_adam_element(g.x, w.x, m.x, v.x, c);
    he_adam_element(g.y, w.y, m.y, v.y, c);
    he_adam_element(g.z, w.z, m.z, v.z, c);
    he_adam_element(g.w, w.w, m.w, v.w, c);
}

#endif
