#include "grad_reduce.h"

#include "simd.h"
#include "thread_pool.h"

typedef struct reduce_job {
    const he_dedup *d;
    const float *grad;
    int64_t dim;
    int64_t skip_at; /* unique index of padding_idx, or -1 */
    int scale;
    float *out_values;  /* NULL when the sums go to update instead */
    int64_t *out_indices;
    const he_row_update *update;
} reduce_job;

/* Sums columns [col, col + n) of the grad rows order[first..last) into
 * acc, in that order. One call per unique id (and column block), so the
 * ISA dispatch is paid once per id, not per row. The first row is copied
 * rather than added to zeros: the same sum, one pass less (most ids of a
 * batch occur once). */
HE_SIMD_CLONES
static void sum_rows(float *restrict acc, const float *restrict grad, const uint32_t *restrict order, int64_t first,
                     int64_t last, int64_t prefetch_end, int64_t dim, int64_t col, int64_t n, int scale_rows,
                     float scale)
{
    size_t row_bytes = (size_t)n * sizeof(float);
    for (int64_t i = first; i < last; i++) {
        /* The rows of one id are scattered over the batch. */
        if (i + HE_PREFETCH_AHEAD < prefetch_end)
            he_prefetch_row(grad + (int64_t)order[i + HE_PREFETCH_AHEAD] * dim + col, row_bytes, 0);
        const float *row = grad + (int64_t)order[i] * dim + col;
        if (i == first) {
            for (int64_t j = 0; j < n; j++)
                acc[j] = scale_rows ? row[j] * scale : row[j];
        } else if (scale_rows) {
            for (int64_t j = 0; j < n; j++)
                acc[j] += row[j] * scale;
        } else {
            for (int64_t j = 0; j < n; j++)
                acc[j] += row[j];
        }
    }
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
    _Alignas(64) float block[HE_REDUCE_BLOCK];
    for (int64_t k = begin; k < end; k++) {
        if (k == job->skip_at)
            continue;
        int64_t first = d->offsets[k], last = d->offsets[k + 1];
        /* torch scales each row before adding it (grad * (1/count)). */
        float scale = (float)(1.0 / (double)(last - first));
        if (!update) {
            int64_t slot = job->skip_at >= 0 && k > job->skip_at ? k - 1 : k;
            job->out_indices[slot] = d->unique[k];
            sum_rows(job->out_values + slot * dim, job->grad, d->order, first, last, prefetch_end, dim, 0, dim,
                     job->scale, scale);
            continue;
        }
        /* The destination rows wait on DRAM as the update's do. */
        if (update->prefetch && k + HE_PREFETCH_AHEAD < end)
            update->prefetch(update->ctx, d->unique[k + HE_PREFETCH_AHEAD]);
        for (int64_t col = 0; col < dim; col += HE_REDUCE_BLOCK) {
            int64_t n = dim - col < HE_REDUCE_BLOCK ? dim - col : HE_REDUCE_BLOCK;
            sum_rows(block, job->grad, d->order, first, last, prefetch_end, dim, col, n, job->scale, scale);
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

static he_status reduce(const he_dedup *d, const float *grad, int64_t dim, const he_reduce_opts *opts,
                        float *out_values, int64_t *out_indices, const he_row_update *update, int64_t grain,
                        int64_t *out_count)
{
    he_status st = he_check_table_shape(0, dim);
    if (st != HE_OK)
        return st;
    int64_t skip_at = opts->padding_idx >= 0 ? find_unique(d, opts->padding_idx) : -1;
    reduce_job job = {d, grad, dim, skip_at, opts->scale_grad_by_freq, out_values, out_indices, update};
    st = he_parallel_for(d->num_unique, grain, reduce_range, &job);
    if (st == HE_OK && out_count)
        *out_count = d->num_unique - (skip_at >= 0);
    return st;
}

he_status he_grad_reduce(const he_dedup *d, const float *grad, int64_t dim, const he_reduce_opts *opts,
                         float *out_values, int64_t *out_indices, int64_t *out_count)
{
    int64_t grain = dim > 0 ? 8192 / dim + 1 : d->num_unique;
    return reduce(d, grad, dim, opts, out_values, out_indices, NULL, grain, out_count);
}

he_status he_grad_reduce_apply(const he_dedup *d, const float *grad, int64_t dim, const he_reduce_opts *opts,
                               const he_row_update *update)
{
    if (dim == 0)
        return he_check_table_shape(0, dim);
    /* The update dominates: three rows read and written per id. */
    return reduce(d, grad, dim, opts, NULL, NULL, update, 4096 / dim + 1, NULL);
}
