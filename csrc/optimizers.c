/* The row update of each sparse optimizer (see optimizers.h), in torch's
 * float32 arithmetic: the same operations in the same order, every one
 * rounded on its own (built with -ffp-contract=off), except where torch's
 * own kernel fuses a multiply-add (a dense tensor plus a sparse one times
 * alpha is one fmaf in torch's CPU kernel), which is written as fmaf here. */
#include "optimizers.h"

#include <inttypes.h>
#include <math.h>

#include "simd.h"

/* ---- SparseAdam: m, v per element (sparse_adam.h gives the formula). */

he_adam_consts he_adam_make_consts(const he_adam_params *hp)
{
    double bias1 = 1.0 - pow(hp->beta1, (double)hp->step);
    double bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    double step_size = hp->lr * sqrt(bias2) / bias1;
    he_adam_consts c = {(float)(1.0 - hp->beta1), (float)(1.0 - hp->beta2), (float)hp->eps, (float)(-step_size),
                        hp->maximize ? -1.0f : 1.0f, (float)(1.0 - hp->lr * hp->weight_decay)};
    return c;
}

static he_status adam_consts(const he_optim_params *hp, he_optim_consts *out)
{
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    if (!(hp->weight_decay >= 0.0))
        return he_fail(HE_ERR_VALUE, "weight_decay must be >= 0, got %g", hp->weight_decay);
    he_adam_params a = {hp->lr, hp->beta1, hp->beta2, hp->eps, hp->step, hp->maximize, hp->weight_decay};
    out->adam = he_adam_make_consts(&a);
    return HE_OK;
}

/* One pass over the row: read w, m, v, g; write w, m, v (28 bytes per
 * element, the bound the benchmark reports against). */
HE_SIMD_CLONES
static void adam_row(const he_optim_consts *oc, float *restrict w, float *const *s, const float *restrict g_row,
                     int64_t n)
{
    float *restrict m = s[0], *restrict v = s[1];
    he_adam_consts c = oc->adam;
    for (int64_t j = 0; j < n; j++) {
        float g = g_row[j] * c.sign;
        float m0 = m[j], v0 = v[j];
        float u1 = (g - m0) * c.one_minus_beta1;
        float u2 = (g * g - v0) * c.one_minus_beta2;
        float m1 = m0 + u1;
        float v1 = v0 + u2;
        float denom = sqrtf(v1) + c.eps;
        m[j] = m1;
        v[j] = v1;
        w[j] = w[j] * c.decay + (m1 / denom) * c.neg_step_size;
    }
}

/* ---- SGD (momentum 0): w += -lr * g, torch's param.add_(grad, alpha=-lr)
 * with the sparse gradient, one fmaf per element. */

static he_status sgd_consts(const he_optim_params *hp, he_optim_consts *out)
{
    /* maximize negates the gradient; the negation is exact, so it folds
     * into alpha. */
    out->alpha = (float)(hp->maximize ? hp->lr : -hp->lr);
    return HE_OK;
}

HE_SIMD_CLONES_FMA
static void sgd_row(const he_optim_consts *c, float *restrict w, float *const *s, const float *restrict g, int64_t n)
{
    (void)s;
    float alpha = c->alpha;
    for (int64_t j = 0; j < n; j++)
        w[j] = fmaf(g[j], alpha, w[j]);
}

/* ---- Adagrad (torch's sparse branch): sum += g*g; std = sqrt(sum) + eps;
 * w += -clr * (g / std), clr = lr / (1 + (step - 1) * lr_decay). */

static he_status adagrad_consts(const he_optim_params *hp, he_optim_consts *out)
{
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    double clr = hp->lr / (1.0 + (double)(hp->step - 1) * hp->lr_decay);
    out->alpha = (float)(-clr);
    out->eps = (float)hp->eps;
    out->sign = hp->maximize ? -1.0f : 1.0f;
    return HE_OK;
}

HE_SIMD_CLONES_FMA
static void adagrad_row(const he_optim_consts *c, float *restrict w, float *const *s, const float *restrict g_row,
                        int64_t n)
{
    float *restrict sum = s[0];
    float alpha = c->alpha, eps = c->eps, sign = c->sign;
    for (int64_t j = 0; j < n; j++) {
        float g = g_row[j] * sign;
        float s1 = sum[j] + g * g;
        sum[j] = s1;
        w[j] = fmaf(g / (sqrtf(s1) + eps), alpha, w[j]);
    }
}

/* ---- Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, no weight decay):
 * one accumulator per row,
 *   sum += mean(g*g over the row)   (the squares summed in column order,
 *                                    then divided by dim)
 *   w   -= (lr / (sqrt(sum) + eps)) * g
 * a third of Adam's state memory per element is gone: 4 bytes a row. */

static he_status rowwise_consts(const he_optim_params *hp, he_optim_consts *out)
{
    out->lr = (float)hp->lr;
    out->eps = (float)hp->eps;
    out->sign = hp->maximize ? -1.0f : 1.0f;
    return HE_OK;
}

HE_SIMD_CLONES
static void rowwise_row(const he_optim_consts *c, float *restrict w, float *const *s, const float *restrict g_row,
                        int64_t n)
{
    float squares = 0.0f;
    for (int64_t j = 0; j < n; j++)
        squares += g_row[j] * g_row[j]; /* (sign*g)^2 = g^2 */
    float sum = *s[0] + squares / c->dim;
    *s[0] = sum;
    float step = -(c->lr / (sqrtf(sum) + c->eps)) * c->sign;
    for (int64_t j = 0; j < n; j++)
        w[j] = w[j] + g_row[j] * step;
}

static const he_optim_rule rules[HE_OPTIM_KINDS] = {
    [HE_OPTIM_ADAM] = {"SparseAdam", 2, {"exp_avg", "exp_avg_sq"}, {0, 0}, 0, adam_consts, adam_row},
    [HE_OPTIM_SGD] = {"SGD", 0, {NULL, NULL}, {0, 0}, 0, sgd_consts, sgd_row},
    [HE_OPTIM_ADAGRAD] = {"Adagrad", 1, {"sum", NULL}, {0, 0}, 0, adagrad_consts, adagrad_row},
    [HE_OPTIM_ROWWISE_ADAGRAD] = {"RowWiseAdagrad", 1, {"row_sum", NULL}, {1, 0}, 1, rowwise_consts, rowwise_row},
};

const he_optim_rule *he_optim_rule_of(int kind)
{
    return kind >= 0 && kind < HE_OPTIM_KINDS ? &rules[kind] : NULL;
}
