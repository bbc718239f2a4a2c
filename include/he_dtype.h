/* The element types a host table may have, shared by the CPU core, the
 * binding and the kernels. Arithmetic on a table runs in its compute type:
 * float64 for float64 tables (as torch computes them), float32 for the
 * others (float16 and bfloat16 rows are widened to float32 in registers,
 * updated, and rounded back on store). Gradients are summed, and optimizer
 * state kept, in the compute type. */
#ifndef HE_DTYPE_H
#define HE_DTYPE_H

#include <stddef.h>

typedef enum he_dtype {
    HE_F32 = 0,
    HE_F16 = 1,
    HE_BF16 = 2,
    HE_F64 = 3,
    HE_DTYPES = 4,
    /* Optimizer state only, 8 bits an element and one float32 scale per
     * block of HE_Q8_BLOCK columns of a row (csrc/quantize.h): */
    HE_Q8 = 4,        /* int8 codes of sign(x) sqrt(|x|): a signed state (exp_avg) */
    HE_Q8_NONNEG = 5, /* uint8 codes of x^(1/4): a state never below 0
                       * (exp_avg_sq, Adagrad's sum) */
    HE_STATE_DTYPES = 6
} he_dtype;

/* A table's dtype (its rows): float32, float16, bfloat16 or float64. */
static inline int he_dtype_valid(int dt)
{
    return dt >= 0 && dt < HE_DTYPES;
}

/* An optimizer state's dtype: a table dtype or an 8-bit form. */
static inline int he_state_dtype_valid(int dt)
{
    return dt >= 0 && dt < HE_STATE_DTYPES;
}

static inline int he_dtype_quantized(int dt)
{
    return dt == HE_Q8 || dt == HE_Q8_NONNEG;
}

static inline size_t he_dtype_size(int dt)
{
    return dt == HE_F64 ? 8 : dt == HE_F32 ? 4 : he_dtype_quantized(dt) ? 1 : 2;
}

static inline int he_compute_dtype(int dt)
{
    return dt == HE_F64 ? HE_F64 : HE_F32;
}

static inline const char *he_dtype_name(int dt)
{
    static const char *const names[HE_STATE_DTYPES] = {"float32", "float16", "bfloat16", "float64", "int8",
                                                       "uint8 (fourth root)"};
    return he_state_dtype_valid(dt) ? names[dt] : "an unknown dtype";
}

#endif
