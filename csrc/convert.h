/* float16 / bfloat16 <-> float32 for the rows of half-precision tables:
 * loads widen exactly; stores round to nearest even (as torch's casts do,
 * NaN kept a NaN) or, when asked, stochastically. */
#ifndef HE_CONVERT_H
#define HE_CONVERT_H

#include <stdint.h>

#include "he_dtype.h"

/* dst[j] = src[j] as float32, for a float32, float16 or bfloat16 row. */
void he_row_to_f32(int dtype, const void *src, float *dst, int64_t n);

/* dst[j] = src[j] rounded to dtype (float32, float16 or bfloat16).
 * stochastic: 0 rounds to nearest even; otherwise each element rounds up or
 * down with probability proportional to its distance from the other
 * neighbour (so the rounding is unbiased in expectation), drawn from a
 * counter-based hash of (seed, row, col0 + j): the same bits for the same
 * seed whatever the thread count or block size. */
void he_row_from_f32(int dtype, const float *src, void *dst, int64_t n, int stochastic, uint64_t seed, int64_t row,
                     int64_t col0);

/* The random bits stochastic rounding draws for element (row, col) under
 * seed: splitmix64's finaliser as a counter-based hash, no state between
 * calls (so the same bits whatever the thread count or block size). */
static inline uint64_t he_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t he_draw(uint64_t seed, int64_t row, int64_t col)
{
    return he_mix64(seed ^ he_mix64((uint64_t)row * 0x9E3779B97F4A7C15ull + (uint64_t)col));
}

/* dst[j] = src[j] rounded to dtype's precision to nearest even, as float. */
void he_round_row_f32(int dtype, const float *src, float *dst, int64_t n);

/* One element of a row of any dtype, widened to double (cold paths). */
double he_elem_to_f64(int dtype, const void *row, int64_t j);

/* x rounded to dtype's precision and widened back to double. */
double he_round_to(int dtype, double x);

#endif
