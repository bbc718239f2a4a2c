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
    int64_t dim, w_stride, m_stride, v_stride;
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
            int64_t ahead = job->indices[k + HE_PREFETCH_AHEAD];
            he_prefetch_row(job->w + ahead * job->w_stride, row_bytes, 1);
            he_prefetch_row(job->m + ahead * job->m_stride, row_bytes, 1);
            he_prefetch_row(job->v + ahead * job->v_stride, row_bytes, 1);
        }
        int64_t r = job->indices[k];
        adam_row(job->w + r * job->w_stride, job->m + r * job->m_stride, job->v + r * job->v_stride,
                 job->values + k * dim, dim, job->c);
    }
}

/* The fused backward's row update: the same adam_row, on the sum's column
 * block (Adam is element-wise, so a row updated block by block is the same
 * bits). */
typedef struct fused_ctx {
    he_table w, m, v;
    he_adam_consts c;
} fused_ctx;

static void fused_apply(const void *ctx, int64_t row, int64_t col, const float *sum, int64_t n)
{
    const fused_ctx *f = ctx;
    adam_row(he_table_row(&f->w, row) + col, he_table_row(&f->m, row) + col, he_table_row(&f->v, row) + col, sum, n,
             f->c);
}

static void fused_prefetch(const void *ctx, int64_t row)
{
    const fused_ctx *f = ctx;
    size_t row_bytes = (size_t)f->w.dim * sizeof(float);
    he_prefetch_row(he_table_row(&f->w, row), row_bytes, 1);
    he_prefetch_row(he_table_row(&f->m, row), row_bytes, 1);
    he_prefetch_row(he_table_row(&f->v, row), row_bytes, 1);
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

static he_status update_rows(const he_table *w, const he_table *m, const he_table *v, const int64_t *indices,
                             const float *values, int64_t nnz, const he_adam_params *hp)
{
    int64_t dim = w->dim;
    if (dim == 0)
        return HE_OK; /* nothing to update (the indices were checked) */
    adam_job job = {.w = w->data, .m = m->data, .v = v->data, .dim = dim,
                    .w_stride = w->row_stride, .m_stride = m->row_stride, .v_stride = v->row_stride,
                    .indices = indices, .values = values, .c = he_adam_make_consts(hp)};
    int64_t grain = 4096 / dim + 1;
    return he_parallel_for(nnz, grain, adam_range, &job);
}

/* The state must have the weight's shape (its own row stride is fine) and
 * memory of its own: the row update reads and writes w, m and v through
 * restrict pointers. */
static he_status check_state(const he_table *w, const he_table *s, const char *what)
{
    he_status st = he_table_check(s, what);
    if (st != HE_OK)
        return st;
    if (s->num_rows != w->num_rows || s->dim != w->dim)
        return he_fail(HE_ERR_VALUE, "%s: a [%" PRId64 ", %" PRId64 "] table for a [%" PRId64 ", %" PRId64 "] weight",
                       what, s->num_rows, s->dim, w->num_rows, w->dim);
    if (he_table_overlap(s, w))
        return he_fail(HE_ERR_VALUE, "%s overlaps the weight's memory", what);
    return HE_OK;
}

static he_status check_update(const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                              const he_adam_params *hp)
{
    he_status st = he_table_check(weight, "weight");
    if (st == HE_OK)
        st = check_state(weight, exp_avg, "exp_avg");
    if (st == HE_OK)
        st = check_state(weight, exp_avg_sq, "exp_avg_sq");
    if (st == HE_OK && he_table_overlap(exp_avg, exp_avg_sq))
        st = he_fail(HE_ERR_VALUE, "exp_avg and exp_avg_sq overlap");
    if (st == HE_OK && hp->step < 1)
        st = he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    return st;
}

he_status he_sparse_adam_fused(const he_dedup *d, const float *grad, const he_reduce_opts *opts,
                               const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                               const he_adam_params *hp)
{
    he_status st = check_update(weight, exp_avg, exp_avg_sq, hp);
    if (st != HE_OK)
        return st;
    /* The ids were range-checked against d->num_rows when it was built. */
    if (d->num_rows != weight->num_rows)
        return he_fail(HE_ERR_VALUE, "the ids were checked against %" PRId64 " rows, the table has %" PRId64,
                       d->num_rows, weight->num_rows);
    fused_ctx f = {*weight, *exp_avg, *exp_avg_sq, he_adam_make_consts(hp)};
    he_row_update update = {fused_apply, fused_prefetch, &f};
    return he_grad_reduce_apply(d, grad, weight->dim, opts, &update);
}

he_status he_sparse_adam(const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                         const int64_t *indices, const float *values, int64_t nnz, const he_adam_params *hp)
{
    he_status st = check_update(weight, exp_avg, exp_avg_sq, hp);
    if (st != HE_OK)
        return st;
    int64_t num_rows = weight->num_rows, dim = weight->dim;
    if (nnz < 0)
        return he_fail(HE_ERR_VALUE, "a gradient needs nnz >= 0, got %" PRId64, nnz);
    int ascending = 1;
    for (int64_t k = 0; k < nnz; k++) {
        if ((uint64_t)indices[k] >= (uint64_t)num_rows)
            return he_fail_out_of_range(k, indices[k], num_rows);
        if (k > 0 && indices[k] <= indices[k - 1])
            ascending = 0;
    }
    if (ascending)
        return update_rows(weight, exp_avg, exp_avg_sq, indices, values, nnz, hp);

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
        st = update_rows(weight, exp_avg, exp_avg_sq, unique_rows, sums, count, hp);
done:
    he_dedup_free(d);
    free(unique_rows);
    free(sums);
    return st;
}
