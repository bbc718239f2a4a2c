#include "cache_plan.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "thread_pool.h"

enum { ENTRY_SLOT_BITS = 28, AGE_PERIOD = 10 };
#define ENTRY_SLOT_MASK ((1u << ENTRY_SLOT_BITS) - 1u)
#define ENTRY_FREQ_MAX (UINT32_MAX >> ENTRY_SLOT_BITS)

static inline uint32_t entry_slot_plus1(uint32_t e)
{
    return e & ENTRY_SLOT_MASK;
}

static inline uint32_t entry_freq(uint32_t e)
{
    return e >> ENTRY_SLOT_BITS;
}

struct he_cache {
    int64_t num_rows;
    int64_t capacity;
    int protect;
    /* Per row: slot + 1 in the low ENTRY_SLOT_BITS bits (0 when not
     * cached) and, above them, how often the row was used lately (batches
     * using it, saturating, halved every AGE_PERIOD batches). One word a
     * row, so the pass over a batch reads and writes one place per row;
     * calloc'd, so the rows never used cost no memory. */
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
    if (num_rows < 0 || capacity < 1 || capacity >= (int64_t)ENTRY_SLOT_MASK || (protect != 1 && protect != 2))
        return he_fail(HE_ERR_VALUE,
                       "a cache needs num_rows >= 0, 1 <= capacity < %" PRId64 " and protect 1 or 2, got %" PRId64
                       ", %" PRId64 " and %d",
                       (int64_t)ENTRY_SLOT_MASK, num_rows, capacity, protect);
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

/* The slot the CLOCK hand settles on for a miss used `freq` times lately:
 * an empty one (*evicted = -1), or the next unprotected one without its
 * second chance, whose row is evicted (*evicted) if the miss was used
 * more often lately; else the row stays and the miss bypasses the cache
 * (-2). -1 once the batch's sweep budget is spent. */
static int64_t take_slot(he_cache *c, uint32_t freq, int64_t *budget, int64_t *evicted)
{
    /* The budget counts the slots passed over, not the one settled on: a
     * miss turned away costs the batch's later misses no sweep. */
    for (;; (*budget)--) {
        if (*budget <= 0)
            return -1;
        int64_t s = c->hand;
        c->hand = s + 1 == c->capacity ? 0 : s + 1;
        /* An evicted row's entry is read and written at random: ask for
         * the entry of the row a few slots on. */
        int64_t ahead = (s + AHEAD_SLOT) % c->capacity;
        if (c->row_of[ahead] >= 0)
            __builtin_prefetch(&c->entry[c->row_of[ahead]], 1);
        if (c->row_of[s] < 0) {
            *evicted = -1;
            return s;
        }
        if (c->used_at[s] > c->batch - c->protect)
            continue; /* in use by a batch in flight, or by this one */
        if (c->referenced[s]) {
            c->referenced[s] = 0;
            continue;
        }
        if (entry_freq(c->entry[c->row_of[s]]) >= freq)
            return -2;
        *evicted = c->row_of[s];
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
            uint32_t ahead = entry_slot_plus1(c->entry[unique[k + AHEAD_SLOT]]);
            if (ahead) {
                __builtin_prefetch(&c->used_at[ahead - 1], 1);
                __builtin_prefetch(&c->referenced[ahead - 1], 1);
            }
        }
        uint32_t *e = &c->entry[unique[k]];
        if (entry_freq(*e) < ENTRY_FREQ_MAX)
            *e += 1u << ENTRY_SLOT_BITS;
        uint32_t s1 = entry_slot_plus1(*e);
        job->slot[k] = (int32_t)s1 - 1;
        if (s1) {
            c->used_at[s1 - 1] = c->batch;
            c->referenced[s1 - 1] = 1;
        }
    }
}

/* Every AGE_PERIOD batches each row's frequency halves: "lately". */
static void age_range(void *ctx, int64_t begin, int64_t end)
{
    uint32_t *entry = ctx;
    for (int64_t r = begin; r < end; r++)
        entry[r] = (entry[r] & ENTRY_SLOT_MASK) | ((entry_freq(entry[r]) >> 1) << ENTRY_SLOT_BITS);
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
    if (batch % AGE_PERIOD == 0)
        he_parallel_for(c->num_rows, 1 << 16, age_range, c->entry);
    /* Hits first: they are protected before any miss looks for a slot. */
    hits_job job = {c, unique, plan->slot};
    he_parallel_for(num_unique, 4096, hits_range, &job);
    /* Then misses, ascending: each takes the slot the hand settles on. */
    int64_t budget = 3 * c->capacity, prev = 0, num_bypass = 0, hits = 0;
    plan->num_fetch = plan->num_evict = 0;
    for (int64_t k = 0; k < num_unique; k++) {
        if (k + AHEAD_ENTRY < num_unique)
            __builtin_prefetch(&c->entry[unique[k + AHEAD_ENTRY]], 1);
        if (plan->slot[k] >= 0) {
            hits++;
            continue;
        }
        int64_t row = unique[k], evicted = -1;
        int64_t s = take_slot(c, entry_freq(c->entry[row]), &budget, &evicted);
        if (s < 0) {
            c->next_bypass[num_bypass++] = row;
            continue;
        }
        if (evicted >= 0) {
            c->entry[evicted] &= ~ENTRY_SLOT_MASK;
            plan->evict_slot[plan->num_evict] = (int32_t)s;
            plan->evict_row[plan->num_evict++] = evicted;
        }
        c->entry[row] = (c->entry[row] & ~ENTRY_SLOT_MASK) | ((uint32_t)s + 1);
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
    return row >= 0 && row < c->num_rows ? (int32_t)entry_slot_plus1(c->entry[row]) - 1 : -1;
}

he_status he_cache_slots_of(const he_cache *c, const int64_t *rows, int64_t n, int32_t *slots)
{
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)rows[i] >= (uint64_t)c->num_rows)
            return he_fail(HE_ERR_INDEX, "row %" PRId64 " at %" PRId64 " is not in [0, %" PRId64 ")", rows[i], i,
                           c->num_rows);
    for (int64_t i = 0; i < n; i++)
        slots[i] = (int32_t)entry_slot_plus1(c->entry[rows[i]]) - 1;
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
