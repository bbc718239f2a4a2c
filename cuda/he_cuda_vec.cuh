/* Element-wise float arithmetic on a float or a float4 (16-byte accesses
 * where rows are 16-byte aligned), every operation rounded on its own: the
 * _rn intrinsics are never fused into FMAs, whatever nvcc's -fmad says, so
 * the results match the CPU core's -ffp-contract=off build. */
#ifndef HE_CUDA_VEC_CUH
#define HE_CUDA_VEC_CUH

#include <cuda_runtime.h>

static __device__ __forceinline__ float he_mul(float a, float b)
{
    return __fmul_rn(a, b);
}

static __device__ __forceinline__ float he_add(float a, float b)
{
    return __fadd_rn(a, b);
}

static __device__ __forceinline__ float4 he_mul(float4 a, float b)
{
    return make_float4(__fmul_rn(a.x, b), __fmul_rn(a.y, b), __fmul_rn(a.z, b), __fmul_rn(a.w, b));
}

static __device__ __forceinline__ float4 he_add(float4 a, float4 b)
{
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

#endif
