#include "dense_adam.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>

#include "he_ids.h"
#include "simd.h"
#include "thread_pool.h"

/* One step's scalars, in double as Python computes them (torch builds them
 * from Python floats); the float32 runs round each to float, as torch's
 * kernels round a Python float. */
typedef struct dense_consts {
    double sign, weight_decay, decay, lerp_coeff, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
    int l2, decoupled, small_weight;
} dense_consts;

#define HE_REAL_TEMPLATE "dense_adam_row.inc"
#include "for_each_real.inc"

typedef struct dense_job {
    dense_consts c;
    he_table t[4]; /* weight, exp_avg, exp_avg_sq, max_exp_avg_sq (data NULL without amsgrad) */
    int contiguous; /* every table row-major: a run of rows is one run of elements */
    const int64_t *indices;
    const char *values;
    int64_t nnz;
    int64_t first_row; /* the parallel loop's row 0 */
} dense_job;

/* Rows [r, r + count) of every table, with gradient g (count == 1) or none. */
static void run_rows(const dense_job *job, int64_t r, int64_t count, const void *g)
{
    int64_t dim = job->t[0].dim;
    void *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = job->t[i].data ? he_table_row(&job->t[i], r) : NULL;
    if (job->t[0].dtype == HE_F64)
        adam_run_f64(&job->c, p[0], p[1], p[2], p[3], g, count * dim);
    else
        adam_run_f32(&job->c, p[0], p[1], p[2], p[3], g, count * dim);
}

