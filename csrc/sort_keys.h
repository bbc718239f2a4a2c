/* Ordering distinct 64-bit keys: the row cache's planner pairs its misses
 * and its victims by keys whose order is total (include/he_cache_policy.h),
 * so what it needs is the k smallest of n keys, ascending. */
#ifndef HE_SORT_KEYS_H
#define HE_SORT_KEYS_H

#include <stdint.h>

/* keys[0..n) ascending; tmp has room for n keys. */
void he_sort_keys(uint64_t *keys, uint64_t *tmp, int64_t n);

/* Reorders keys[0..n) so that keys[0..k) are its k smallest, ascending
 * (0 <= k <= n); tmp has room for k keys. Expected time linear in n plus
 * the sort of k. */
void he_smallest_keys(uint64_t *keys, uint64_t *tmp, int64_t n, int64_t k);

#endif
