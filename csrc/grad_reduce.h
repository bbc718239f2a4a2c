/* Backward of the lookup: sum the output-gradient rows of each unique id. */
#ifndef HE_GRAD_REDUCE_H
#define HE_GRAD_REDUCE_H

#include <stdint.h>

#include "dedup.h"

typedef struct he_reduce_opts {
    int64_t padding_idx;   /* this id gets no gradient; -1 for none */
    int scale_grad_by_freq; /* divide each id's rows by its count in the batch */
} he_reduce_opts;

/* grad: [d->count, dim] rows in the batch's order. Writes the coalesced
 * sparse gradient: out_indices[k] ascending and out_values[k, :] for every
 * unique id except padding_idx; *out_count says how many (num_unique, or one
 * less). Each sum runs over its positions in ascending order, whatever the
 * thread count. Used both for backward and to coalesce a user's sparse
 * gradient (ids = its indices, grad = its values). */
he_status he_grad_reduce(const he_dedup *d, const float *grad, int64_t dim, const he_reduce_opts *opts,
                         float *out_values, int64_t *out_indices, int64_t *out_count);

#endif
