#include "cache_plan.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "he_cache_policy.h"
#include "sort_keys.h"
#include "thread_pool.h"

typedef struct he_cache_use {
    uint32_t last, turned_at;
    uint16_t count;
} he_cache_use;

struct he_cache {
    int64_t num_rows;
    int64_t capacity;
    int protect;
    int policy;
    /* Per row: its entry (include/he_cache_policy.h). One word a row, so
     * the pass over a batch reads and writes one place per row; calloc'd,
     * so the rows never used cost no memory. */
    uint32_t *entry;
    int64_t *row_of;     /* [capacity]; -1: empty */
    int64_t *used_at;    /* [capacity]: the last batch that used the slot */
    uint8_t *referenced; /* [capacity]: CLOCK's second chance */
    int64_t hand;
    int64_t batch;       /* batches planned */
    /* HE_CACHE_FREQUENCY: per row, its uses, the batch of its last use and
     * the batch it was last turned away (0: never; calloc'd as entry), in
     * one place, so the pass over a batch meets one more line a row; per
     * slot, its row's uses (so the pass over the slots reads them in
     * order); the window's size and hand, its gate, and room for the keys
     * the batch sorts and its rows' uses as the pass found them. */
    he_cache_use *uses;
    he_cache_use *batch_uses; /* [bypass_room]: count after this batch's use, last and turned_at before */
    uint16_t *slot_count;
    int64_t window, window_hand;
    he_cache_gate gate;
    uint64_t *keys, *miss_keys, *sort_tmp; /* [capacity], [bypass_room], [max of both] */
    uint8_t *was_miss;                     /* [bypass_room] */
    int64_t *evicted_by;                   /* [bypass_room]: the row a miss's slot held, -1: none */
    /* The last batch's bypassed rows, ascending: a fetch of one of them
     * must see that batch's update (fetch_after_update). The batch being
     * planned lists its own in next_bypass; the two swap after. */
    int64_t *bypass, *next_bypass;
    int64_t num_bypass;
    int64_t bypass_room;
    he_cache_stats stats;
};

