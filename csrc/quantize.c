#include "quantize.h"

#include <math.h>
#include <string.h>

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
 * single instructions from AVX on: hence the clones). The encoder is cloned
 * whole with its loops inlined, not a call through an ifunc a loop: with
 * that and the byte instructions, a 128-wide row's two moments encode in
 * 145 ns instead of 195 on this project's AMD EPYC VM (its square roots,
 * three an element, are most of what is left). */
static inline float signed_root(float x)
{
    return copysignf(sqrtf(fabsf(x)), x);
}

static inline float fourth_root(float x)
{
    return sqrtf(sqrtf(x));
}

HE_SIMD_CLONES_BYTES
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

static inline uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* roots[j] = the root of src[j] (quantize.h); returns the bits of the
 * largest |root|. The magnitudes' bits order as unsigned integers do (an
 * infinity above every finite value, a NaN above both), so the maximum is
 * an integer one, which vectorises (a float max does not without
 * fast-math, for its NaN rules). */
static inline uint32_t block_roots(int dtype, const float *src, float *roots, int64_t n)
{
    uint32_t top = 0;
    if (dtype == HE_Q8) {
        for (int64_t j = 0; j < n; j++) {
            float r = signed_root(src[j]);
            uint32_t b = bits_of(r) & 0x7FFFFFFFu;
            roots[j] = r;
            top = b > top ? b : top;
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            float r = fourth_root(src[j]);
            uint32_t b = bits_of(r) & 0x7FFFFFFFu;
            roots[j] = r;
            top = b > top ? b : top;
        }
    }
    return top;
}

/* codes[j] = roots[j] * inv rounded to nearest, clamped to the form's
 * codes (stochastic rounding hands over roots already rounded, inv 1). */
static inline void encode_nearest(int dtype, const float *src, const float *roots, void *codes, float inv, int64_t n)
{
    if (dtype == HE_Q8) {
        int8_t *c = codes;
        for (int64_t j = 0; j < n; j++) {
            float q = rintf(roots[j] * inv);
            q = q > 127.0f ? 127.0f : q;
            q = q < -127.0f ? -127.0f : q;
            c[j] = (int8_t)(int32_t)q; /* through int32: one vector conversion, then a narrowing */
        }
        return;
    }
    uint8_t *c = codes;
    for (int64_t j = 0; j < n; j++) {
        float q = rintf(roots[j] * inv);
        /* A positive value stays positive (code 1 at least): see quantize.h. */
        float least = src[j] > 0.0f ? 1.0f : 0.0f;
        q = q > 255.0f ? 255.0f : q;
        q = q < least ? least : q;
        c[j] = (uint8_t)(int32_t)q;
    }
}

/* roots[j] * inv rounded down or up, unbiased, in place: whole numbers,
 * which encode_nearest then clamps and stores as they are. */
static void round_stochastic(float *roots, float inv, int64_t n, uint64_t seed, int64_t row, int64_t col0)
{
    for (int64_t j = 0; j < n; j++)
        roots[j] = floorf(roots[j] * inv + unit_draw(seed, row, col0 + j));
}

HE_SIMD_CLONES_BYTES
void he_q8_from_f32(int dtype, const float *src, void *codes, float *scale, int64_t n, int stochastic, uint64_t seed,
                    int64_t row, int64_t col0)
{
    _Alignas(64) float roots[HE_Q8_BLOCK];
    float top = dtype == HE_Q8 ? 127.0f : 255.0f;
    uint32_t peak = block_roots(dtype, src, roots, n);
    int finite = peak < 0x7F800000u; /* no NaN or infinity (nor, for HE_Q8_NONNEG, a negative value) */
    float m = 0.0f;
    memcpy(&m, &peak, sizeof m);
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
    if (stochastic) {
        round_stochastic(roots, inv, n, seed, row, col0);
        inv = 1.0f;
    }
    encode_nearest(dtype, src, roots, codes, inv, n);
}
