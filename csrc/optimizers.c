/* The sparse optimizers (see optimizers.h): each step's scalars, and the
 * rules table over the row functions of optimizer_rows.inc. */
#include "optimizers.h"

#include <inttypes.h>
#include <math.h>

#include "simd.h"

#define HE_REAL_TEMPLATE "optimizer_rows.inc"
#include "for_each_real.inc"

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
    double bias1 = 1.0 - pow(hp->beta1, (double)hp->step);
    double bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    out->one_minus_beta1 = 1.0 - hp->beta1;
    out->one_minus_beta2 = 1.0 - hp->beta2;
    out->eps = hp->eps;
    out->neg_step_size = -(hp->lr * sqrt(bias2) / bias1);
    out->sign = hp->maximize ? -1.0 : 1.0;
    out->decay = 1.0 - hp->lr * hp->weight_decay;
    return HE_OK;
}

static he_status sgd_consts(const he_optim_params *hp, he_optim_consts *out)
{
    /* maximize negates the gradient; the negation is exact, so it folds
     * into alpha. */
    out->alpha = hp->maximize ? hp->lr : -hp->lr;
    return HE_OK;
}

static he_status adagrad_consts(const he_optim_params *hp, he_optim_consts *out)
{
    if (hp->step < 1)
        return he_fail(HE_ERR_VALUE, "step must be >= 1, got %" PRId64, hp->step);
    double clr = hp->lr / (1.0 + (double)(hp->step - 1) * hp->lr_decay);
    out->alpha = -clr;
    out->eps = hp->eps;
    out->sign = hp->maximize ? -1.0 : 1.0;
    return HE_OK;
}

static he_status rowwise_consts(const he_optim_params *hp, he_optim_consts *out)
{
    out->lr = hp->lr;
    out->eps = hp->eps;
    out->sign = hp->maximize ? -1.0 : 1.0;
    return HE_OK;
}

#define ROW_FNS(name) name##_row_f32, name##_row_f64

static const he_optim_rule rules[HE_OPTIM_KINDS] = {
    [HE_OPTIM_ADAM] = {"SparseAdam", 2, {"exp_avg", "exp_avg_sq"}, {0, 0}, {0, 1}, adam_consts, ROW_FNS(adam), NULL,
                       NULL},
    [HE_OPTIM_SGD] = {"SGD", 0, {NULL, NULL}, {0, 0}, {0, 0}, sgd_consts, ROW_FNS(sgd), NULL, NULL},
    [HE_OPTIM_ADAGRAD] = {"Adagrad", 1, {"sum", NULL}, {0, 0}, {1, 0}, adagrad_consts, ROW_FNS(adagrad), NULL, NULL},
    [HE_OPTIM_ROWWISE_ADAGRAD] = {"RowWiseAdagrad", 1, {"row_sum", NULL}, {1, 0}, {1, 0}, rowwise_consts,
                                  ROW_FNS(rowwise), rowwise_prelude_f32, rowwise_prelude_f64},
    [HE_OPTIM_ROWWISE_ADAM] = {"SparseAdam", 2, {"exp_avg", "exp_avg_sq"}, {0, 1}, {0, 1}, adam_consts,
                               ROW_FNS(rowwise_adam), rowwise_adam_prelude_f32, rowwise_adam_prelude_f64},
};

const he_optim_rule *he_optim_rule_of(int kind)
{
    return kind >= 0 && kind < HE_OPTIM_KINDS ? &rules[kind] : NULL;
}
