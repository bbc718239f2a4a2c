/* EmbeddingBag in the core: each bag's rows pooled straight from the table
 * into the output (forward), and each position's share of its bag's
 * gradient (what backward's reduce needs). One call takes the bags of many
 * tables, so a model's whole pooled lookup is one pass of the threads. */
#ifndef HE_POOL_BAGS_H
#define HE_POOL_BAGS_H

#include <stdint.h>

#include "grad_reduce.h"
#include "host_memory.h"
#include "ids.h"
#include "table.h"

/* One table's part of a pooled lookup. Bag b holds positions
 * [offsets[b], offsets[b + 1]) (the last bag ends at `end`); positions at
 * or past `end` are in no bag. */
typedef struct he_bag_batch {
    he_table table;         /* checked by the caller (he_table_check) */
    he_ids ids;             /* ids.count >= end */
    const int64_t *offsets; /* [num_bags], non-decreasing, offsets[0] = 0, each <= end */
    int64_t num_bags;
    int64_t end;
    /* Per-sample weights [ids.count] in the table's compute type, or NULL. */
    const void *weights;
    int64_t padding_idx; /* left out of the pool and of a mean's count; -1: none */
    int mean;            /* divide each bag's sum by its counted size */
    void *out;           /* [num_bags, dim] of the table's dtype, written whole */
} he_bag_batch;

/* Pools every batch: out[b] = sum over the bag's positions p (padding left
 * out) of row(ids[p]) (times weights[p]), accumulated from zero in
 * position order in the compute type (weighted rows by one FMA each, as
 * torch's CPU kernel does), then times 1 / the counted size for a mean
 * (empty bags: zeros), rounded once to the table's dtype. Every batch's ids
 * are range-checked before any output is written: HE_ERR_INDEX names the
 * first bad id of the first batch that has one, and *bad_batch (may be
 * NULL) says which; HE_ERR_VALUE for offsets that are not as above. */
he_status he_pool_bags(const he_bag_batch *batches, int64_t count, int64_t *bad_batch);

/* he_pool_bags' checks of one batch (its offsets, then its ids' range),
 * with nothing pooled: for a caller that pools the bags another way. */
he_status he_check_bag_batch(const he_bag_batch *batch);

/* Backward's view of one batch: bag_of[p] (each position's bag; positions
 * in no bag point at bag 0) and, unless every factor is 1 (*wrote = 0 then,
 * weights untouched), weights[p] in the table's compute type: 0 for
 * padding and for positions in no bag, else the per-sample weight, or 1 /
 * the bag's counted size for a mean (*wrote = 1). HE_ERR_VALUE for offsets
 * he_pool_bags would refuse, before anything is written; ids unchecked. */
he_status he_bag_positions(const he_bag_batch *batch, int64_t *bag_of, void *weights, int *wrote);

/* What a reduce of this batch's gradient needs (grad_reduce.h): each
 * position's bag and factor made into *positions (a he_temp the caller
 * frees) and set in opts (bag_of, row_weights, num_bags = grad_rows).
 * HE_ERR_VALUE, nothing set, for a sort of another number of ids
 * (sorted_count), a gradient of fewer rows than bags (or none for a batch
 * with ids), or offsets he_bag_positions refuses. */
he_status he_bag_reduce_inputs(const he_bag_batch *batch, int64_t sorted_count, int64_t grad_rows,
                               he_temp *positions, he_reduce_opts *opts);

/* he_grad_reduce of a bag batch's gradient (grad: grad_rows rows, one a
 * bag), d the sort of its ids, opts' bag fields made here. */
he_status he_bag_grad_reduce(const he_dedup *d, const he_bag_batch *batch, const void *grad, int64_t grad_rows,
                             const he_reduce_opts *opts, void *out_values, int64_t *out_indices, int64_t *out_count);

#endif
