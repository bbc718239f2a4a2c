/* Backward of the lookup: sum the output-gradient rows of each unique id. */
#ifndef HE_GRAD_REDUCE_H
#define HE_GRAD_REDUCE_H

#include <stdint.h>

#include "dedup.h"
#include "he_dtype.h"

typedef struct he_reduce_opts {
    int64_t padding_idx;   /* this id gets no gradient; -1 for none */
    int scale_grad_by_freq; /* divide each id's rows by its count in the batch */
    /* Pooled lookups (EmbeddingBag): position p's gradient row is
     * grad[bag_of[p]] * row_weights[p] (then the frequency scale), so the
     * bag gradient is never expanded to one row per position in memory.
     * bag_of NULL: position p's row is grad[p]. row_weights NULL: 1. */
    const int64_t *bag_of;     /* [d->count], each in [0, num_bags) (checked) */
    const void *row_weights;   /* [d->count], of dtype's compute type */
    int64_t num_bags;          /* rows of grad when bag_of is set */
    /* The element type of grad (any he_dtype: a half table's gradient
     * stays half until its rows are summed). row_weights and the sums are
     * in its compute type (he_dtype.h); half rows widen exactly. */
    int dtype;
    /* he_grad_reduce only: write each sum rounded (to nearest even) to a
     * half grad's dtype, out_values then of that dtype, as torch's
     * gradient of a half table is. */
    int round_sums;
} he_reduce_opts;

/* grad: [d->count, dim] rows in the batch's order (or [num_bags, dim] with
 * opts->bag_of). Writes the coalesced sparse gradient: out_indices[k]
 * ascending and out_values[k, :] (compute type, or see round_sums) for every
 * unique id except padding_idx; *out_count says how many (num_unique, or one
 * less). Each sum runs over its positions in ascending order, whatever the
 * thread count. Used both for backward and to coalesce a user's sparse
 * gradient (ids = its indices, grad = its values). */
he_status he_grad_reduce(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                         void *out_values, int64_t *out_indices, int64_t *out_count);

/* The most columns he_grad_reduce_apply hands to apply() at once. */
#define HE_REDUCE_BLOCK 256

/* What a fused backward does with each unique id's sum instead of writing
 * it out: an optimizer's row update. apply() gets columns [col, col + n) of
 * row `row`'s sum (bitwise what he_grad_reduce writes there), in ascending
 * col order, from one thread per row; prefetch() (may be NULL) is called a
 * few rows ahead with a row about to be applied. */
typedef struct he_row_update {
    void (*apply)(const void *ctx, int64_t row, int64_t col, const void *sum, int64_t n); /* sum: compute type */
    void (*prefetch)(const void *ctx, int64_t row);
    const void *ctx;
} he_row_update;

/* he_grad_reduce with every sum handed to update (padding_idx skipped). The
 * caller checks that the rows update writes belong to a table of
 * d->num_rows rows (the ids were range-checked against that). */
he_status he_grad_reduce_apply(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                               const he_row_update *update);

#endif
