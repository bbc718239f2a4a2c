/* The row cache's policies, one definition for their two planners: the
 * CPU's (csrc/cache_plan.c) and the GPU's (cuda/cache.cu). Both take these
 * functions, so what "eligible", "admitted" and "used lately" mean cannot
 * drift apart between them; the tests compare their plans batch by batch.
 *
 * A row's entry (one uint32 a row, the row -> slot map): slot + 1 in the
 * low HE_CACHE_SLOT_BITS bits (0: not cached); the clock policy keeps a
 * count of recent uses above them.
 *
 * HE_CACHE_FREQUENCY (the default): a frequency cache with long memory.
 * Each row counts the batches that used it (16 bits, saturating, never
 * halved): the anchors replay a stream of 100 batches, and 77% of the rows
 * it touches are used by one batch of the 100, so a memory shorter than
 * the stream cannot tell them from the rows worth keeping (4-bit counts
 * halved every 10 batches kept 58.5% of a batch's rows at 80% of the
 * touched rows, where a static cache of the most used rows keeps 91.0%:
 * docs/results.md, "Against oracles on the anchors' streams").
 *   A batch's misses, most used first (then most recently used before,
 * then lower row), meet the eligible main slots (empty, or not used by
 * one of the last `protect` batches), least valuable first (empty, then
 * fewer uses; among rows used once, the least recently used first; among
 * rows used more, the most recently used first, since on a periodic
 * stream the row used longest ago is the one whose next use is nearest;
 * then lower slot). Both orders are total (he_cache_miss_key,
 * he_cache_victim_key), so any sort or selection gives the same pairs:
 * the CPU sorts, the GPU radix-sorts. The i-th miss takes the i-th slot if
 * he_cache_takes says so; else it is turned away.
 *   A window: a run of slots [0, window) at the front, a FIFO ring for the
 * misses turned away lately, whatever their counts. A row used by one
 * batch and back a few batches later (a fresh stream's recurring tail)
 * never wins a frequency contest in time; the window keeps it while that
 * pays. Its size is decided after each batch (he_cache_gate_update): open while
 * the rows turned away in the last HE_CACHE_GATE_SPAN batches come back
 * more often, per slot, than the least used main row is used; at most
 * HE_CACHE_GATE_PERCENT of the slots. On a replayed stream it stays shut.
 * Per row: the count, the batch of the last use and the batch it was last
 * turned away (10 bytes beyond the entry on the GPU; 12, one record a row,
 * in the CPU planner).
 *
 * HE_CACHE_CLOCK (the policy before it; the GPU fixture recorded on an
 * H200, tests/fixtures/gpu_cache_plans.pt, pins it): CLOCK with frequency
 * admission. The batch's misses, in ascending row order, meet the slots
 * in the order of a hand going round them, from where the last batch left
 * it. A slot is eligible when it is empty, or neither protected (used by
 * one of the last `protect` batches planned, this one included) nor
 * referenced since the hand last passed it. Each miss meets the next
 * eligible slot: it takes an empty one, takes an occupied one (evicting
 * its row) only if it was used more often lately than that row, and else
 * bypasses the cache (the slot keeps its row). A referenced, unprotected
 * slot the hand passes loses its reference (its second chance). The hand
 * goes round at most twice a batch; misses left after that bypass the
 * cache. Since eligibility within one round does not depend on the
 * decisions made in it (a slot is met once a round), the GPU can decide a
 * whole round at once: prefix sums rank the eligible slots, and the i-th
 * remaining miss meets the i-th. Counts: 4 bits, halved every
 * HE_CACHE_AGE_PERIOD batches. */
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

/* ---- HE_CACHE_FREQUENCY */

enum { HE_CACHE_CLOCK = 0, HE_CACHE_FREQUENCY = 1 };

enum {
    HE_CACHE_COUNT_MAX = 0xffff,
    HE_CACHE_AGE_BITS = 20,    /* ages in the sort keys saturate at 2^20 - 1 batches */
    HE_CACHE_KEY_INDEX_BITS = 28, /* the slot, or the miss's place in its batch */
    HE_CACHE_RECENCY_TIES = 1, /* counts up to this: ties go by recency */
    HE_CACHE_MARGIN = 1,       /* above it a miss needs this many uses more */
    HE_CACHE_GATE_SPAN = 3,    /* the window takes the rows turned away in the last 3 batches */
    HE_CACHE_GATE_PERCENT = 30
};
#define HE_CACHE_AGE_MAX ((1u << HE_CACHE_AGE_BITS) - 1u)
#define HE_CACHE_KEY_INDEX_MASK ((UINT64_C(1) << HE_CACHE_KEY_INDEX_BITS) - 1u)

HE_CACHE_FN uint64_t he_cache_age(int64_t batch, int64_t at)
{
    int64_t age = batch - at;
    return age < (int64_t)HE_CACHE_AGE_MAX ? (uint64_t)age : HE_CACHE_AGE_MAX;
}

/* A miss's place in the order the misses meet slots (ascending keys): most
 * uses first, then the most recent previous use (last: the batch of it, 0
 * for never; batches count from 1), then its place k in the batch (the
 * batch's rows ascend). */
