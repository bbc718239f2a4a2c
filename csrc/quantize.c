#include "quantize.h"

#include <float.h>
#include <math.h>

#include "convert.h"
#include "he_dtype.h"
#include "simd.h"

/* A uniform draw in [0, 1) with 24 bits (a float holds them exactly). */
static inline float unit_draw(uint64_t seed, int64_t row, int64_t col)
{
    return (float)(he_draw(seed, row, col) >> 40) * 0x1p-24f;
}

/* The root a code is linear in (quantize.h). Each loop below is one form's,
 * branch-free, so that it vectorises (sqrt, round and the conversions are
 * single instructions from AVX on: hence the clones). */
static inline float signed_root(float x)
{
    return copysignf(sqrtf(fabsf(x)), x);
}

static inline float fourth_root(float x)
{
    return sqrtf(sqrtf(x));
}

HE_SIMD_CLONES
void he_q8_to_f32(int dtype, const void *codes, float scale, float *dst, int64_t n)
{
    if (dtype == HE_Q8) {
        const int8_t *c = codes;
        for (int64_t j = 0; j < n; j++) {
            float r = (float)c[j] * scale;
            dst[j] = r * fabsf(r);
        }
        return;
    }
    const uint8_t *c = codes;
    for (int64_t j = 0; j < n; j++) {
        float r = (float)c[j] * scale;
        dst[j] = (r * r) * (r * r);
    }
}

/* roots[j] = the root of src[j] (quantize.h), in one vectorised loop. */
HE_SIMD_CLONES
static void block_roots(int dtype, const float *src, float *roots, int64_t n)
{
    if (dtype == HE_Q8)
        for (int64_t j = 0; j < n; j++)
            roots[j] = signed_root(src[j]);
    else
        for (int64_t j = 0; j < n; j++)
            roots[j] = fourth_root(src[j]);
}

/* The largest |roots[j]| into *peak; 0 when one is NaN or infinite (a NaN
 * or infinite value, or a negative one for HE_Q8_NONNEG). Eight lanes: a
 * float max over one accumulator does not vectorise without fast-math. */
#define HE_Q8_LANES 8
HE_SIMD_CLONES
static int block_peak(const float *roots, int64_t n, float *peak)
{
    float lane[HE_Q8_LANES] = {0};
    int bad[HE_Q8_LANES] = {0};
    int64_t j = 0;
    for (; j + HE_Q8_LANES <= n; j += HE_Q8_LANES)
        for (int k = 0; k < HE_Q8_LANES; k++) {
            float a = fabsf(roots[j + k]);
            bad[k] |= !(a <= FLT_MAX);
            lane[k] = a > lane[k] ? a : lane[k];
        }
    for (int k = 0; j < n; j++, k++) {
        float a = fabsf(roots[j]);
        bad[k] |= !(a <= FLT_MAX);
        lane[k] = a > lane[k] ? a : lane[k];
    }
    float m = 0.0f;
    int any_bad = 0;
    for (int k = 0; k < HE_Q8_LANES; k++) {
        m = lane[k] > m ? lane[k] : m;
        any_bad |= bad[k];
    }
    *peak = m;
    return !any_bad;
}

HE_SIMD_CLONES
static void encode_nearest(int dtype, const float *src, const float *roots, void *codes, float inv, int64_t n)
{
    if (dtype == HE_Q8) {
        int8_t *c = codes;
        for (int64_t j = 0; j < n; j++) {
            float q = rintf(roots[j] * inv);
            c[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        return;
    }
    uint8_t *c = codes;
    for (int64_t j = 0; j < n; j++) {
        float q = rintf(roots[j] * inv);
        /* A positive value stays positive (code 1 at least): see quantize.h. */
        float least = src[j] > 0.0f ? 1.0f : 0.0f;
        q = q > 255.0f ? 255.0f : q;
        c[j] = (uint8_t)(q < least ? least : q);
    }
}

static void encode_stochastic(int dtype, const float *src, const float *roots, void *codes, float inv, int64_t n,
                              uint64_t seed, int64_t row, int64_t col0)
{
    for (int64_t j = 0; j < n; j++) {
        float q = floorf(roots[j] * inv + unit_draw(seed, row, col0 + j));
        if (dtype == HE_Q8) {
            ((int8_t *)codes)[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        } else {
            float least = src[j] > 0.0f ? 1.0f : 0.0f;
            q = q > 255.0f ? 255.0f : q;
            ((uint8_t *)codes)[j] = (uint8_t)(q < least ? least : q);
        }
    }
}

void he_q8_from_f32(int dtype, const float *src, void *codes, float *scale, int64_t n, int stochastic, uint64_t seed,
                    int64_t row, int64_t col0)
{
    _Alignas(64) float roots[HE_Q8_BLOCK];
    float top = dtype == HE_Q8 ? 127.0f : 255.0f;
    float m = 0.0f;
    block_roots(dtype, src, roots, n);
    int finite = block_peak(roots, n, &m);
    if (!finite || m == 0.0f) {
        /* All zero (codes 0, scale 0), or not finite (scale NaN: the block
         * decodes to NaN, as a float state would stay NaN). */
        *scale = finite ? 0.0f : NAN;
        for (int64_t j = 0; j < n; j++)
            ((uint8_t *)codes)[j] = 0;
        return;
    }
    *scale = m / top;
    float inv = top / m;
    if (stochastic)
        encode_stochastic(dtype, src, roots, codes, inv, n, seed, row, col0);
    else
        encode_nearest(dtype, src, roots, codes, inv, n);
}
