#include "cache_plan.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "he_cache_policy.h"
#include "thread_pool.h"

struct he_cache {
    int64_t num_rows;
    int64_t capacity;
    int protect;
    /* Per row: its entry (include/he_cache_policy.h). One word a row, so
     * the pass over a batch reads and writes one place per row; calloc'd,
     * so the rows never used cost no memory. */
    uint32_t *entry;
    int64_t *row_of;     /* [capacity]; -1: empty */
    int64_t *used_at;    /* [capacity]: the last batch that used the slot */
    uint8_t *referenced; /* [capacity]: CLOCK's second chance */
    int64_t hand;
    int64_t batch;       /* batches planned */
    /* The last batch's bypassed rows, ascending: a fetch of one of them
     * must see that batch's update (fetch_after_update). The batch being
     * planned lists its own in next_bypass; the two swap after. */
    int64_t *bypass, *next_bypass;
    int64_t num_bypass;
    int64_t bypass_room;
    he_cache_stats stats;
};

he_status he_cache_new(int64_t num_rows, int64_t capacity, int protect, he_cache **out)
{
    *out = NULL;
    if (num_rows < 0 || capacity < 1 || capacity >= (int64_t)HE_CACHE_SLOT_MASK || (protect != 1 && protect != 2))
        return he_fail(HE_ERR_VALUE,
                       "a cache needs num_rows >= 0, 1 <= capacity < %" PRId64 " and protect 1 or 2, got %" PRId64
                       ", %" PRId64 " and %d",
                       (int64_t)HE_CACHE_SLOT_MASK, num_rows, capacity, protect);
    he_cache *c = calloc(1, sizeof *c);
    if (!c)
        return he_fail(HE_ERR_NOMEM, "could not allocate a cache");
    c->num_rows = num_rows;
    c->capacity = capacity;
    c->protect = protect;
    c->entry = calloc((size_t)(num_rows > 0 ? num_rows : 1), sizeof *c->entry);
    c->row_of = malloc((size_t)capacity * sizeof *c->row_of);
    c->used_at = malloc((size_t)capacity * sizeof *c->used_at);
    c->referenced = calloc((size_t)capacity, 1);
    if (!c->entry || !c->row_of || !c->used_at || !c->referenced) {
        he_cache_free(c);
        return he_fail(HE_ERR_NOMEM, "could not allocate a cache of %" PRId64 " slots for %" PRId64 " rows",
                       capacity, num_rows);
    }
    for (int64_t s = 0; s < capacity; s++) {
        c->row_of[s] = -1;
        c->used_at[s] = -1;
    }
    *out = c;
    return HE_OK;
}

void he_cache_free(he_cache *c)
{
    if (!c)
        return;
    free(c->entry);
    free(c->row_of);
    free(c->used_at);
    free(c->referenced);
    free(c->bypass);
    free(c->next_bypass);
    free(c);
}

he_status he_cache_plan_init(he_cache_plan *plan, int64_t max_unique)
{
    memset(plan, 0, sizeof *plan);
    if (max_unique < 0)
        return he_fail(HE_ERR_VALUE, "a plan needs max_unique >= 0, got %" PRId64, max_unique);
    size_t n = (size_t)(max_unique > 0 ? max_unique : 1);
    plan->max_unique = max_unique;
    plan->slot = malloc(n * sizeof *plan->slot);
    plan->fetch_row = malloc(n * sizeof *plan->fetch_row);
    plan->fetch_slot = malloc(n * sizeof *plan->fetch_slot);
    plan->fetch_after_update = malloc(n);
    plan->evict_slot = malloc(n * sizeof *plan->evict_slot);
    plan->evict_row = malloc(n * sizeof *plan->evict_row);
    if (!plan->slot || !plan->fetch_row || !plan->fetch_slot || !plan->fetch_after_update || !plan->evict_slot ||
        !plan->evict_row) {
        he_cache_plan_free(plan);
        return he_fail(HE_ERR_NOMEM, "could not allocate a cache plan for %" PRId64 " rows", max_unique);
    }
    return HE_OK;
}

void he_cache_plan_free(he_cache_plan *plan)
{
    free(plan->slot);
    free(plan->fetch_row);
    free(plan->fetch_slot);
    free(plan->fetch_after_update);
    free(plan->evict_slot);
    free(plan->evict_row);
    memset(plan, 0, sizeof *plan);
}

