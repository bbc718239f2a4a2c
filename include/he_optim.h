/* The sparse optimizers of host tables and one step's hyperparameters,
 * shared by the CPU core (csrc/optimizers.c) and, as kernels arrive, the
 * GPU update. */
#ifndef HE_OPTIM_H
#define HE_OPTIM_H

#include <stdint.h>

typedef enum he_optim_kind {
    HE_OPTIM_ADAM = 0,             /* torch.optim.SparseAdam */
    HE_OPTIM_SGD = 1,              /* torch.optim.SGD, momentum 0 */
    HE_OPTIM_ADAGRAD = 2,          /* torch.optim.Adagrad on a sparse gradient */
    HE_OPTIM_ROWWISE_ADAGRAD = 3,  /* one accumulator per row (FBGEMM's exact row-wise Adagrad) */
    HE_OPTIM_ROWWISE_ADAM = 4,     /* SparseAdam with one second moment a row (FBGEMM's partial row-wise Adam) */
    HE_OPTIM_KINDS = 5
} he_optim_kind;

typedef struct he_optim_params {
    int kind;             /* he_optim_kind */
    double lr;
    double beta1, beta2;  /* Adam */
    double eps;           /* Adam, Adagrad, row-wise Adagrad */
    double lr_decay;      /* Adagrad */
    int64_t step;         /* after this step's increment, as torch counts: 1 on the first step */
    int maximize;
    double weight_decay;  /* Adam: decoupled, on the updated rows (he_adam.h) */
    /* float16 / bfloat16 tables: round the updated weights stochastically
     * (else to nearest even), drawing from (seed, step, row, column). */
    int stochastic_rounding;
    uint64_t seed;
    /* float16, bfloat16 and 8-bit optimizer state: round stochastically
     * (else to nearest), each state drawing its own bits. */
    int state_stochastic_rounding;
} he_optim_params;

#endif
