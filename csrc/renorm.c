#include "renorm.h"

#include <math.h>

#include "ids.h"
#include "thread_pool.h"

typedef struct renorm_job {
    float *table;
    int64_t dim;
    const he_dedup *d;
    double max_norm, p;
} renorm_job;

/* Accumulated in double and rounded to float: torch computes the norm of a
 * float row in float, so the rounded double result is what it would get
 * with an exact sum. */
static float row_norm(const float *row, int64_t dim, double p)
{
    double acc = 0.0;
    if (p == 2.0) {
        for (int64_t j = 0; j < dim; j++)
            acc += (double)row[j] * row[j];
        return (float)sqrt(acc);
    }
    if (p == 1.0) {
        for (int64_t j = 0; j < dim; j++)
            acc += fabs((double)row[j]);
        return (float)acc;
    }
    if (isinf(p)) {
        for (int64_t j = 0; j < dim; j++)
            acc = fmax(acc, fabs((double)row[j]));
        return (float)acc;
    }
    if (p == 0.0) {
        for (int64_t j = 0; j < dim; j++)
            acc += row[j] != 0.0f;
        return (float)acc;
    }
    for (int64_t j = 0; j < dim; j++)
        acc += pow(fabs((double)row[j]), p);
    return (float)pow(acc, 1.0 / p);
}

static void renorm_range(void *ctx, int64_t begin, int64_t end)
{
    renorm_job *job = ctx;
    for (int64_t k = begin; k < end; k++) {
        float *row = job->table + job->d->unique[k] * job->dim;
        double norm = row_norm(row, job->dim, job->p);
        if (norm > job->max_norm) {
            float scale = (float)(job->max_norm / (norm + 1e-7));
            for (int64_t j = 0; j < job->dim; j++)
                row[j] *= scale;
        }
    }
}

he_status he_renorm(float *table, int64_t num_rows, int64_t dim, const he_dedup *d, double max_norm,
                    double norm_type)
{
    he_status st = he_check_table_shape(num_rows, dim);
    if (st != HE_OK)
        return st;
    if (!(norm_type >= 0.0))
        return he_fail(HE_ERR_VALUE, "norm_type must be >= 0 (or inf), got %g", norm_type);
    if (!(max_norm >= 0.0))
        return he_fail(HE_ERR_VALUE, "max_norm must be >= 0, got %g", max_norm);
    renorm_job job = {table, dim, d, max_norm, norm_type};
    int64_t grain = dim > 0 ? 8192 / dim + 1 : d->num_unique;
    return he_parallel_for(d->num_unique, grain, renorm_range, &job);
}
