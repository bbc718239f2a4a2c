/* What cache.cu (the records) and cache_plan.cu (the planner) share: the
 * checks of a GPU cache's state, and how kernels add to its counters. */
#ifndef HE_CUDA_CACHE_CUH
#define HE_CUDA_CACHE_CUH

#include "he_cache_policy.h"
#include "he_cuda_common.cuh"

static inline he_status he_cuda_check_cache(const he_cuda_cache *c)
{
    if (c->num_rows < 0 || c->capacity < 1 || c->capacity >= (int64_t)HE_CACHE_SLOT_MASK ||
        (c->protect != 1 && c->protect != 2) || (c->policy != HE_CACHE_CLOCK && c->policy != HE_CACHE_FREQUENCY))
        return he_fail(HE_ERR_VALUE,
                       "a GPU cache needs num_rows >= 0, 1 <= capacity < %lld, protect 1 or 2 and policy %d (clock) "
                       "or %d (frequency), got %lld, %lld, %d and %d",
                       (long long)HE_CACHE_SLOT_MASK, HE_CACHE_CLOCK, HE_CACHE_FREQUENCY, (long long)c->num_rows,
                       (long long)c->capacity, c->protect, c->policy);
    if (c->policy == HE_CACHE_FREQUENCY && (!c->count || !c->last || !c->turned_at || !c->slot_count))
        return he_fail(HE_ERR_VALUE, "a GPU cache of the frequency policy needs its count, last, turned_at and "
                                     "slot_count arrays");
    return HE_OK;
}

/* Warp-aggregated count: one atomic per group of converged lanes (on the
 * host twin, device_shim.h's threads, one atomic each). */
static __device__ __forceinline__ void he_cuda_count_add(int64_t *counter, unsigned value)
{
#if defined(__CUDA_ARCH__)
    unsigned mask = __activemask();
    unsigned sum = __reduce_add_sync(mask, value);
    if ((threadIdx.x & (HE_CUDA_WARP - 1)) == (unsigned)(__ffs(mask) - 1) && sum)
        atomicAdd((unsigned long long *)counter, (unsigned long long)sum);
#else
    if (value)
        __atomic_fetch_add(counter, (int64_t)value, __ATOMIC_RELAXED);
#endif
}

#endif
