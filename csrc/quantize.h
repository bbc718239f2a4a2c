/* 8-bit optimizer state: a row's values in blocks of HE_Q8_BLOCK columns,
 * each block one float32 scale and a byte per value. The block is the row
 * update's unit (the fused backward hands a row's sums over in blocks of
 * HE_REDUCE_BLOCK columns), so a block is requantized whole from its new
 * values, in registers, with no float copy of the state in memory.
 *
 * Codes are linear in a root of the value, not in the value: Adam divides
 * each element's first moment by the root of its second, so a small
 * element matters as much as a large one, and a linear code (127 steps of
 * the block's largest) rounds elements under 1/254 of it to 0 (measured:
 * 100 Zipf steps then moved some weights half as far as float32 state
 * did). A root keeps relative precision down to small values:
 *   HE_Q8        int8, c = round(127 * sign(x) sqrt(|x|) / s), x = sign(c) (c s)^2
 *                (a signed state: Adam's first moment);
 *   HE_Q8_NONNEG uint8, c = round(255 * x^(1/4) / s), x = (c s)^4, and a
 *                positive x never code 0 (a non-negative state: Adam's second
 *                moment, whose fourth root follows the first moment's square
 *                root; Adagrad's sum). The update divides by the second
 *                moment's root: a 0 there would turn a small first moment
 *                into a step of lr / eps.
 * s is the block's largest root (sqrt |x| or x^(1/4)) over 127 or 255, so
 * the block's largest element is kept to float rounding. A block with a
 * NaN or an infinity gets scale NaN and decodes to NaN, as a float state
 * would stay NaN. */
#ifndef HE_QUANTIZE_H
#define HE_QUANTIZE_H

#include <stdint.h>

#include "grad_reduce.h"

#define HE_Q8_BLOCK HE_REDUCE_BLOCK

/* Blocks (scales) of a row of dim columns. */
static inline int64_t he_q8_blocks(int64_t dim)
{
    return dim <= 0 ? 0 : (dim + HE_Q8_BLOCK - 1) / HE_Q8_BLOCK;
}

/* dst[j] = the value of codes[j] of one block (n <= HE_Q8_BLOCK). */
void he_q8_to_f32(int dtype, const void *codes, float scale, float *dst, int64_t n);

/* One block's codes and scale for src[0..n) (n <= HE_Q8_BLOCK): the root
 * rounded to the nearest code, or with stochastic, up or down with
 * probability in proportion to the distance to the other code (unbiased
 * in the root), drawn from (seed, row, col0 + j). */
void he_q8_from_f32(int dtype, const float *src, void *codes, float *scale, int64_t n, int stochastic, uint64_t seed,
                    int64_t row, int64_t col0);

#endif