enum { AHEAD_ENTRY = 16, AHEAD_SLOT = 8 }; /* prefetch distances, in rows and slots */

/* The slot the hand settles on for a miss whose entry is miss_entry
 * (include/he_cache_policy.h says how): an empty one (*evicted = -1), or
 * an occupied one whose row is evicted (*evicted), if the policy admits
 * the miss; -2 when it does not (the miss bypasses the cache, the slot
 * keeps its row); -1 once the batch's rounds are spent. Every slot the
 * hand meets counts against *visits, settled on or not: the GPU's planner
 * decides a round of the hand at once, and the two stop at the same place. */
static int64_t take_slot(he_cache *c, uint32_t miss_entry, int64_t *visits, int64_t *evicted)
{
    for (;;) {
        if (*visits <= 0)
            return -1;
        (*visits)--;
        int64_t s = c->hand;
        c->hand = s + 1 == c->capacity ? 0 : s + 1;
        /* An evicted row's entry is read and written at random: ask for
         * the entry of the row a few slots on. */
        int64_t ahead = (s + AHEAD_SLOT) % c->capacity;
        if (c->row_of[ahead] >= 0)
            __builtin_prefetch(&c->entry[c->row_of[ahead]], 1);
        int64_t row = c->row_of[s];
        if (!he_cache_eligible(row, c->used_at[s], c->referenced[s], c->batch, c->protect)) {
            if (he_cache_loses_reference(row, c->used_at[s], c->referenced[s], c->batch, c->protect))
                c->referenced[s] = 0;
            continue;
        }
        if (!he_cache_admits(miss_entry, row, row >= 0 ? c->entry[row] : 0))
            return -2;
        *evicted = row;
        return s;
    }
}

/* The pass over a batch's rows: each row's use counted, its slot looked
 * up, and a hit's slot stamped as in use. Rows are distinct, so are their
 * entries and slots: threads never write one place. The entries and slots
 * are far bigger than the CPU's caches and read at random; two prefetch
 * stages (the row's entry, then its slot's) overlap the waits. */
typedef struct hits_job {
    he_cache *c;
    const int64_t *unique;
    int32_t *slot;
} hits_job;

static void hits_range(void *ctx, int64_t begin, int64_t end)
{
    const hits_job *job = ctx;
    he_cache *c = job->c;
    const int64_t *unique = job->unique;
    for (int64_t k = begin; k < end; k++) {
        if (k + AHEAD_ENTRY < end)
            __builtin_prefetch(&c->entry[unique[k + AHEAD_ENTRY]], 1);
        if (k + AHEAD_SLOT < end) {
            uint32_t ahead = he_cache_entry_slot1(c->entry[unique[k + AHEAD_SLOT]]);
            if (ahead) {
                __builtin_prefetch(&c->used_at[ahead - 1], 1);
                __builtin_prefetch(&c->referenced[ahead - 1], 1);
            }
        }
        uint32_t *e = &c->entry[unique[k]];
        *e = he_cache_entry_used(*e);
        uint32_t s1 = he_cache_entry_slot1(*e);
        job->slot[k] = (int32_t)s1 - 1;
        if (s1) {
            c->used_at[s1 - 1] = c->batch;
            c->referenced[s1 - 1] = 1;
        }
    }
}

static void age_range(void *ctx, int64_t begin, int64_t end)
{
    uint32_t *entry = ctx;
    for (int64_t r = begin; r < end; r++)
        entry[r] = he_cache_entry_aged(entry[r]);
}

