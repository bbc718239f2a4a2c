#include "grad_reduce.h"

#include <inttypes.h>

#include "convert.h"
#include "simd.h"
#include "thread_pool.h"

typedef struct reduce_job {
    const he_dedup *d;
    const void *grad;
    int64_t dim;
    int64_t skip_at; /* unique index of padding_idx, or -1 */
    int scale;
    int grad_dtype; /* of the grad rows */
    int f64;        /* row_weights and the sums are double (else float) */
    int round_half; /* out_values in grad_dtype, a half one (opts->round_sums) */
    const int64_t *bag_of;
    const void *row_weights;
    void *out_values;  /* NULL when the sums go to update instead */
    int64_t *out_indices;
    const he_row_update *update;
} reduce_job;

/* sum_rows_f32 and sum_rows_f64: the compute types of gradients. */
#define REAL float
#define SUM_ROWS sum_rows_f32
#define WIDEN_HALF
#include "grad_reduce_sum.inc"
#undef REAL
#undef SUM_ROWS
#undef WIDEN_HALF
#define REAL double
#define SUM_ROWS sum_rows_f64
#include "grad_reduce_sum.inc"
#undef REAL
#undef SUM_ROWS

/* Bytes of sums a fused chunk keeps: L1-sized, so they are still there
 * when the chunk's updates read them. */
#define HE_REDUCE_CHUNK_BYTES (16 << 10)

/* The fused path for rows of at most HE_REDUCE_BLOCK columns, a chunk of
 * unique ids [begin, chunk end) at a time: first every sum of the chunk,
 * asking for each id's destination rows as its sum is made, then every
 * update. Summing and updating in one loop, id by id, left each id's
 * random gradient reads and random row updates waiting on DRAM one after
 * the other (measured: 7.8 ms for 65,536 ids of a 2M x 64 table, against
 * 5.1 ms for the unfused reduce then update); apart, each loop keeps
 * several misses in flight, and the destination rows arrive while the
 * sums are made. The same sums, updates and order as id by id. Returns
 * the chunk's end. */
static int64_t reduce_chunk_apply(const reduce_job *job, int64_t begin, int64_t end, int64_t prefetch_end)
{
    const he_dedup *d = job->d;
    const he_row_update *update = job->update;
    int64_t dim = job->dim;
    size_t elem = job->f64 ? sizeof(double) : sizeof(float);
    _Alignas(64) double sums[HE_REDUCE_CHUNK_BYTES / sizeof(double)];
    int64_t per_chunk = HE_REDUCE_CHUNK_BYTES / (int64_t)(dim * elem);
    if (per_chunk < 1)
        per_chunk = 1; /* dim <= HE_REDUCE_BLOCK: one row always fits */
    int64_t stop = end - begin < per_chunk ? end : begin + per_chunk;
    for (int64_t k = begin; k < stop; k++) {
        if (k == job->skip_at)
            continue;
        if (update->prefetch)
            update->prefetch(update->ctx, d->unique[k]);
        int64_t first = d->offsets[k], last = d->offsets[k + 1];
        double scale = 1.0 / (double)(last - first);
        char *sum = (char *)sums + (size_t)((k - begin) * dim) * elem;
        if (job->f64)
            sum_rows_f64((double *)sum, job, first, last, prefetch_end, 0, dim, scale);
        else
            sum_rows_f32((float *)sum, job, first, last, prefetch_end, 0, dim, (float)scale);
    }
    for (int64_t k = begin; k < stop; k++)
        if (k != job->skip_at)
            update->apply(update->ctx, d->unique[k], 0, (const char *)sums + (size_t)((k - begin) * dim) * elem, dim);
    return stop;
}

/* The update path sums a block of columns at a time (HE_REDUCE_BLOCK) into
 * a buffer on the stack and hands it on while it is in L1: every element's
 * sum is the same operations in the same order as a whole-row sum, so the
 * update sees the bits grad_reduce would have written, without the
 * [num_unique, dim] round trip through memory. */
