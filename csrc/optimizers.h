/* The sparse optimizers' row updates, applied in place to host-memory rows
 * by one threaded loop (csrc/sparse_update.c) whatever the optimizer.
 *
 * An optimizer is a rule: how many state tables it keeps (each either one
 * value per element, [num_rows, dim], or one per row, [num_rows, 1]), its
 * per-step scalars, and one function that updates one row (or a block of
 * its columns) from that row's summed gradient. Adding an optimizer:
 *   1. a kind in include/he_optim.h (and its hyperparameters there);
 *   2. in optimizer_rows.inc, its row function (and, if it needs the
 *      whole row's gradient first, a prelude), written once over REAL:
 *      optimizers.c builds each for float and for double; in
 *      optimizers.c, a consts function and its entry in the rules table
 *      (state layout, the functions);
 *   3. its kind in python/hostembed/_core/ops/update.py, and a Python
 *      optimizer (a file in python/hostembed/optim/, over base.py) that
 *      passes the kind, its state tensors and its hyperparameters to
 *      update.sparse_update.
 * The loop, the checks, the coalescing of repeated rows, the fused
 * backward and every table dtype (float16 and bfloat16 rows are widened
 * into float blocks around the row function) come with it. */
#ifndef HE_OPTIMIZERS_H
#define HE_OPTIMIZERS_H

#include <stdint.h>

#include "he_adam.h"
#include "he_optim.h"
#include "he_status.h"

#define HE_OPTIM_MAX_STATE 2

/* One step's scalars, computed once per step the way torch computes them
 * (in double, as Python does); the float32 row functions round each to
 * float, as torch does where it multiplies a float tensor by a Python
 * float, and the float64 ones use them as they are. */
typedef struct he_optim_consts {
    double one_minus_beta1, one_minus_beta2, neg_step_size, decay; /* Adam (he_adam.h) */
    double alpha;  /* SGD, Adagrad: what the step adds per unit of gradient (-lr, -clr; sign of maximize folded in) */
    double sign;   /* -1 to maximize */
    double lr, eps; /* eps: Adam, Adagrad, row-wise Adagrad; lr: row-wise Adagrad */
    double dim;    /* row-wise Adagrad: the row's length, for the mean */
} he_optim_consts;

/* Updates columns [0, n) of one row in the compute type (float for
 * float32, float16 and bfloat16 tables, double for float64 ones): w the
 * weight's, s[i] state i's (a per-row state points at the row's one
 * value), g the gradient's; row_scalar is what the rule's prelude returned
 * for the row (0 without one). Element-wise: any block of columns may come
 * on its own. */
typedef void (*he_optim_row_f32)(const he_optim_consts *c, float *restrict w, float *const *s,
                                 const float *restrict g, int64_t n, float row_scalar);
typedef void (*he_optim_row_f64)(const he_optim_consts *c, double *restrict w, double *const *s,
                                 const double *restrict g, int64_t n, double row_scalar);
/* A rule's whole-row part, run once per row before its columns: reads the
 * row's whole gradient (n = dim) and its per-row state, updates that state,
 * and returns the scalar the column updates use. */
typedef float (*he_optim_prelude_f32)(const he_optim_consts *c, float *const *s, const float *restrict g, int64_t n);
typedef double (*he_optim_prelude_f64)(const he_optim_consts *c, double *const *s, const double *restrict g,
                                       int64_t n);

typedef struct he_optim_rule {
    const char *name;
    int num_state;
    const char *state_names[HE_OPTIM_MAX_STATE];
    int per_row[HE_OPTIM_MAX_STATE]; /* 1: one value per row */
    int nonnegative[HE_OPTIM_MAX_STATE]; /* 1: never below 0 (may be kept as HE_Q8_NONNEG) */
    he_status (*make_consts)(const he_optim_params *hp, he_optim_consts *out);
    he_optim_row_f32 row_f32;
    he_optim_row_f64 row_f64;
    he_optim_prelude_f32 prelude_f32; /* NULL: none (the rule is element-wise) */
    he_optim_prelude_f64 prelude_f64;
} he_optim_rule;

/* The rule of hp->kind, or NULL for an unknown kind. */
const he_optim_rule *he_optim_rule_of(int kind);

#endif