HE_CACHE_FN uint64_t he_cache_miss_key(uint32_t count, uint32_t last, int64_t batch, int64_t k)
{
    return ((uint64_t)(HE_CACHE_COUNT_MAX - count) << (HE_CACHE_AGE_BITS + HE_CACHE_KEY_INDEX_BITS)) |
           (he_cache_age(batch, last) << HE_CACHE_KEY_INDEX_BITS) | (uint64_t)k;
}

/* An eligible slot's place in the order slots are offered (ascending
 * keys): empty ones (count 0) first, then fewer uses; among rows used
 * HE_CACHE_RECENCY_TIES times or fewer, the least recently used first;
 * above, the most recently used first; then the lower slot. used_at: the
 * batch that last used the slot's row. */
HE_CACHE_FN uint64_t he_cache_victim_key(uint32_t count, int64_t used_at, int64_t batch, int64_t slot)
{
    uint64_t age = count ? he_cache_age(batch, used_at) : 0;
    uint64_t recency = count > HE_CACHE_RECENCY_TIES ? age : (count ? HE_CACHE_AGE_MAX - age : 0);
    return ((uint64_t)count << (HE_CACHE_AGE_BITS + HE_CACHE_KEY_INDEX_BITS)) | (recency << HE_CACHE_KEY_INDEX_BITS) |
           (uint64_t)slot;
}

HE_CACHE_FN int64_t he_cache_key_index(uint64_t key)
{
    return (int64_t)(key & HE_CACHE_KEY_INDEX_MASK);
}

/* Whether a miss takes the slot it met: an empty one always; an occupied
 * one if the miss was used more, before this batch, than the occupant
 * (by more than HE_CACHE_MARGIN above HE_CACHE_RECENCY_TIES uses), or as
 * often up to HE_CACHE_RECENCY_TIES with its previous use (last) after the
 * occupant's (used_at). Counts before the batch: the occupant is not in
 * it, and a row is not worth more for being the one used now. A strict
 * order, so two rows never swap back and forth. */
HE_CACHE_FN int he_cache_takes(uint32_t miss_count, uint32_t miss_last, int64_t occupant, uint32_t occupant_count,
                               int64_t used_at)
{
    if (occupant < 0)
        return 1;
    uint32_t mine = miss_count - 1;
    uint32_t margin = occupant_count > HE_CACHE_RECENCY_TIES ? HE_CACHE_MARGIN : 0;
    if (mine > occupant_count + margin)
        return 1;
    return mine == occupant_count && occupant_count <= HE_CACHE_RECENCY_TIES && (int64_t)miss_last > used_at;
}

/* The window's gate, in fixed point (rates scaled by 2^32, integers so
 * that the two planners agree to the bit). */
typedef struct he_cache_gate {
    uint64_t reuse;  /* moving average: turned-away rows back, per one turned away */
    uint64_t main;   /* moving average: the least used main row's uses per batch */
    int64_t recent[HE_CACHE_GATE_SPAN]; /* rows turned away in each of the last batches, newest last */
} he_cache_gate;

HE_CACHE_FN int64_t he_cache_gate_recent(const he_cache_gate *g)
{
    int64_t sum = 0;
    for (int i = 0; i < HE_CACHE_GATE_SPAN; i++)
        sum += g->recent[i];
    return sum;
}

/* After a batch: `back` of its rows were turned away in the last
 * HE_CACHE_GATE_SPAN batches (before it), `turned` of its misses were
 * turned away now, and the least used main row has min_count uses
 * (0 when no main slot holds a row). Returns the window's slots for the
 * next batch. */
HE_CACHE_FN int64_t he_cache_gate_update(he_cache_gate *g, int64_t back, int64_t turned, uint32_t min_count,
                                         int64_t batch, int64_t capacity)
{
    int64_t recent = he_cache_gate_recent(g);
    if (recent > 0) {
        uint64_t back_rate = ((uint64_t)back << 32) / (uint64_t)recent;
        uint64_t main_rate = ((uint64_t)min_count << 32) / (uint64_t)batch;
        g->reuse = (4 * g->reuse + back_rate) / 5;
        g->main = (4 * g->main + main_rate) / 5;
    }
    for (int i = 0; i + 1 < HE_CACHE_GATE_SPAN; i++)
        g->recent[i] = g->recent[i + 1];
    g->recent[HE_CACHE_GATE_SPAN - 1] = turned;
    if (g->reuse <= g->main)
        return 0;
    int64_t most = capacity * HE_CACHE_GATE_PERCENT / 100, want = he_cache_gate_recent(g);
    return want < most ? want : most;
}

/* Whether a turned-away stamp (the batch it was turned away, 0: never)
 * is of the last HE_CACHE_GATE_SPAN batches before `batch`. */
HE_CACHE_FN int he_cache_turned_lately(uint32_t turned_at, int64_t batch)
{
    return turned_at != 0 && (int64_t)turned_at >= batch - HE_CACHE_GATE_SPAN;
}

#endif