he_status he_cache_plan_batch(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan)
{
    if (num_unique < 0 || num_unique > plan->max_unique)
        return he_fail(HE_ERR_VALUE, "a plan sized for %" PRId64 " rows cannot take a batch of %" PRId64,
                       plan->max_unique, num_unique);
    for (int64_t k = 0; k < num_unique; k++) {
        if ((uint64_t)unique[k] >= (uint64_t)c->num_rows)
            return he_fail(HE_ERR_INDEX, "row %" PRId64 " at %" PRId64 " is not in [0, %" PRId64 ")", unique[k], k,
                           c->num_rows);
        if (k > 0 && unique[k] <= unique[k - 1])
            return he_fail(HE_ERR_VALUE, "a batch's rows must be ascending and distinct, got %" PRId64
                           " after %" PRId64 " at %" PRId64, unique[k], unique[k - 1], k);
    }
    if (num_unique > c->bypass_room) { /* room for this batch's bypassed rows, before anything changes */
        int64_t *next = realloc(c->next_bypass, (size_t)num_unique * sizeof *next);
        if (next)
            c->next_bypass = next;
        int64_t *last = next ? realloc(c->bypass, (size_t)num_unique * sizeof *last) : NULL;
        if (!last)
            return he_fail(HE_ERR_NOMEM, "could not allocate a cache plan's lists of %" PRId64 " rows", num_unique);
        c->bypass = last;
        c->bypass_room = num_unique;
    }
    int64_t batch = ++c->batch;
    if (he_cache_ages(batch))
        he_parallel_for(c->num_rows, 1 << 16, age_range, c->entry);
    /* Hits first: they are protected before any miss looks for a slot. */
    hits_job job = {c, unique, plan->slot};
    he_parallel_for(num_unique, 4096, hits_range, &job);
    /* Then misses, ascending: each takes the slot the hand settles on. */
    int64_t visits = HE_CACHE_ROUNDS * c->capacity, prev = 0, num_bypass = 0, hits = 0;
    plan->num_fetch = plan->num_evict = 0;
    for (int64_t k = 0; k < num_unique; k++) {
        if (k + AHEAD_ENTRY < num_unique)
            __builtin_prefetch(&c->entry[unique[k + AHEAD_ENTRY]], 1);
        if (plan->slot[k] >= 0) {
            hits++;
            continue;
        }
        int64_t row = unique[k], evicted = -1;
        int64_t s = take_slot(c, c->entry[row], &visits, &evicted);
        if (s < 0) {
            c->next_bypass[num_bypass++] = row;
            continue;
        }
        if (evicted >= 0) {
            c->entry[evicted] = he_cache_entry_uncached(c->entry[evicted]);
            plan->evict_slot[plan->num_evict] = (int32_t)s;
            plan->evict_row[plan->num_evict++] = evicted;
        }
        c->entry[row] = he_cache_entry_with_slot(c->entry[row], s);
        c->row_of[s] = row;
        c->used_at[s] = batch;
        c->referenced[s] = 1;
        plan->slot[k] = (int32_t)s;
        /* Both lists ascend: one merge pass finds the rows bypassed last time. */
        while (prev < c->num_bypass && c->bypass[prev] < row)
            prev++;
        plan->fetch_row[plan->num_fetch] = row;
        plan->fetch_slot[plan->num_fetch] = (int32_t)s;
        plan->fetch_after_update[plan->num_fetch++] = prev < c->num_bypass && c->bypass[prev] == row;
    }
    int64_t *last = c->bypass;
    c->bypass = c->next_bypass;
    c->next_bypass = last;
    c->num_bypass = num_bypass;
    plan->num_unique = num_unique;
    c->stats.batches++;
    c->stats.rows += num_unique;
    c->stats.hits += hits;
    c->stats.fetches += plan->num_fetch;
    c->stats.evictions += plan->num_evict;
    c->stats.bypassed += num_bypass;
    return HE_OK;
}

int32_t he_cache_slot_of(const he_cache *c, int64_t row)
{
    return row >= 0 && row < c->num_rows ? (int32_t)he_cache_entry_slot1(c->entry[row]) - 1 : -1;
}

he_status he_cache_slots_of(const he_cache *c, const int64_t *rows, int64_t n, int32_t *slots)
{
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)rows[i] >= (uint64_t)c->num_rows)
            return he_fail(HE_ERR_INDEX, "row %" PRId64 " at %" PRId64 " is not in [0, %" PRId64 ")", rows[i], i,
                           c->num_rows);
    for (int64_t i = 0; i < n; i++)
        slots[i] = (int32_t)he_cache_entry_slot1(c->entry[rows[i]]) - 1;
    return HE_OK;
}

int64_t he_cache_row_of(const he_cache *c, int32_t slot)
{
    return slot >= 0 && slot < c->capacity ? c->row_of[slot] : -1;
}

int64_t he_cache_capacity(const he_cache *c)
{
    return c->capacity;
}

he_cache_stats he_cache_get_stats(const he_cache *c)
{
    return c->stats;
}
