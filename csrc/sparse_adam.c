#include "sparse_adam.h"

#include "sparse_update.h"

static he_optim_params adam_params(const he_adam_params *hp)
{
    he_optim_params p = {.kind = HE_OPTIM_ADAM, .lr = hp->lr, .beta1 = hp->beta1, .beta2 = hp->beta2,
                         .eps = hp->eps, .step = hp->step, .maximize = hp->maximize,
                         .weight_decay = hp->weight_decay};
    return p;
}

he_status he_sparse_adam(const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                         const int64_t *indices, const float *values, int64_t nnz, const he_adam_params *hp)
{
    he_optim_params p = adam_params(hp);
    he_table state[2] = {*exp_avg, *exp_avg_sq};
    return he_sparse_update(&p, weight, state, 2, indices, values, HE_F32, nnz);
}

he_status he_sparse_adam_fused(const he_dedup *d, const float *grad, const he_reduce_opts *opts,
                               const he_table *weight, const he_table *exp_avg, const he_table *exp_avg_sq,
                               const he_adam_params *hp)
{
    he_optim_params p = adam_params(hp);
    he_table state[2] = {*exp_avg, *exp_avg_sq};
    return he_sparse_update_fused(d, grad, opts, &p, weight, state, 2);
}
