/* torch.optim.Adam and AdamW on a whole host table, every row every step,
 * as torch does with a dense gradient, but without one: rows outside the
 * batch have a zero gradient, so their update is a function of their state
 * alone, and one streaming pass over the table merges in the batch's rows.
 * A step moves 24 bytes a parameter (w, m, v read and written; 32 with
 * amsgrad), where torch also zero-fills and scatters a table-sized
 * gradient and reads it. */
#ifndef HE_DENSE_ADAM_H
#define HE_DENSE_ADAM_H

#include <stdint.h>

#include "he_status.h"
#include "table.h"

typedef struct he_dense_adam_params {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;   /* after this step's increment, as torch counts: 1 on the first step */
    int decoupled;  /* AdamW: w *= 1 - lr * weight_decay; else L2: g += weight_decay * w */
    int amsgrad;    /* keeps max_exp_avg_sq and normalises by it */
    int maximize;
} he_dense_adam_params;

/* One step of torch's single-tensor Adam (torch/optim/adam.py,
 * _single_tensor_adam) on every row of weight ([num_rows, dim], float32 or
 * float64) and its state of the same dtype and shape: exp_avg, exp_avg_sq,
 * and max_exp_avg_sq when hp->amsgrad (else NULL). The gradient is rows
 * indices[0..nnz) (strictly ascending, in [0, num_rows)) of values ([nnz,
 * dim], row-major, the weight's dtype); every other row's is zero. Tables
 * that do not fit their buffers, overlap or differ in shape or dtype, and
 * indices out of range (HE_ERR_INDEX) or not ascending (HE_ERR_VALUE), are
 * refused before anything is written.
 *
 * The arithmetic of torch's CPU kernels, element by element in the order
 * its passes run (g negated to maximize; then L2 g = fma(w, wd, g) or AdamW
 * w = w * (1 - lr*wd); m = lerp(m, g, 1-b1) as torch's vectorised lerp,
 * one FMA; v = v * b2, then v = fma((1-b2) * g, g, v); amsgrad: vmax =
 * max(vmax, v); denom = sqrt(v or vmax) / sqrt(1-b2^t) + eps; w = w +
 * (-(lr / (1-b1^t)) * m) / denom), each scalar rounded to the table's dtype
 * as torch rounds a Python float. sqrt here is correctly rounded; torch's
 * vectorised sqrt may not be (see sparse_adam.h), so results match torch's
 * to an ulp or two rather than always to the bit.
 *
 * Only rows [first_row, end_row) are stepped, the gradient's indices among
 * them (HE_ERR_VALUE otherwise): the whole table is [0, num_rows); a
 * process of several that share one table steps its own range. */
he_status he_dense_adam(const he_dense_adam_params *hp, const he_table *weight, const he_table *exp_avg,
                        const he_table *exp_avg_sq, const he_table *max_exp_avg_sq, int64_t first_row,
                        int64_t end_row, const int64_t *indices, const void *values, int64_t nnz);

#endif
