/* The planner of a row cache: which of a table's rows sit in which of
 * `capacity` slots (on a GPU: HBM records holding a row and its optimizer
 * state), and for each batch, what must move so that its rows are there.
 *
 * Host table ids are dense row numbers, so the planner needs no hash
 * table: slot_of[row] answers "cached, and where" with one load. This
 * planner runs on the CPU, one miss after another: it plans for caches of
 * host-memory records, and it is the host twin of the GPU's planner
 * (cuda/cache.cu), which keeps the same state in GPU memory and decides a
 * whole round of the hand at once. Both follow include/he_cache_policy.h
 * and make the same decisions (a GPU test compares them batch by batch).
 *
 * Policies (include/he_cache_policy.h says each): HE_CACHE_FREQUENCY,
 * the default, counts each row's uses over the whole stream and gives a
 * slot to a miss only over a row used less, with a window for rows that
 * come back soon; HE_CACHE_CLOCK, the policy before it, is CLOCK with 4-bit
 * counts halved every 10 batches (its GPU plans are recorded in
 * tests/fixtures/gpu_cache_plans.pt). Measured on the anchors' streams
 * (benchmarks/cache/cache_plan.py --protocol): at 80% of the rows dynamicemb's
 * stream touches, clock keeps 58.5% of a batch's rows, frequency 91%.
 * A slot used by one of the last `protect` batches planned (the one being
 * planned included) is never evicted: 1 when a batch is planned after the
 * previous step finished, 2 when it is planned a step ahead (look-ahead),
 * while the previous step may still read and update its slots. Misses the
 * policy does not place bypass the cache: they are read and updated in
 * host memory, as without a cache. */
#ifndef HE_CACHE_PLAN_H
#define HE_CACHE_PLAN_H

#include <stdint.h>

#include "he_status.h"

typedef struct he_cache he_cache;

typedef struct he_cache_stats {
    int64_t batches;
    int64_t rows;      /* unique rows planned */
    int64_t hits;      /* already in a slot */
    int64_t fetches;   /* misses given a slot (a record moved in) */
    int64_t evictions; /* records written back to make room */
    int64_t bypassed;  /* misses left in host memory */
} he_cache_stats;

/* One batch's plan, in arrays sized for max_unique rows (he_cache_plan_init).
 * Carried out in this order:
 *   1. evictions: slot evict_slot[i]'s record is written back to host row
 *      evict_row[i] (after every earlier step that used the slot is done:
 *      protect sees to it that none in flight did); listed in the order of
 *      the rows that take the slots, as the fetches (the GPU's order);
 *   2. fetches: host row fetch_row[i]'s record moves into fetch_slot[i]
 *      (after that slot's write-back). fetch_after_update[i] marks a row
 *      that the previous batch updated in host memory (it bypassed the
 *      cache then): planned a step ahead, that fetch waits for the
 *      previous step's update; the others may run while it computes;
 *   3. the batch: unique[k]'s row is in slot[k], or in host memory where
 *      slot[k] is -1. */
typedef struct he_cache_plan {
    int64_t max_unique;
    int64_t num_unique;
    int32_t *slot;                /* [max_unique] */
    int64_t num_fetch;
    int64_t *fetch_row;           /* [max_unique], ascending */
    int32_t *fetch_slot;          /* [max_unique] */
    uint8_t *fetch_after_update;  /* [max_unique] */
    int64_t num_evict;
    int32_t *evict_slot;          /* [max_unique] */
    int64_t *evict_row;           /* [max_unique] */
} he_cache_plan;

/* A cache of `capacity` slots (1 <= capacity < 2^28 - 1) for a table of
 * num_rows rows, every slot empty; protect is 1 or 2 (see above), policy
 * HE_CACHE_FREQUENCY or HE_CACHE_CLOCK. The frequency policy keeps 12
 * bytes a row more than the clock's 4 (allocated as rows are first used). */
he_status he_cache_new(int64_t num_rows, int64_t capacity, int protect, int policy, he_cache **out);
void he_cache_free(he_cache *c);

he_status he_cache_plan_init(he_cache_plan *plan, int64_t max_unique);
void he_cache_plan_free(he_cache_plan *plan);

/* Plans the batch whose unique rows are unique[0..num_unique), ascending
 * and distinct (as a Dedup gives them), each in [0, num_rows); at most
 * plan->max_unique. Anything else is refused (HE_ERR_VALUE, HE_ERR_INDEX)
 * with the cache unchanged; so is, with the frequency policy, a batch of
 * 2^28 rows or more, or any batch after 2^32 - 1 of them (its stamps are
 * 32-bit), and HE_ERR_NOMEM leaves it unchanged too. */
he_status he_cache_plan_batch(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan);

/* The slot holding `row`, or -1. */
int32_t he_cache_slot_of(const he_cache *c, int64_t row);

/* slots[i] = the slot holding rows[i], or -1: where an update of those rows
 * goes now (a gradient may span batches planned since). HE_ERR_INDEX for a
 * row outside the table, before anything is written. */
he_status he_cache_slots_of(const he_cache *c, const int64_t *rows, int64_t n, int32_t *slots);

/* The row in `slot`, or -1 (empty). */
int64_t he_cache_row_of(const he_cache *c, int32_t slot);

int64_t he_cache_capacity(const he_cache *c);
he_cache_stats he_cache_get_stats(const he_cache *c);

#endif
