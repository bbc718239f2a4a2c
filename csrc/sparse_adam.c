#include "sparse_adam.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "dedup.h"
#include "grad_reduce.h"
#include "ids.h"
#include "simd.h"
#include "thread_pool.h"

typedef struct adam_job {
    float *w, *m, *v;
    int64_t dim;
    const int64_t *indices;
    const float *values;
    he_adam_consts c;
} adam_job;

/* One pass over the row: read w, m, v, g; write w, m, v (28 bytes per
 * element, the bound the benchmark reports against). */
HE_SIMD_CLONES
static void adam_row(float *restrict w, float *restrict m, float *restrict v, const float *restrict g_row,
                     int64_t dim, he_adam_consts c)
{
    for (int64_t j = 0; j < dim; j++) {
        float g = g_row[j] * c.sign;
        float m0 = m[j], v0 = v[j];
        float u1 = (g - m0) * c.one_minus_beta1;
        float u2 = (g * g - v0) * c.one_minus_beta2;
        float m1 = m0 + u1;
        float v1 = v0 + u2;
        float denom = sqrtf(v1) + c.eps;
        m[j] = m1;
        v[j] = v1;
        w[j] = w[j] + (m1 / denom) * c.neg_step_size;
    }
}

static void adam_range(void *ctx, int64_t begin, int64_t end)
{
    adam_job *job = ctx;
    int64_t dim = job->dim;
    size_t row_bytes = (size_t)dim * sizeof(float);
    for (int64_t k = begin; k < end; k++) {
        if (k + HE_PREFETCH_AHEAD < end) {
            int64_t ahead = job->indices[k + HE_PREFETCH_AHEAD] * dim;
            he_prefetch_row(job->w + ahead, row_bytes, 1);
            he_prefetch_row(job->m + ahead, row_bytes, 1);
            he_prefetch_row(job->v + ahead, row_bytes, 1);
        }
        int64_t off = job->indices[k] * dim;
        adam_row(job->w + off, job->m + off, job->v + off, job->values + k * dim, dim, job->c);
    }
}

he_adam_consts he_adam_make_consts(const he_adam_params *hp)
{
    double bias1 = 1.0 - pow(hp->beta1, (double)hp->step);
    double bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    double step_size = hp->lr * sqrt(bias2) / bias1;
    he_adam_consts c = {(float)(1.0 - hp->beta1), (float)(1.0 - hp->beta2), (float)hp->eps, (float)(-step_size),
                        hp->maximize ? -1.0f : 1.0f};
    return c;
}

static he_status update_rows(float *weight, float *exp_avg, float *exp_avg_sq, int64_t dim,
                             const int64_t *indices, const float *values, int64_t nnz, const he_adam_params *hp)
{
    adam_job job = {weight, exp_avg, exp_avg_sq, dim, indices, values, he_adam_make_consts(hp)};
    int64_t grain = dim > 0 ? 4096 / dim + 1 : nnz;
    return he_parallel_for(nnz, grain, adam_range, &job);
}

he_status he_sparse_adam(float *weight, float *exp_avg, float *exp_avg_sq, int64_t num_rows, int64_t dim,
                         const int64_t *indices, const float *values, int64_t nnz, const he_adam_params *hp)
{
    he_status st = he_check_table_shape(num_rows, dim);
    if (st != HE_OK)
        return st;
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    int ascending = 1;
    for (int64_t k = 0; k < nnz; k++) {
        if ((uint64_t)indices[k] >= (uint64_t)num_rows)
            return he_fail_out_of_range(k, indices[k], num_rows);
        if (k > 0 && indices[k] <= indices[k - 1])
            ascending = 0;
    }
    if (ascending)
        return update_rows(weight, exp_avg, exp_avg_sq, dim, indices, values, nnz, hp);

    he_dedup *d = NULL;
    int64_t *unique_rows = NULL;
    float *sums = NULL;
    int64_t count = 0;
    he_ids ids = {indices, nnz, 1};
    st = he_dedup_build(&ids, num_rows, &d);
    if (st != HE_OK)
        goto done;
    size_t u = (size_t)(d->num_unique > 0 ? d->num_unique : 1);
    unique_rows = malloc(u * sizeof *unique_rows);
    sums = malloc(u * (size_t)(dim > 0 ? dim : 1) * sizeof *sums);
    if (!unique_rows || !sums) {
        st = he_fail(HE_ERR_NOMEM, "could not allocate %zu bytes to coalesce a gradient of %" PRId64 " rows",
                     u * ((size_t)dim * sizeof *sums + sizeof *unique_rows), nnz);
        goto done;
    }
    he_reduce_opts opts = {-1, 0};
    st = he_grad_reduce(d, values, dim, &opts, sums, unique_rows, &count);
    if (st == HE_OK)
        st = update_rows(weight, exp_avg, exp_avg_sq, dim, unique_rows, sums, count, hp);
done:
    he_dedup_free(d);
    free(unique_rows);
    free(sums);
    return st;
}
