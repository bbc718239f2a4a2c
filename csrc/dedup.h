/* Sort-based dedup of a batch of ids: the unique ids in ascending order and,
 * for each, the positions where it occurs, in ascending position order.
 * Backward, max_norm and the optimizer all reduce over this one structure,
 * which is what makes their sums deterministic for any thread count. */
#ifndef HE_DEDUP_H
#define HE_DEDUP_H

#include <stdint.h>

#include "ids.h"

typedef struct he_dedup {
    int64_t num_rows;   /* the table size the ids were checked against */
    int64_t count;      /* ids */
    int64_t num_unique;
    int64_t *unique;    /* [num_unique], ascending */
    int64_t *offsets;   /* [num_unique + 1]: positions of unique[k] are order[offsets[k]..offsets[k+1]) */
    uint32_t *order;    /* [count]: positions sorted by (id, position) */
    struct he_dedup_memory *memory; /* where the arrays live (dedup.c) */
} he_dedup;

/* Fails with HE_ERR_INDEX naming the first id outside [0, num_rows). */
he_status he_dedup_build(const he_ids *ids, int64_t num_rows, he_dedup **out);
void he_dedup_free(he_dedup *d);

/* unique[num_unique] = the unique ids; inverse[count]: inverse[i] is the
 * index in unique of the i-th id (what torch.unique(return_inverse=True)
 * gives, from the sort already done). */
void he_dedup_export(const he_dedup *d, int64_t *unique, int64_t *inverse);

#endif
