/* What nvcc gives a kernel and g++ does not, so that cuda/'s kernels,
 * their own source, run on the host: one std::thread a lane, a warp's
 * lanes meeting on a barrier where the GPU's meet in one instruction.
 *
 * The real cuda_runtime.h comes first: under a host compiler it makes
 * __global__ and __device__ empty and __forceinline__ inline, and gives
 * float4, uint3, dim3 and the runtime's declarations he_cuda_common.cuh
 * names (never called here, so nothing links against CUDA). This adds
 * what it leaves to nvcc: the built-in indices and the intrinsics the
 * kernels use. The _rn intrinsics are IEEE single operations on the GPU;
 * here they are plain float operations, which are too as long as nothing
 * fuses them (-ffp-contract=off, and he_shim_rounds_alone checks it) and
 * float arithmetic is not done wider (FLT_EVAL_METHOD 0: SSE, not x87). */
#ifndef HE_DEVICE_SHIM_H
#define HE_DEVICE_SHIM_H

#if defined(__CUDACC__)
#error "device_shim.h is for a host compiler: nvcc has the real built-ins"
#endif

#include <cuda_runtime.h>

#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

static_assert(FLT_EVAL_METHOD == 0, "float operations must round to float, as the GPU's do");

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
/* One rounding, as the GPU's FFMA: glibc's fmaf is correctly rounded
 * (with or without the FMA instructions), as the core's own fmaf calls. */
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __uint_as_float(unsigned u)
{
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

/* Whether a product and a sum come out rounded each on its own: a build
 * that fused them (an FMA) would pass the twin test with the wrong bits. */
static inline bool he_shim_rounds_alone()
{
    volatile float a = 1.0f + 0x1p-12f, c = -1.0f; /* a * a is 1 + 2^-11 + 2^-24: a tie in float */
    return __fadd_rn(__fmul_rn(a, a), c) == 0x1p-11f;
}

/* A warp: its lanes' values for a reduction, and the barrier they meet on. */
struct he_shim_warp {
    std::barrier<> meet{32};
    unsigned value[32];
};

inline thread_local he_shim_warp *he_shim_my_warp;

/* A warp's reduction of its 32 lanes' values by `combine`. Every lane
 * must call it (a full mask), as on the GPU: a lane that never arrives
 * leaves the others waiting, which the caller's timeout reports. */
template <typename Combine>
static inline unsigned he_shim_reduce(unsigned mask, unsigned value, unsigned start, Combine combine)
{
    if (mask != 0xFFFFFFFFu)
        std::abort(); /* the barrier counts all 32 lanes */
    he_shim_warp &w = *he_shim_my_warp;
    w.value[threadIdx.x % 32] = value;
    w.meet.arrive_and_wait();
    unsigned out = start;
    for (unsigned v : w.value)
        out = combine(out, v);
    /* No lane writes its next reduction's value before every lane read this one's. */
    w.meet.arrive_and_wait();
    return out;
}

static inline unsigned __reduce_max_sync(unsigned mask, unsigned value)
{
    return he_shim_reduce(mask, value, 0u, [](unsigned a, unsigned b) { return a > b ? a : b; });
}

static inline unsigned __reduce_min_sync(unsigned mask, unsigned value)
{
    return he_shim_reduce(mask, value, ~0u, [](unsigned a, unsigned b) { return a < b ? a : b; });
}

static inline unsigned long long atomicMin(unsigned long long *address, unsigned long long value)
{
    unsigned long long seen = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (value < seen && !__atomic_compare_exchange_n(address, &seen, value, true, __ATOMIC_RELAXED,
                                                        __ATOMIC_RELAXED))
        ;
    return seen;
}

/* Lane (l ^ lane_mask)'s value within l's segment of `width` lanes (a
 * source outside it gives l its own value back, as the GPU does). Every
 * lane must call it, as for __reduce_max_sync. */
static inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width = 32)
{
    if (mask != 0xFFFFFFFFu || width < 1 || width > 32 || (width & (width - 1)))
        std::abort();
    he_shim_warp &w = *he_shim_my_warp;
    unsigned lane = threadIdx.x % 32, from = lane ^ (unsigned)lane_mask;
    w.value[lane] = __float_as_uint(value);
    w.meet.arrive_and_wait();
    unsigned got = from / (unsigned)width == lane / (unsigned)width ? w.value[from % 32] : w.value[lane];
    w.meet.arrive_and_wait();
    return __uint_as_float(got);
}

/* The warp's lanes meet; the barrier orders their memory accesses too, as
 * __syncwarp does. Every lane must call it. */
static inline void __syncwarp(unsigned mask = 0xFFFFFFFFu)
{
    if (mask != 0xFFFFFFFFu)
        std::abort();
    he_shim_my_warp->meet.arrive_and_wait();
}

/* kernel<<<grid, block>>>(), with `launch` calling it: a thread a lane,
 * all running at once (a barrier needs its whole warp alive). */
template <typename Launch>
void he_shim_launch(unsigned grid, unsigned block, Launch launch)
{
    if (block % 32 != 0)
        std::abort(); /* whole warps only: the reductions are over 32 lanes */
    std::vector<std::unique_ptr<he_shim_warp>> warps;
    for (unsigned w = 0; w < grid * block / 32; w++)
        warps.push_back(std::make_unique<he_shim_warp>());
    std::vector<std::thread> lanes;
    for (unsigned b = 0; b < grid; b++)
        for (unsigned t = 0; t < block; t++)
            lanes.emplace_back([&, b, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                blockDim = dim3(block);
                gridDim = dim3(grid);
                he_shim_my_warp = warps[(b * block + t) / 32].get();
                launch();
            });
    for (std::thread &lane : lanes)
        lane.join();
}

#endif
