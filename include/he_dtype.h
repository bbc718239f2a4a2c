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
    HE_DTYPES = 4
} he_dtype;

static inline int he_dtype_valid(int dt)
{
    return dt >= 0 && dt < HE_DTYPES;
}

static inline size_t he_dtype_size(int dt)
{
    return dt == HE_F64 ? 8 : dt == HE_F32 ? 4 : 2;
}

static inline int he_compute_dtype(int dt)
{
    return dt == HE_F64 ? HE_F64 : HE_F32;
}

static inline const char *he_dtype_name(int dt)
{
    static const char *const names[HE_DTYPES] = {"float32", "float16", "bfloat16", "float64"};
    return he_dtype_valid(dt) ? names[dt] : "an unknown dtype";
}

#endif
