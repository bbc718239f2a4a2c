#include "pool_bags.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "simd.h"
#include "thread_pool.h"

/* Columns a half table's bag is pooled in at a time (its float sums on
 * the stack); float32 and float64 tables sum into the output row, or in
 * registers for the widths pool_row_n takes. */
#define HE_POOL_BLOCK 256

/* The widest row whose bag sum is kept in registers (pool_row_n). */
#define HE_POOL_REGISTER_WIDTH 64

#ifndef HE_POOL_AHEAD
#define HE_POOL_AHEAD 8
#endif

/* float sums to a half dtype: to nearest even, or for bfloat16 in
 * FBGEMM's kernel (fbgemm: true) half-up (add half an ulp, truncate). */
static void round_half_sums(int dtype, int fbgemm, const float *src, void *dst, int64_t n)
{
    if (dtype != HE_BF16 || !fbgemm) {
        he_row_from_f32(dtype, src, dst, n, 0, 0, 0, 0);
        return;
    }
    uint16_t *out = dst;
    for (int64_t j = 0; j < n; j++) {
        uint32_t bits;
        memcpy(&bits, &src[j], sizeof bits);
        out[j] = isnan(src[j]) ? (uint16_t)((bits >> 16) | 0x40) : (uint16_t)((bits + 0x8000u) >> 16);
    }
}

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define HE_REAL_TEMPLATE "pool_bags_row.inc"
#include "for_each_real.inc"

typedef struct pool_job {
    const he_bag_batch *batches;
    int64_t count;
    const int64_t *start; /* [count + 1]: batch i's bags are [start[i], start[i + 1]) of the job's */
} pool_job;

/* The job's bags [begin, end), which may span several batches. */
static void pool_range(void *ctx, int64_t begin, int64_t end)
{
    const pool_job *job = ctx;
    int64_t i = 0;
    while (job->start[i + 1] <= begin)
        i++;
    for (; i < job->count && job->start[i] < end; i++) {
        const he_bag_batch *b = &job->batches[i];
        int64_t lo = begin > job->start[i] ? begin - job->start[i] : 0;
        int64_t hi = (end < job->start[i + 1] ? end : job->start[i + 1]) - job->start[i];
        if (b->table.dtype == HE_F64)
            pool_range_f64(b, lo, hi);
        else
            pool_range_f32(b, lo, hi);
    }
}

static he_status check_offsets(const he_bag_batch *b)
{
    if (b->num_bags < 0 || b->end < 0 || b->end > b->ids.count)
        return he_fail(HE_ERR_VALUE, "bags: %" PRId64 " bags ending at %" PRId64 " over %" PRId64 " ids",
                       b->num_bags, b->end, b->ids.count);
    for (int64_t k = 0; k < b->num_bags; k++) {
        int64_t prev = k ? b->offsets[k - 1] : 0;
        if (b->offsets[k] < prev || b->offsets[k] > b->end || (k == 0 && b->offsets[0] != 0))
            return he_fail(HE_ERR_VALUE, "bags: offsets[%" PRId64 "] = %" PRId64 " is not in [%" PRId64 ", %" PRId64
                           "] (offsets start at 0 and never decrease)", k, b->offsets[k], prev, b->end);
    }
    return HE_OK;
}

he_status he_check_bag_batch(const he_bag_batch *b)
{
    he_status st = check_offsets(b);
    if (st != HE_OK)
        return st;
    he_ids in_bags = {b->ids.data, b->end, b->ids.is_int64};
    return he_check_ids(&in_bags, b->table.num_rows);
}

he_status he_pool_bags(const he_bag_batch *batches, int64_t count, int64_t *bad_batch)
{
    if (bad_batch)
        *bad_batch = -1;
    if (count < 0)
        return he_fail(HE_ERR_VALUE, "bags: %" PRId64 " batches", count);
    int64_t start_small[9];
    int64_t *start = count < 9 ? start_small : malloc((size_t)(count + 1) * sizeof *start);
    if (!start)
        return he_fail(HE_ERR_NOMEM, "bags: no memory for %" PRId64 " batches", count);
    he_status st = HE_OK;
    int64_t bytes = 0;
    start[0] = 0;
    for (int64_t i = 0; i < count && st == HE_OK; i++) {
        const he_bag_batch *b = &batches[i];
        st = he_check_bag_batch(b);
        if (st != HE_OK) {
            if (bad_batch)
                *bad_batch = i;
            if (count > 1) { /* say which table */
                char why[512];
                snprintf(why, sizeof why, "%s", he_last_error());
                st = he_fail(st, "table %" PRId64 " of %" PRId64 ": %s", i, count, why);
            }
        }
        start[i + 1] = start[i] + b->num_bags;
        bytes += (b->end + b->num_bags) * b->table.dim * (int64_t)he_table_elem(&b->table);
    }
    if (st == HE_OK && start[count] > 0) {
        pool_job job = {batches, count, start};
        /* About a page of rows read a chunk, so a chunk's prefetches run ahead of it. */
        st = he_parallel_for_bytes(start[count], 16, bytes, pool_range, &job);
    }
    if (start != start_small)
        free(start);
    return st;
}

