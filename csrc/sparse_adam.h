/* torch.optim.SparseAdam's update, in place on host-memory rows (the
 * optimizer HE_OPTIM_ADAM of sparse_update.h, kept under its own name for
 * the callers that know only Adam). */
#ifndef HE_SPARSE_ADAM_H
#define HE_SPARSE_ADAM_H

#include <stdint.h>

#include "dedup.h"
#include "grad_reduce.h"
#include "he_adam.h"
#include "he_status.h"
#include "table.h"

/* Updates rows indices[0..nnz) of weight, exp_avg and exp_avg_sq ([num_rows,
 * dim] each, each checked against its buffer with he_table_check, the state
 * against the weight's shape; row strides may differ) with grad rows
 * values[0..nnz) ([nnz, dim], row-major): the indices and values of a
 * sparse COO gradient. A table that does not fit its buffer (HE_ERR_VALUE)
 * and indices outside [0, num_rows) (HE_ERR_INDEX) are refused before
 * anything is written, so a bad gradient changes nothing. Repeated indices
 * (a gradient accumulated over several backward calls) are summed first, in
 * ascending position order; autograd never marks the gradient it stores as
 * coalesced, so the core checks the indices rather than trusting a flag.
 *
 * torch's float32 arithmetic, the same operations in the same order (built
 * with -ffp-contract=off so no FMA fuses them), with a correctly rounded
 * sqrt. torch's vectorised CPU sqrt is not always correctly rounded (1 ulp
 * off for ~20% of inputs, depending on the CPU and the element's place in
 * the vector loop), so results agree with torch's to an ulp, not always to
 * the bit:
 *   u1 = (g - m) * (1-b1);   m' = m + u1
 *   u2 = (g*g - v) * (1-b2); v' = v + u2
 *   w' = w + (m' / (sqrt(v') + eps)) * -(lr * sqrt(1-b2^t) / (1-b1^t))
 * with the scalars of he_adam_make_consts (include/he_adam.h). */
he_status he_sparse_adam(const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                         const int64_t *indices, const float *values, int64_t nnz, const he_adam_params *hp);

/* Backward and update in one pass (the fused mode): the gradient of a
 * lookup of d's ids is grad ([d->count, dim] rows in the batch's order);
 * each unique id's rows are summed as he_grad_reduce sums them (opts:
 * padding_idx gets no update, scale_grad_by_freq) and the sum goes straight
 * into that row's update, never to memory. The same bits as he_grad_reduce
 * followed by he_sparse_adam. Tables are checked as he_sparse_adam checks
 * them, and d must have been built for weight's row count. */
he_status he_sparse_adam_fused(const he_dedup *d, const float *grad, const he_reduce_opts *opts,
                               const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                               const he_adam_params *hp);

#endif