/* The first k with indices[k] >= row. */
static int64_t first_at_or_after(const int64_t *indices, int64_t nnz, int64_t row)
{
    int64_t lo = 0, hi = nnz;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (indices[mid] < row)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void rows_range(void *ctx, int64_t begin, int64_t end)
{
    const dense_job *job = ctx;
    begin += job->first_row;
    end += job->first_row;
    size_t row_bytes = (size_t)job->t[0].dim * he_table_elem(&job->t[0]);
    int64_t k = first_at_or_after(job->indices, job->nnz, begin);
    int64_t r = begin;
    while (r < end) {
        int64_t next = k < job->nnz && job->indices[k] < end ? job->indices[k] : end;
        if (r < next) {
            /* Rows without a gradient: one run when the tables are
             * row-major, else row by row. */
            if (job->contiguous)
                run_rows(job, r, next - r, NULL);
            else
                for (int64_t q = r; q < next; q++)
                    run_rows(job, q, 1, NULL);
            r = next;
            continue;
        }
        run_rows(job, r, 1, job->values + (size_t)k * row_bytes);
        k++;
        r++;
    }
}

static he_status make_consts(const he_dense_adam_params *hp, int dtype, dense_consts *c)
{
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    double bias1 = 1.0 - pow(hp->beta1, (double)hp->step);
    double bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    double weight = 1.0 - hp->beta1;
    c->sign = hp->maximize ? -1.0 : 1.0;
    c->l2 = hp->weight_decay != 0.0 && !hp->decoupled;
    c->decoupled = hp->weight_decay != 0.0 && hp->decoupled;
    c->weight_decay = hp->weight_decay;
    c->decay = 1.0 - hp->lr * hp->weight_decay;
    /* torch decides on the weight as its kernel sees it (rounded to the
     * dtype), and computes weight - 1 in that dtype. */
    if (dtype == HE_F32) {
        c->small_weight = fabsf((float)weight) < 0.5f;
        c->lerp_coeff = c->small_weight ? weight : (double)((float)weight - 1.0f);
    } else {
        c->small_weight = fabs(weight) < 0.5;
        c->lerp_coeff = c->small_weight ? weight : weight - 1.0;
    }
    c->beta2 = hp->beta2;
    c->one_minus_beta2 = 1.0 - hp->beta2;
    c->bias2_sqrt = pow(bias2, 0.5);
    c->eps = hp->eps;
    c->neg_step_size = -(hp->lr / bias1);
    return HE_OK;
}

he_status he_dense_adam(const he_dense_adam_params *hp, const he_table *weight, const he_table *exp_avg,
                        const he_table *exp_avg_sq, const he_table *max_exp_avg_sq, int64_t first_row,
                        int64_t end_row, const int64_t *indices, const void *values, int64_t nnz)
{
    static const char *names[4] = {"weight", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    dense_job job = {0};
    if ((max_exp_avg_sq != NULL) != (hp->amsgrad != 0))
        return he_fail(HE_ERR_VALUE, "max_exp_avg_sq must be given exactly when amsgrad is set");
    const he_table *given[4] = {weight, exp_avg, exp_avg_sq, max_exp_avg_sq};
    he_status st;
    if (weight->dtype != HE_F32 && weight->dtype != HE_F64)
        return he_fail(HE_ERR_VALUE, "Adam over a whole table takes float32 or float64 tables, got %s",
                       he_dtype_name(weight->dtype));
    job.contiguous = 1;
    for (int i = 0; i < 4; i++) {
        if (!given[i])
            continue;
        if ((st = he_table_check(given[i], names[i])) != HE_OK)
            return st;
        if (given[i]->dtype != weight->dtype || given[i]->num_rows != weight->num_rows ||
            given[i]->dim != weight->dim)
            return he_fail(HE_ERR_VALUE,
                           "Adam's %s must be a %s [%" PRId64 ", %" PRId64 "] table like the weight, got %s [%" PRId64
                           ", %" PRId64 "]",
                           names[i], he_dtype_name(weight->dtype), weight->num_rows, weight->dim,
                           he_dtype_name(given[i]->dtype), given[i]->num_rows, given[i]->dim);
        for (int j = 0; j < i; j++)
            if (given[j] && he_table_overlap(given[i], given[j]))
                return he_fail(HE_ERR_VALUE, "Adam's %s and %s overlap", names[j], names[i]);
        job.t[i] = *given[i];
        job.contiguous &= given[i]->row_stride == given[i]->dim;
    }
    if (nnz < 0)
        return he_fail(HE_ERR_VALUE, "a gradient needs nnz >= 0, got %" PRId64, nnz);
    if (first_row < 0 || first_row > end_row || end_row > weight->num_rows)
        return he_fail(HE_ERR_VALUE, "rows [%" PRId64 ", %" PRId64 ") are not a range of a %" PRId64 "-row table",
                       first_row, end_row, weight->num_rows);
    for (int64_t k = 0; k < nnz; k++) {
        if ((uint64_t)indices[k] >= (uint64_t)weight->num_rows)
            return he_fail_out_of_range(k, indices[k], weight->num_rows);
        if (indices[k] < first_row || indices[k] >= end_row)
            return he_fail(HE_ERR_VALUE, "the gradient's row %" PRId64 " (index %" PRId64 ") is outside the rows [%"
                           PRId64 ", %" PRId64 ") this step updates", indices[k], k, first_row, end_row);
        if (k > 0 && indices[k] <= indices[k - 1])
            return he_fail(HE_ERR_VALUE, "the gradient's row indices must be strictly ascending (coalesced); "
                                         "index %" PRId64 " is %" PRId64 " after %" PRId64,
                           k, indices[k], indices[k - 1]);
    }
    if ((st = make_consts(hp, weight->dtype, &job.c)) != HE_OK)
        return st;
    if (end_row == first_row || weight->dim == 0)
        return HE_OK;
    job.indices = indices;
    job.values = values;
    job.nnz = nnz;
    job.first_row = first_row;
    /* w, m, v (and vmax) read and written. */
    int64_t bytes = (end_row - first_row) * weight->dim * (int64_t)he_table_elem(weight) * (hp->amsgrad ? 8 : 6);
    return he_parallel_for_bytes(end_row - first_row, 16384 / weight->dim + 1, bytes, rows_range, &job);
}
