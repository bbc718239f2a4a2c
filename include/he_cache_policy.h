/* The row cache's policy, one definition for its two planners: the CPU's
 * (csrc/cache_plan.c, one miss after another) and the GPU's
 * (cuda/cache.cu, every miss of a sweep at once). Both take these
 * functions, so what "eligible", "admitted" and "used lately" mean cannot
 * drift apart between them; the tests compare their plans batch by batch.
 *
 * A row's entry (one uint32 a row, the row -> slot map): slot + 1 in the
 * low HE_CACHE_SLOT_BITS bits (0: not cached), and above them how many
 * batches used the row lately (saturating, halved every
 * HE_CACHE_AGE_PERIOD batches).
 *
 * The sweep (CLOCK with frequency admission): the batch's misses, in
 * ascending row order, meet the slots in the order of a hand going round
 * them, from where the last batch left it. A slot is eligible when it is
 * empty, or neither protected (used by one of the last `protect` batches
 * planned, this one included) nor referenced since the hand last passed
 * it. Each miss meets the next eligible slot: it takes an empty one, takes
 * an occupied one (evicting its row) only if it was used more often lately
 * than that row, and else bypasses the cache (the slot keeps its row). A
 * referenced, unprotected slot the hand passes loses its reference (its
 * second chance). The hand goes round at most twice a batch; misses left
 * after that bypass the cache. Since eligibility within one round does
 * not depend on the decisions made in it (a slot is met once a round),
 * the GPU can decide a whole round at once: prefix sums rank the eligible
 * slots, and the i-th remaining miss meets the i-th. */
#ifndef HE_CACHE_POLICY_H
#define HE_CACHE_POLICY_H

#include <stdint.h>

#if defined(__CUDACC__)
#define HE_CACHE_FN static __host__ __device__ __forceinline__
#else
#define HE_CACHE_FN static inline
#endif

enum { HE_CACHE_SLOT_BITS = 28, HE_CACHE_AGE_PERIOD = 10, HE_CACHE_ROUNDS = 2 };
#define HE_CACHE_SLOT_MASK ((1u << HE_CACHE_SLOT_BITS) - 1u)
#define HE_CACHE_FREQ_MAX (0xffffffffu >> HE_CACHE_SLOT_BITS)

/* slot + 1, or 0 when the row is not cached */
HE_CACHE_FN uint32_t he_cache_entry_slot1(uint32_t e)
{
    return e & HE_CACHE_SLOT_MASK;
}

HE_CACHE_FN uint32_t he_cache_entry_freq(uint32_t e)
{
    return e >> HE_CACHE_SLOT_BITS;
}

HE_CACHE_FN uint32_t he_cache_entry_with_slot(uint32_t e, int64_t slot)
{
    return (e & ~HE_CACHE_SLOT_MASK) | (uint32_t)(slot + 1);
}

HE_CACHE_FN uint32_t he_cache_entry_uncached(uint32_t e)
{
    return e & ~HE_CACHE_SLOT_MASK;
}

/* A batch used the row: one more use, saturating. */
HE_CACHE_FN uint32_t he_cache_entry_used(uint32_t e)
{
    return he_cache_entry_freq(e) < HE_CACHE_FREQ_MAX ? e + (1u << HE_CACHE_SLOT_BITS) : e;
}

/* "Lately": every HE_CACHE_AGE_PERIOD batches each row's count halves. */
HE_CACHE_FN uint32_t he_cache_entry_aged(uint32_t e)
{
    return (e & HE_CACHE_SLOT_MASK) | ((he_cache_entry_freq(e) >> 1) << HE_CACHE_SLOT_BITS);
}

HE_CACHE_FN int he_cache_ages(int64_t batch)
{
    return batch % HE_CACHE_AGE_PERIOD == 0;
}

HE_CACHE_FN int he_cache_protected(int64_t used_at, int64_t batch, int protect)
{
    return used_at > batch - protect;
}

/* Whether the hand settles on a slot holding `row` (-1: empty). */
HE_CACHE_FN int he_cache_eligible(int64_t row, int64_t used_at, uint8_t referenced, int64_t batch, int protect)
{
    return row < 0 || (!he_cache_protected(used_at, batch, protect) && !referenced);
}

/* Whether the hand, passing a slot it does not settle on, takes its
 * second chance away. */
HE_CACHE_FN int he_cache_loses_reference(int64_t row, int64_t used_at, uint8_t referenced, int64_t batch,
                                         int protect)
{
    return row >= 0 && !he_cache_protected(used_at, batch, protect) && referenced;
}

/* Whether a miss (its entry) takes an eligible slot holding `occupant`
 * (-1: empty; else occupant_entry is that row's entry). */
HE_CACHE_FN int he_cache_admits(uint32_t miss_entry, int64_t occupant, uint32_t occupant_entry)
{
    return occupant < 0 || he_cache_entry_freq(miss_entry) > he_cache_entry_freq(occupant_entry);
}

#endif
