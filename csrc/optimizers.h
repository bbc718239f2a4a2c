/* The sparse optimizers' row updates, applied in place to host-memory rows
 * by one threaded loop (csrc/sparse_update.c) whatever the optimizer.
 *
 * An optimizer is a rule: how many state tables it keeps (each either one
 * value per element, [num_rows, dim], or one per row, [num_rows, 1]), its
 * per-step scalars, and one function that updates one row (or a block of
 * its columns) from that row's summed gradient. Adding an optimizer:
 *   1. a kind in include/he_optim.h (and its hyperparameters there);
 *   2. in optimizers.c, a row function and a consts function, and its
 *      entry in the rules table (state layout, whole_row);
 *   3. the Python optimizer (python/hostembed/optimizers.py) passes the
 *      kind, its state tensors and its hyperparameters to _ops.sparse_update.
 * The loop, the checks, the coalescing of repeated rows and the fused
 * backward come with it. */
#ifndef HE_OPTIMIZERS_H
#define HE_OPTIMIZERS_H

#include <stdint.h>

#include "he_adam.h"
#include "he_optim.h"
#include "he_status.h"

#define HE_OPTIM_MAX_STATE 2

/* One step's scalars, computed once per step the way torch computes them. */
typedef struct he_optim_consts {
    he_adam_consts adam;
    float alpha;   /* SGD, Adagrad: what the step adds per unit of gradient (-lr, -clr; sign of maximize folded in) */
    float sign;    /* -1 to maximize */
    float lr, eps; /* row-wise Adagrad */
    float dim;     /* row-wise Adagrad: the row's length, for the mean */
} he_optim_consts;

/* Updates columns [0, n) of one row: w the weight's, s[i] state i's (a
 * per-row state points at the row's one value), g the gradient's. */
typedef void (*he_optim_row_fn)(const he_optim_consts *c, float *restrict w, float *const *s,
                                const float *restrict g, int64_t n);

typedef struct he_optim_rule {
    const char *name;
    int num_state;
    const char *state_names[HE_OPTIM_MAX_STATE];
    int per_row[HE_OPTIM_MAX_STATE]; /* 1: one value per row */
    int whole_row;                   /* the row function needs the row's whole gradient at once */
    he_status (*make_consts)(const he_optim_params *hp, he_optim_consts *out);
    he_optim_row_fn row;
} he_optim_rule;

/* The rule of hp->kind, or NULL for an unknown kind. */
const he_optim_rule *he_optim_rule_of(int kind);

#endif
