/* What cache.cu (the records) and cache_plan.cu (the planner) both check
 * of a GPU cache's state. */
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

#endif
