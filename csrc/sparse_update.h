/* Any sparse optimizer's update (optimizers.h), in place on host-memory
 * rows: one threaded pass over the gradient's rows, whatever the optimizer. */
#ifndef HE_SPARSE_UPDATE_H
#define HE_SPARSE_UPDATE_H

#include <stdint.h>

#include "dedup.h"
#include "grad_reduce.h"
#include "he_optim.h"
#include "optimizers.h"
#include "pool_bags.h"
#include "he_status.h"
#include "table.h"

/* Updates rows indices[0..nnz) of weight ([num_rows, dim]) and of the
 * optimizer's num_state state tables (as optimizers.c lays them out: per
 * element [num_rows, dim], per row [num_rows, 1]; each checked against
 * its buffer with he_table_check and against the weight's shape; row
 * strides may differ) with gradient rows values[0..nnz) ([nnz, dim],
 * row-major, of values_dtype). The weight may be of any he_dtype; the state
 * is in its compute type (he_dtype.h) or, per-element state of a float32 or
 * half table, compact: float16, bfloat16 or 8 bits (quantize.h; its scales
 * in the he_table), widened into floats around the row function and rounded
 * back (hp->state_stochastic_rounding: stochastically). values are in the
 * compute type or, for a float16 or bfloat16 table, in the table's own dtype
 * (widened exactly, row by row).
 * Tables that do not fit their buffers, overlap, or do not
 * match the optimizer (HE_ERR_VALUE), and indices outside [0, num_rows)
 * (HE_ERR_INDEX), are refused before anything is written. Repeated indices
 * are summed first, in ascending position order (autograd never marks the
 * gradient it stores as coalesced, so the indices are checked, not a
 * flag). */
he_status he_sparse_update(const he_optim_params *hp, const he_table *weight, const he_table *state,
                           int num_state, const int64_t *indices, const void *values, int values_dtype,
                           int64_t nnz);

/* One table's he_sparse_update, for he_sparse_update_many. */
typedef struct he_sparse_update_job {
    he_optim_params hp;
    he_table weight;
    he_table state[HE_OPTIM_MAX_STATE];
    int num_state;
    const int64_t *indices;
    const void *values;
    int values_dtype;
    int64_t nnz;
} he_sparse_update_job;

/* he_sparse_update of several tables (an optimizer's tables at one step),
 * the same bits as one call each. Every update is checked before any row
 * is written (an error names the table, "table k of n", when there are
 * several); tables too small to be worth the threads on their own are
 * updated side by side, one thread a table, others one after another. */
he_status he_sparse_update_many(const he_sparse_update_job *jobs, int64_t count);

/* Backward and update in one pass (the fused mode): the gradient of a
 * lookup of d's ids is grad ([d->count, dim] rows in the batch's order, of
 * opts->dtype: the table's compute type or, for a half table, its dtype);
 * each unique id's rows are summed as he_grad_reduce sums them (opts) and
 * the sum goes straight into that row's update. The same bits as
 * he_grad_reduce followed by he_sparse_update. d must have been built for
 * weight's row count. */
he_status he_sparse_update_fused(const he_dedup *d, const void *grad, const he_reduce_opts *opts,
                                 const he_optim_params *hp, const he_table *weight, const he_table *state,
                                 int num_state);

/* One table's he_sparse_update_fused, for he_sparse_update_fused_many.
 * d may be NULL: he_sparse_update_fused_many then sorts `ids` itself
 * (range-checking them against weight.num_rows), side by side with the
 * other tables' sorts. bags, when not NULL, is the batch of bags whose
 * output gradient grad is ([grad_rows, dim]): each position's bag and
 * factor (he_bag_positions) are made there too and stand for opts'
 * bag_of, row_weights and num_bags; its ids are the ones sorted. */
typedef struct he_fused_update {
    const he_dedup *d;
    he_ids ids;
    const he_bag_batch *bags;
    int64_t grad_rows;
    const void *grad;
    he_reduce_opts opts;
    he_optim_params hp;
    he_table weight;
    he_table state[HE_OPTIM_MAX_STATE];
    int num_state;
} he_fused_update;

/* he_sparse_update_fused of several tables (a model's tables after one
 * backward pass), the same bits as one call each. Every update is checked
 * before any row is written (an error names the table, "table k of n",
 * when there are several).
 * When each is too small to be worth the threads on its own, the tables
 * are updated side by side, one thread a table; otherwise one after
 * another, each with every thread. */
he_status he_sparse_update_fused_many(const he_fused_update *updates, int64_t count);

#endif
