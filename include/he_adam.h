/* SparseAdam's hyperparameters and per-step scalars, shared by the CPU
 * update (csrc/sparse_adam.c, which also computes the scalars) and the GPU
 * one (cuda/sparse_adam.cu), so both round alike. */
#ifndef HE_ADAM_H
#define HE_ADAM_H

#include <stdint.h>

typedef struct he_adam_params {
    double lr, beta1, beta2, eps;
    int64_t step; /* after this step's increment, as torch counts: 1 on the first step */
    int maximize;
    /* Decoupled (AdamW's) weight decay, on the rows the step updates only:
     * w *= 1 - lr * weight_decay before the Adam update, as AdamW orders it. */
    double weight_decay;
} he_adam_params;

/* The per-step scalars of the update, computed the way Python computes
 * them and rounded to float where torch multiplies a float tensor by a
 * Python float. */
typedef struct he_adam_consts {
    float one_minus_beta1, one_minus_beta2, eps, neg_step_size, sign;
    float decay; /* 1 - lr * weight_decay (exactly 1 without decay: w * 1 is w) */
} he_adam_consts;

he_adam_consts he_adam_make_consts(const he_adam_params *hp);

#endif