static void reduce_range(void *ctx, int64_t begin, int64_t end)
{
    reduce_job *job = ctx;
    const he_dedup *d = job->d;
    const he_row_update *update = job->update;
    int64_t dim = job->dim;
    int64_t prefetch_end = d->offsets[end];
    size_t elem = job->round_half ? 2 : job->f64 ? sizeof(double) : sizeof(float);
    /* A half gradient is widened (and its sums rounded) a block of columns
     * at a time. */
    int64_t out_block = job->grad_dtype == HE_F16 || job->grad_dtype == HE_BF16 ? HE_REDUCE_BLOCK : dim;
    _Alignas(64) double block[HE_REDUCE_BLOCK];
    for (int64_t k = begin; k < end; k++) {
        if (k == job->skip_at)
            continue;
        int64_t first = d->offsets[k], last = d->offsets[k + 1];
        /* torch scales each row before adding it (grad * (1/count)). */
        double scale = 1.0 / (double)(last - first);
        if (!update) {
            int64_t slot = job->skip_at >= 0 && k > job->skip_at ? k - 1 : k;
            job->out_indices[slot] = d->unique[k];
            char *out = (char *)job->out_values + (size_t)(slot * dim) * elem;
            for (int64_t col = 0; col < dim; col += out_block) {
                int64_t n = dim - col < out_block ? dim - col : out_block;
                if (job->f64) {
                    sum_rows_f64((double *)out + col, job, first, last, prefetch_end, col, n, scale);
                } else if (job->round_half) {
                    sum_rows_f32((float *)block, job, first, last, prefetch_end, col, n, (float)scale);
                    he_row_from_f32(job->grad_dtype, (float *)block, out + (size_t)col * elem, n, 0, 0, 0, 0);
                } else {
                    sum_rows_f32((float *)out + col, job, first, last, prefetch_end, col, n, (float)scale);
                }
            }
            continue;
        }
        if (dim <= HE_REDUCE_BLOCK) {
            k = reduce_chunk_apply(job, k, end, prefetch_end) - 1;
            continue;
        }
        /* The destination rows wait on DRAM as the update's do. */
        if (update->prefetch && k + HE_PREFETCH_AHEAD < end)
            update->prefetch(update->ctx, d->unique[k + HE_PREFETCH_AHEAD]);
        for (int64_t col = 0; col < dim; col += HE_REDUCE_BLOCK) {
            int64_t n = dim - col < HE_REDUCE_BLOCK ? dim - col : HE_REDUCE_BLOCK;
            if (job->f64)
                sum_rows_f64(block, job, first, last, prefetch_end, col, n, scale);
            else
                sum_rows_f32((float *)block, job, first, last, prefetch_end, col, n, (float)scale);
            update->apply(update->ctx, d->unique[k], col, block, n);
        }
    }
}

static int64_t find_unique(const he_dedup *d, int64_t id)
{
    int64_t lo = 0, hi = d->num_unique;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (d->unique[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < d->num_unique && d->unique[lo] == id ? lo : -1;
}

static he_status reduce(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                        void *out_values, int64_t *out_indices, const he_row_update *update, int64_t grain,
                        int64_t *out_count)
{
    he_status st = he_check_table_shape(0, dim);
    if (st != HE_OK)
        return st;
    if (!he_dtype_valid(opts->dtype))
        return he_fail(HE_ERR_VALUE, "unknown gradient dtype code %d", opts->dtype);
    if (opts->bag_of) {
        for (int64_t p = 0; p < d->count; p++)
            if (opts->bag_of[p] < 0 || opts->bag_of[p] >= opts->num_bags)
                return he_fail(HE_ERR_INDEX, "bag_of[%" PRId64 "] = %" PRId64 " is not in [0, %" PRId64 ")", p,
                               opts->bag_of[p], opts->num_bags);
    }
    int64_t skip_at = opts->padding_idx >= 0 ? find_unique(d, opts->padding_idx) : -1;
    int round_half = opts->round_sums && (opts->dtype == HE_F16 || opts->dtype == HE_BF16);
    reduce_job job = {d, grad, dim, skip_at, opts->scale_grad_by_freq, opts->dtype, opts->dtype == HE_F64,
                      round_half, opts->bag_of, opts->row_weights, out_values, out_indices, update};
    /* Every position's gradient row read, every unique row's sum written
     * (or, fused, its row and state updated: counted as three rows). */
    int64_t bytes = (d->count + 3 * d->num_unique) * dim * (int64_t)he_dtype_size(opts->dtype);
    st = he_parallel_for_bytes(d->num_unique, grain, bytes, reduce_range, &job);
    if (st == HE_OK && out_count)
        *out_count = d->num_unique - (skip_at >= 0);
    return st;
}

he_status he_grad_reduce(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                         void *out_values, int64_t *out_indices, int64_t *out_count)
{
    int64_t grain = dim > 0 ? 8192 / dim + 1 : d->num_unique;
    return reduce(d, grad, dim, opts, out_values, out_indices, NULL, grain, out_count);
}

he_status he_grad_reduce_apply(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                               const he_row_update *update)
{
    if (dim == 0)
        return he_check_table_shape(0, dim);
    /* The update dominates: three rows read and written per id. */
    return reduce(d, grad, dim, opts, NULL, NULL, update, 4096 / dim + 1, NULL);
}
