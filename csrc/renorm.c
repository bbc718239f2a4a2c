#include "renorm.h"

#include <inttypes.h>
#include <math.h>

#include "convert.h"
#include "ids.h"
#include "thread_pool.h"

typedef struct renorm_job {
    const he_table *table;
    const he_dedup *d;
    double max_norm, p;
} renorm_job;

/* A p-norm that neither overflows nor underflows for any p: with m = max|x|,
 * ||x||_p = m * (sum (|x|/m)^p)^(1/p). Every term is in [0, 1] and the
 * largest is 1, so the sum is in [1, dim]: |x|^p itself overflows double
 * for |x| > 10.9 at p = 300 (the row would then get scale 0) and underflows
 * for small |x|. m == 0 (or only NaN besides zeros) gives 0, m == inf gives
 * inf; a NaN element makes the sum, and so the norm, NaN (no renorm).
 * cuda/renorm.cu computes the same expression. */
static double scaled_p_norm(int dtype, const void *row, int64_t dim, double p)
{
    double m = 0.0;
    for (int64_t j = 0; j < dim; j++)
        m = fmax(m, fabs(he_elem_to_f64(dtype, row, j)));
    if (!(m > 0.0) || isinf(m))
        return m;
    double acc = 0.0;
    for (int64_t j = 0; j < dim; j++)
        acc += pow(fabs(he_elem_to_f64(dtype, row, j)) / m, p);
    return m * pow(acc, 1.0 / p);
}

/* Accumulated in double and rounded to the table's dtype: torch computes
 * the norm of a row in its dtype (float16 and bfloat16 accumulated in
 * float32), so the rounded double result is what it would get with an
 * exact sum (and without its overflow: see scaled_p_norm). A float64
 * row's norm is the double sum itself. */
static double row_norm(int dtype, const void *row, int64_t dim, double p)
{
    double acc = 0.0;
    if (p == 2.0) {
        for (int64_t j = 0; j < dim; j++) {
            double x = he_elem_to_f64(dtype, row, j);
            acc += x * x;
        }
        acc = sqrt(acc);
    } else if (p == 1.0) {
        for (int64_t j = 0; j < dim; j++)
            acc += fabs(he_elem_to_f64(dtype, row, j));
    } else if (isinf(p)) {
        for (int64_t j = 0; j < dim; j++)
            acc = fmax(acc, fabs(he_elem_to_f64(dtype, row, j)));
    } else if (p == 0.0) {
        for (int64_t j = 0; j < dim; j++)
            acc += he_elem_to_f64(dtype, row, j) != 0.0;
    } else {
        acc = scaled_p_norm(dtype, row, dim, p);
    }
    return he_round_to(dtype, acc);
}

/* row *= scale in torch's arithmetic for the dtype: float64 in double,
 * float32 in float, the half types in float then rounded to nearest. */
static void scale_row(int dtype, void *row, int64_t dim, double scale)
{
    if (dtype == HE_F64) {
        double *r = row;
        for (int64_t j = 0; j < dim; j++)
            r[j] *= scale;
    } else if (dtype == HE_F32) {
        float *r = row, s = (float)scale;
        for (int64_t j = 0; j < dim; j++)
            r[j] *= s;
    } else {
        float s = (float)scale, block[256];
        for (int64_t col = 0; col < dim; col += 256) {
            int64_t n = dim - col < 256 ? dim - col : 256;
            void *at = (char *)row + (size_t)col * he_dtype_size(dtype);
            he_row_to_f32(dtype, at, block, n);
            for (int64_t j = 0; j < n; j++)
                block[j] *= s;
            he_row_from_f32(dtype, block, at, n, 0, 0, 0, 0);
        }
    }
}

static void renorm_range(void *ctx, int64_t begin, int64_t end)
{
    renorm_job *job = ctx;
    int64_t dim = job->table->dim;
    int dtype = job->table->dtype;
    for (int64_t k = begin; k < end; k++) {
        void *row = he_table_row(job->table, job->d->unique[k]);
        double norm = row_norm(dtype, row, dim, job->p);
        if (norm > job->max_norm)
            scale_row(dtype, row, dim, job->max_norm / (norm + 1e-7));
    }
}

he_status he_renorm(const he_table *table, const he_dedup *d, double max_norm, double norm_type)
{
    he_status st = he_table_check(table, "table");
    if (st != HE_OK)
        return st;
    if (d->num_rows != table->num_rows)
        return he_fail(HE_ERR_VALUE,
                       "renorm: the ids were checked against a table of %" PRId64 " rows, the table has %" PRId64,
                       d->num_rows, table->num_rows);
    if (!(norm_type >= 0.0))
        return he_fail(HE_ERR_VALUE, "norm_type must be >= 0 (or inf), got %g", norm_type);
    if (!(max_norm >= 0.0))
        return he_fail(HE_ERR_VALUE, "max_norm must be >= 0, got %g", max_norm);
    if (table->dim == 0)
        return HE_OK; /* every norm is 0 */
    renorm_job job = {table, d, max_norm, norm_type};
    int64_t grain = 8192 / table->dim + 1;
    int64_t bytes = 2 * d->num_unique * table->dim * (int64_t)he_table_elem(table);
    return he_parallel_for_bytes(d->num_unique, grain, bytes, renorm_range, &job);
}
