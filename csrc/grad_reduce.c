#include "grad_reduce.h"

#include "simd.h"
#include "thread_pool.h"

typedef struct reduce_job {
    const he_dedup *d;
    const float *grad;
    int64_t dim;
    int64_t skip_at; /* unique index of padding_idx, or -1 */
    int scale;
    float *out_values;
    int64_t *out_indices;
} reduce_job;

/* Sums the grad rows order[first..last) into acc, in that order. One call
 * per unique id, so the ISA dispatch is paid once per id, not per row. The
 * first row is copied rather than added to zeros: the same sum, one pass
 * less (most ids of a batch occur once). */
HE_SIMD_CLONES
static void sum_rows(float *restrict acc, const float *restrict grad, const uint32_t *restrict order, int64_t first,
                     int64_t last, int64_t prefetch_end, int64_t dim, int scale_rows, float scale)
{
    size_t row_bytes = (size_t)dim * sizeof(float);
    for (int64_t i = first; i < last; i++) {
        /* The rows of one id are scattered over the batch. */
        if (i + HE_PREFETCH_AHEAD < prefetch_end)
            he_prefetch_row(grad + (int64_t)order[i + HE_PREFETCH_AHEAD] * dim, row_bytes, 0);
        const float *row = grad + (int64_t)order[i] * dim;
        if (i == first) {
            for (int64_t j = 0; j < dim; j++)
                acc[j] = scale_rows ? row[j] * scale : row[j];
        } else if (scale_rows) {
            for (int64_t j = 0; j < dim; j++)
                acc[j] += row[j] * scale;
        } else {
            for (int64_t j = 0; j < dim; j++)
                acc[j] += row[j];
        }
    }
}

static void reduce_range(void *ctx, int64_t begin, int64_t end)
{
    reduce_job *job = ctx;
    const he_dedup *d = job->d;
    int64_t dim = job->dim;
    int64_t prefetch_end = d->offsets[end];
    for (int64_t k = begin; k < end; k++) {
        if (k == job->skip_at)
            continue;
        int64_t slot = job->skip_at >= 0 && k > job->skip_at ? k - 1 : k;
        int64_t first = d->offsets[k], last = d->offsets[k + 1];
        job->out_indices[slot] = d->unique[k];
        /* torch scales each row before adding it (grad * (1/count)). */
        float scale = (float)(1.0 / (double)(last - first));
        sum_rows(job->out_values + slot * dim, job->grad, d->order, first, last, prefetch_end, dim,
                 job->scale, scale);
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

he_status he_grad_reduce(const he_dedup *d, const float *grad, int64_t dim, const he_reduce_opts *opts,
                         float *out_values, int64_t *out_indices, int64_t *out_count)
{
    he_status st = he_check_table_shape(0, dim);
    if (st != HE_OK)
        return st;
    int64_t skip_at = opts->padding_idx >= 0 ? find_unique(d, opts->padding_idx) : -1;
    reduce_job job = {d, grad, dim, skip_at, opts->scale_grad_by_freq, out_values, out_indices};
    int64_t grain = dim > 0 ? 8192 / dim + 1 : d->num_unique;
    st = he_parallel_for(d->num_unique, grain, reduce_range, &job);
    if (st == HE_OK)
        *out_count = d->num_unique - (skip_at >= 0);
    return st;
}