he_status he_cache_new(int64_t num_rows, int64_t capacity, int protect, int policy, he_cache **out)
{
    *out = NULL;
    if (num_rows < 0 || capacity < 1 || capacity >= (int64_t)HE_CACHE_SLOT_MASK || (protect != 1 && protect != 2) ||
        (policy != HE_CACHE_CLOCK && policy != HE_CACHE_FREQUENCY))
        return he_fail(HE_ERR_VALUE,
                       "a cache needs num_rows >= 0, 1 <= capacity < %" PRId64 ", protect 1 or 2 and policy %d "
                       "(clock) or %d (frequency), got %" PRId64 ", %" PRId64 ", %d and %d",
                       (int64_t)HE_CACHE_SLOT_MASK, HE_CACHE_CLOCK, HE_CACHE_FREQUENCY, num_rows, capacity, protect,
                       policy);
    he_cache *c = calloc(1, sizeof *c);
    if (!c)
        return he_fail(HE_ERR_NOMEM, "could not allocate a cache");
    c->num_rows = num_rows;
    c->capacity = capacity;
    c->protect = protect;
    c->policy = policy;
    size_t rows = (size_t)(num_rows > 0 ? num_rows : 1);
    c->entry = calloc(rows, sizeof *c->entry);
    c->row_of = malloc((size_t)capacity * sizeof *c->row_of);
    c->used_at = malloc((size_t)capacity * sizeof *c->used_at);
    c->referenced = calloc((size_t)capacity, 1);
    int frequency_ok = 1;
    if (policy == HE_CACHE_FREQUENCY) {
        c->uses = calloc(rows, sizeof *c->uses);
        c->slot_count = calloc((size_t)capacity, sizeof *c->slot_count);
        c->keys = malloc((size_t)capacity * sizeof *c->keys);
        c->sort_tmp = malloc((size_t)capacity * sizeof *c->sort_tmp);
        frequency_ok = c->uses && c->slot_count && c->keys && c->sort_tmp;
    }
    if (!c->entry || !c->row_of || !c->used_at || !c->referenced || !frequency_ok) {
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
    free(c->uses);
    free(c->batch_uses);
    free(c->slot_count);
    free(c->keys);
    free(c->miss_keys);
    free(c->sort_tmp);
    free(c->was_miss);
    free(c->evicted_by);
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

/* The clock policy's batch (include/he_cache_policy.h). */
static void plan_clock(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan,
                       int64_t *num_bypass, int64_t *hits)
{
    int64_t batch = c->batch;
    if (he_cache_ages(batch))
        he_parallel_for(c->num_rows, 1 << 16, age_range, c->entry);
    /* Hits first: they are protected before any miss looks for a slot. */
    hits_job job = {c, unique, plan->slot};
    he_parallel_for(num_unique, 4096, hits_range, &job);
    /* Then misses, ascending: each takes the slot the hand settles on. */
    int64_t visits = HE_CACHE_ROUNDS * c->capacity, prev = 0;
    for (int64_t k = 0; k < num_unique; k++) {
        if (k + AHEAD_ENTRY < num_unique)
            __builtin_prefetch(&c->entry[unique[k + AHEAD_ENTRY]], 1);
        if (plan->slot[k] >= 0) {
            (*hits)++;
            continue;
        }
        int64_t row = unique[k], evicted = -1;
        int64_t s = take_slot(c, c->entry[row], &visits, &evicted);
        if (s < 0) {
            c->next_bypass[(*num_bypass)++] = row;
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
}

/* ---- the frequency policy (include/he_cache_policy.h) */

/* The pass over a batch's rows: one more use each (its last use now this
 * batch), the slot looked up, a hit's slot stamped in use, and what the
 * rest of the plan needs of the row kept in batch_uses[k] (read here once:
 * the rows are far bigger than the CPU's caches and met at random), and
 * the rows turned away lately counted. Rows are distinct: threads never
 * write one place. */
typedef struct touch_job {
    he_cache *c;
    const int64_t *unique;
    int32_t *slot;
    _Atomic int64_t back;
} touch_job;

static void frequency_touch_range(void *ctx, int64_t begin, int64_t end)
{
    touch_job *job = ctx;
    he_cache *c = job->c;
    const int64_t *unique = job->unique;
    int64_t batch = c->batch, back = 0;
    for (int64_t k = begin; k < end; k++) {
        if (k + AHEAD_ENTRY < end) {
            __builtin_prefetch(&c->entry[unique[k + AHEAD_ENTRY]], 1);
            __builtin_prefetch(&c->uses[unique[k + AHEAD_ENTRY]], 1);
        }
        int64_t row = unique[k];
        he_cache_use *u = &c->uses[row];
        if (u->count < HE_CACHE_COUNT_MAX)
            u->count++;
        back += he_cache_turned_lately(u->turned_at, batch);
        c->batch_uses[k] = *u;
        u->last = (uint32_t)batch;
        uint32_t s1 = he_cache_entry_slot1(c->entry[row]);
        job->slot[k] = (int32_t)s1 - 1;
        if (s1) {
            c->used_at[s1 - 1] = batch;
            c->slot_count[s1 - 1] = u->count;
        }
    }
    atomic_fetch_add_explicit(&job->back, back, memory_order_relaxed);
}

/* Listed in the plan later, in the misses' order (as the GPU lists them). */
static void frequency_place(he_cache *c, he_cache_plan *plan, int64_t k, int64_t row, int64_t s)
{
    int64_t occupant = c->row_of[s];
    c->evicted_by[k] = occupant;
    if (occupant >= 0)
        c->entry[occupant] = he_cache_entry_uncached(c->entry[occupant]);
    c->entry[row] = he_cache_entry_with_slot(c->entry[row], s);
    c->row_of[s] = row;
    c->used_at[s] = c->batch;
    c->slot_count[s] = c->batch_uses[k].count;
    plan->slot[k] = (int32_t)s;
}

/* The pass over the main slots, in parallel: each slot's victim key
 * (UINT64_MAX for one in use: it sorts last) and how many are eligible. */
typedef struct victims_job {
    he_cache *c;
    _Atomic int64_t eligible;
} victims_job;

static void victim_keys_range(void *ctx, int64_t begin, int64_t end)
{
    victims_job *job = ctx;
    he_cache *c = job->c;
    int64_t batch = c->batch, eligible = 0;
    for (int64_t i = begin; i < end; i++) { /* the i-th main slot */
        int64_t s = c->window + i;
        int occupied = c->row_of[s] >= 0;
        uint64_t key = UINT64_MAX;
        if (!occupied || !he_cache_protected(c->used_at[s], batch, c->protect)) {
            key = he_cache_victim_key(occupied ? c->slot_count[s] : 0, c->used_at[s], batch, s);
            eligible++;
        }
        c->keys[i] = key;
    }
    atomic_fetch_add_explicit(&job->eligible, eligible, memory_order_relaxed);
}

/* The misses, most valuable first, against the eligible main slots, least
 * valuable first: the i-th takes the i-th if he_cache_takes says so. */
static void frequency_pairs(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan)
{
    int64_t batch = c->batch, misses = 0, main = c->capacity - c->window;
    for (int64_t k = 0; k < num_unique; k++)
        if (c->was_miss[k]) {
            c->miss_keys[misses++] = he_cache_miss_key(c->batch_uses[k].count, c->batch_uses[k].last, batch, k);
        }
    if (misses == 0 || main == 0)
        return;
    victims_job job = {.c = c};
    atomic_init(&job.eligible, 0);
    he_parallel_for_bytes(main, 1 << 14, main * 18, victim_keys_range, &job);
    int64_t eligible = atomic_load(&job.eligible);
    int64_t pairs = misses < eligible ? misses : eligible;
    if (pairs == 0)
        return;
    he_smallest_keys(c->keys, c->sort_tmp, main, pairs);
    he_sort_keys(c->miss_keys, c->sort_tmp, misses);
    for (int64_t i = 0; i < pairs; i++) {
        int64_t k = he_cache_key_index(c->miss_keys[i]), s = he_cache_key_index(c->keys[i]), row = unique[k];
        int64_t occupant = c->row_of[s];
        const he_cache_use *u = &c->batch_uses[k];
        if (he_cache_takes(u->count, u->last, occupant, occupant >= 0 ? c->slot_count[s] : 0, c->used_at[s]))
            frequency_place(c, plan, k, row, s);
    }
}

/* The least used main row's uses, in parallel: a min a chunk, then one
 * compare-and-swap a chunk. */
typedef struct least_job {
    const he_cache *c;
    _Atomic uint32_t least;
} least_job;

static void least_range(void *ctx, int64_t begin, int64_t end)
{
    least_job *job = ctx;
    const he_cache *c = job->c;
    uint32_t least = HE_CACHE_COUNT_MAX + 1;
    for (int64_t s = c->window + begin; s < c->window + end; s++) /* main slots */
        if (c->row_of[s] >= 0 && c->slot_count[s] < least)
            least = c->slot_count[s];
    uint32_t seen = atomic_load_explicit(&job->least, memory_order_relaxed);
    while (least < seen &&
           !atomic_compare_exchange_weak_explicit(&job->least, &seen, least, memory_order_relaxed,
                                                  memory_order_relaxed))
        ;
}

/* The window's size for the next batch (he_cache_gate_update), and the
 * rows turned away now stamped; back: the batch's rows turned away lately
 * (counted by the pass over them). The least used main row is looked for
 * only where the gate compares it (rows were turned away lately). */
static void frequency_gate(he_cache *c, const int64_t *unique, int64_t num_unique, const he_cache_plan *plan,
                           int64_t back)
{
    int64_t batch = c->batch, turned = 0, main = c->capacity - c->window;
    uint32_t least = 0;
    if (he_cache_gate_recent(&c->gate) > 0) {
        least_job job = {.c = c};
        atomic_init(&job.least, HE_CACHE_COUNT_MAX + 1);
        he_parallel_for_bytes(main, 1 << 14, main * 10, least_range, &job);
        least = atomic_load(&job.least);
        if (least > HE_CACHE_COUNT_MAX)
            least = 0;
    }
    for (int64_t k = 0; k < num_unique; k++) {
        if (k + AHEAD_ENTRY < num_unique && plan->slot[k + AHEAD_ENTRY] < 0)
            __builtin_prefetch(&c->uses[unique[k + AHEAD_ENTRY]], 1);
        if (plan->slot[k] < 0) {
            c->uses[unique[k]].turned_at = (uint32_t)batch;
            turned++;
        }
    }
    c->window = he_cache_gate_update(&c->gate, back, turned, least, batch, c->capacity);
    c->window_hand = c->window ? c->window_hand % c->window : 0;
}

/* The rows turned away, ascending, into the window's ring: each takes the
 * next slot not in use, one round of its hand a batch; the hand stops
 * after the last slot taken (where the GPU's ranking of the ring's free
 * slots stops it too). */
static void frequency_window(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan)
{
    int64_t visits = c->window, batch = c->batch, s = c->window_hand, taken = -1;
    for (int64_t k = 0; k < num_unique && visits > 0; k++) {
        if (plan->slot[k] >= 0)
            continue;
        for (; visits > 0; visits--, s = s + 1 == c->window ? 0 : s + 1) {
            if (!he_cache_protected(c->used_at[s], batch, c->protect)) {
                frequency_place(c, plan, k, unique[k], s);
                taken = s;
                break;
            }
        }
    }
    if (taken >= 0)
        c->window_hand = taken + 1 == c->window ? 0 : taken + 1;
}

static void plan_frequency(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan,
                           int64_t *num_bypass, int64_t *hits)
{
    touch_job job = {.c = c, .unique = unique, .slot = plan->slot};
    atomic_init(&job.back, 0);
    he_parallel_for(num_unique, 4096, frequency_touch_range, &job);
    for (int64_t k = 0; k < num_unique; k++) {
        c->was_miss[k] = plan->slot[k] < 0;
        *hits += !c->was_miss[k];
    }
    frequency_pairs(c, unique, num_unique, plan);
    frequency_gate(c, unique, num_unique, plan, atomic_load(&job.back));
    frequency_window(c, unique, num_unique, plan);
    /* The fetches and evictions in ascending rows, as the plan promises,
     * and the rows left in host memory; both lists ascend, so one merge
     * pass finds the fetches of rows bypassed last time. */
    int64_t prev = 0;
    for (int64_t k = 0; k < num_unique; k++) {
        if (!c->was_miss[k])
            continue;
        int64_t row = unique[k];
        if (plan->slot[k] < 0) {
            c->next_bypass[(*num_bypass)++] = row;
            continue;
        }
        if (c->evicted_by[k] >= 0) {
            plan->evict_slot[plan->num_evict] = plan->slot[k];
            plan->evict_row[plan->num_evict++] = c->evicted_by[k];
        }
        while (prev < c->num_bypass && c->bypass[prev] < row)
            prev++;
        plan->fetch_row[plan->num_fetch] = row;
        plan->fetch_slot[plan->num_fetch] = plan->slot[k];
        plan->fetch_after_update[plan->num_fetch++] = prev < c->num_bypass && c->bypass[prev] == row;
    }
}

/* Room for a batch of n rows, before anything changes. */
static he_status make_room(he_cache *c, int64_t n)
{
    if (n <= c->bypass_room)
        return HE_OK;
    int64_t *next = realloc(c->next_bypass, (size_t)n * sizeof *next);
    if (next)
        c->next_bypass = next;
    int64_t *last = next ? realloc(c->bypass, (size_t)n * sizeof *last) : NULL;
    if (last)
        c->bypass = last;
    int ok = last != NULL;
    if (ok && c->policy == HE_CACHE_FREQUENCY) {
        uint64_t *keys = realloc(c->miss_keys, (size_t)n * sizeof *keys);
        if (keys)
            c->miss_keys = keys;
        uint8_t *flags = keys ? realloc(c->was_miss, (size_t)n) : NULL;
        if (flags)
            c->was_miss = flags;
        int64_t *evicted = flags ? realloc(c->evicted_by, (size_t)n * sizeof *evicted) : NULL;
        if (evicted)
            c->evicted_by = evicted;
        he_cache_use *uses = evicted ? realloc(c->batch_uses, (size_t)n * sizeof *uses) : NULL;
        if (uses)
            c->batch_uses = uses;
        uint64_t *tmp = uses && n > c->capacity ? realloc(c->sort_tmp, (size_t)n * sizeof *tmp) : c->sort_tmp;
        if (tmp)
            c->sort_tmp = tmp;
        ok = keys && flags && evicted && uses && tmp;
    }
    if (!ok)
        return he_fail(HE_ERR_NOMEM, "could not allocate a cache plan's lists of %" PRId64 " rows", n);
    c->bypass_room = n;
    return HE_OK;
}

he_status he_cache_plan_batch(he_cache *c, const int64_t *unique, int64_t num_unique, he_cache_plan *plan)
{
    if (num_unique < 0 || num_unique > plan->max_unique)
        return he_fail(HE_ERR_VALUE, "a plan sized for %" PRId64 " rows cannot take a batch of %" PRId64,
                       plan->max_unique, num_unique);
    if (c->policy == HE_CACHE_FREQUENCY && num_unique > (int64_t)HE_CACHE_KEY_INDEX_MASK)
        return he_fail(HE_ERR_VALUE, "the frequency policy plans batches of at most %" PRId64 " rows, got %" PRId64,
                       (int64_t)HE_CACHE_KEY_INDEX_MASK, num_unique);
    if (c->policy == HE_CACHE_FREQUENCY && c->batch >= (int64_t)UINT32_MAX)
        return he_fail(HE_ERR_VALUE, "the frequency policy counts batches in 32 bits: %" PRId64 " are planned",
                       c->batch);
    for (int64_t k = 0; k < num_unique; k++) {
        if ((uint64_t)unique[k] >= (uint64_t)c->num_rows)
            return he_fail(HE_ERR_INDEX, "row %" PRId64 " at %" PRId64 " is not in [0, %" PRId64 ")", unique[k], k,
                           c->num_rows);
        if (k > 0 && unique[k] <= unique[k - 1])
            return he_fail(HE_ERR_VALUE, "a batch's rows must be ascending and distinct, got %" PRId64
                           " after %" PRId64 " at %" PRId64, unique[k], unique[k - 1], k);
    }
    he_status st = make_room(c, num_unique);
    if (st != HE_OK)
        return st;
    c->batch++;
    int64_t num_bypass = 0, hits = 0;
    plan->num_fetch = plan->num_evict = 0;
    if (c->policy == HE_CACHE_FREQUENCY)
        plan_frequency(c, unique, num_unique, plan, &num_bypass, &hits);
    else
        plan_clock(c, unique, num_unique, plan, &num_bypass, &hits);
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