he_status he_bag_positions(const he_bag_batch *b, int64_t *bag_of, void *weights, int *wrote)
{
    he_status st = check_offsets(b);
    if (st != HE_OK)
        return st;
    int64_t count = b->ids.count;
    int f64 = b->table.dtype == HE_F64;
    int factors = b->weights || b->mean || b->padding_idx >= 0 || b->end < count || (b->num_bags == 0 && count > 0);
    for (int64_t bag = 0; bag < b->num_bags; bag++) {
        int64_t first = b->offsets[bag], last = bag + 1 < b->num_bags ? b->offsets[bag + 1] : b->end;
        int64_t counted = last - first;
        if (b->padding_idx >= 0)
            for (int64_t p = first; p < last; p++)
                counted -= he_id_at(&b->ids, p) == b->padding_idx;
        for (int64_t p = first; p < last; p++) {
            bag_of[p] = bag;
            if (!factors)
                continue;
            double w = he_id_at(&b->ids, p) == b->padding_idx ? 0.0
                       : b->weights ? (f64 ? ((const double *)b->weights)[p] : ((const float *)b->weights)[p])
                       : b->mean ? 1.0 / (double)counted : 1.0;
            if (f64)
                ((double *)weights)[p] = w;
            else /* torch's float mean factor: 1 / count in float */
                ((float *)weights)[p] = b->mean && !b->weights && w != 0 ? 1.0f / (float)counted : (float)w;
        }
    }
    int64_t tail = b->num_bags ? b->end : 0;
    for (int64_t p = tail; p < count; p++) {
        bag_of[p] = 0;
        if (f64)
            ((double *)weights)[p] = 0;
        else
            ((float *)weights)[p] = 0;
    }
    *wrote = factors;
    return HE_OK;
}

he_status he_bag_reduce_inputs(const he_bag_batch *b, int64_t sorted_count, int64_t grad_rows, he_temp *positions,
                               he_reduce_opts *opts)
{
    int64_t count = b->ids.count;
    if (sorted_count != count)
        return he_fail(HE_ERR_VALUE, "a sort of %" PRId64 " ids for a bag batch of %" PRId64, sorted_count, count);
    /* Every position reads a gradient row: its bag's, or row 0 (factor 0)
     * for a position in no bag. */
    if (grad_rows < b->num_bags || (count > 0 && grad_rows < 1))
        return he_fail(HE_ERR_VALUE, "a gradient of %" PRId64 " rows for %" PRId64 " bags of %" PRId64 " ids",
                       grad_rows, b->num_bags, count);
    size_t n = (size_t)(count > 0 ? count : 1);
    size_t factor = he_dtype_size(he_compute_dtype(b->table.dtype));
    he_status st = he_temp_alloc(positions, n * (sizeof(int64_t) + factor));
    if (st != HE_OK)
        return st;
    int64_t *bag_of = positions->ptr;
    void *weights = bag_of + n;
    int wrote = 0;
    if ((st = he_bag_positions(b, bag_of, weights, &wrote)) != HE_OK)
        return st;
    opts->bag_of = bag_of;
    opts->row_weights = wrote ? weights : NULL;
    opts->num_bags = grad_rows;
    return HE_OK;
}

he_status he_bag_grad_reduce(const he_dedup *d, const he_bag_batch *b, const void *grad, int64_t grad_rows,
                             const he_reduce_opts *opts, void *out_values, int64_t *out_indices, int64_t *out_count)
{
    he_temp positions = {NULL, 0};
    he_reduce_opts with_bags = *opts;
    he_status st = d->num_rows == b->table.num_rows
                       ? he_bag_reduce_inputs(b, d->count, grad_rows, &positions, &with_bags)
                       : he_fail(HE_ERR_VALUE, "a sort of ids of a %" PRId64 "-row table for a %" PRId64
                                 "-row one", d->num_rows, b->table.num_rows);
    if (st == HE_OK)
        st = he_grad_reduce(d, grad, b->table.dim, &with_bags, out_values, out_indices, out_count);
    he_temp_free(&positions);
    return st;
}
