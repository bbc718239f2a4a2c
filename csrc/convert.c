#include "convert.h"

#include <math.h>
#include <string.h>

#include "simd.h"

/* F16C where the compiler can target it, chosen at run time by the CPU. */
#if defined(__x86_64__) && defined(__GNUC__)
#define HE_F16C 1
#include <cpuid.h>
#include <stdatomic.h>
#include <immintrin.h>
#else
#define HE_F16C 0
#endif

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h)
{
    return f32_of_bits((uint32_t)h << 16);
}

/* torch's c10::BFloat16 rounding: nearest even, NaN to the quiet 0x7FC0. */
static inline uint16_t f32_to_bf16(float f)
{
    if (isnan(f))
        return 0x7FC0;
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float16 <-> float32 in integer arithmetic (no compiler _Float16 or F16C
 * needed: one code path on every compiler the core builds with). Widening
 * is exact; subnormal halves are m * 2^-24. The three cases are merged
 * with masks, not branches: a row's loop then vectorises. */
static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t normal = ((exp + 112u) << 23) | (man << 13);
    uint32_t special = 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0); /* inf, NaN (made quiet, as F16C does) */
    uint32_t subnormal = f32_bits((float)(int32_t)man * 0x1p-24f); /* (signed: one instruction before AVX-512) */
    uint32_t is_special = 0u - (uint32_t)(exp == 0x1Fu), is_subnormal = 0u - (uint32_t)(exp == 0);
    uint32_t bits = (special & is_special) | (subnormal & is_subnormal) | (normal & ~(is_special | is_subnormal));
    return f32_of_bits(sign | bits);
}

/* Nearest even, as torch's float -> half: NaN stays a (quiet) NaN, values
 * from 65520 up become inf. Each case is computed and the right one picked
 * with masks, as in f16_to_f32. */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t nan = 0x7E00u | ((a >> 13) & 0x3FFu);
    uint32_t inf = 0x7C00u; /* 65520 and up, inf included */
    /* A normal half (>= 2^-14): rebias the exponent, round the 13 dropped bits. */
    uint32_t normal = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
    /* A subnormal half or zero: m = |f| * 2^24 rounded to an integer (exact
     * scaling; adding 2^23 rounds to nearest even in float). m = 1024 is the
     * smallest normal's bit pattern, which is right. */
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7F800000u);
    uint32_t is_inf = ~is_nan & (0u - (uint32_t)(a >= 0x477FF000u));
    uint32_t is_normal = ~is_nan & ~is_inf & (0u - (uint32_t)(a >= 0x38800000u));
    uint32_t is_subnormal = ~(is_nan | is_inf | is_normal);
    /* (|f| masked to 0 unless small: a large one would overflow the cast.) */
    float m = f32_of_bits(a & is_subnormal) * 0x1p24f;
    uint32_t subnormal = (uint32_t)(int32_t)((m + 0x1p23f) - 0x1p23f);
    return (uint16_t)(sign | (nan & is_nan) | (inf & is_inf) | (normal & is_normal) | (subnormal & is_subnormal));
}

/* bfloat16 keeps the top 16 bits of a float32: adding 16 random low bits
 * before truncating rounds up with probability (dropped bits) / 2^16. */
static inline uint16_t f32_to_bf16_sr(float f, uint64_t r)
{
    if (!isfinite(f))
        return f32_to_bf16(f);
    uint32_t u = f32_bits(f);
    uint32_t up = u + (uint32_t)(r & 0xFFFFu);
    /* Past the largest finite bfloat16: nearest even decides (inf or max). */
    if (((up >> 23) & 0xFFu) == 0xFFu)
        return f32_to_bf16(f);
    return (uint16_t)(up >> 16);
}

/* float16 has no such bit trick below its normal range: take the nearest
 * value and its neighbour on the other side of x, and pick the far one
 * with probability |x - near| / |far - near|. */
static inline uint16_t f32_to_f16_sr(float x, uint64_t r)
{
    uint16_t near = f32_to_f16(x);
    float nf = f16_to_f32(near);
    if (nf == x || !isfinite(x) || isinf(nf))
        return near;
    /* One ulp away from zero or towards it, in sign-magnitude (towards
     * zero only from a nonzero near: x != near = 0 means |x| > |near|). */
    int away = fabsf(x) > fabsf(nf);
    uint16_t mag = near & 0x7FFFu, sign = near & 0x8000u;
    uint16_t far = (uint16_t)(sign | (away ? mag + 1u : mag - 1u));
    float ff = f16_to_f32(far);
    if (isinf(ff))
        return near;
    double p = fabs((double)x - nf) / fabs((double)ff - nf);
    double u = (double)(r >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
    return u < p ? far : near;
}

#if HE_F16C
/* x86's F16C converts 8 halves in one instruction, to nearest even as the
 * integer code does (the exhaustive test in tests/c checks every value on
 * a CPU that has it): 4.6x faster to widen and 4x to round here than the
 * integer code, which is what bfloat16 already gets from a shift. */
__attribute__((target("avx,f16c"))) static void f16_to_f32_f16c(const uint16_t *s, float *d, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(d + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j))));
    for (; j < n; j++)
        d[j] = f16_to_f32(s[j]);
}

__attribute__((target("avx,f16c"))) static void f32_to_f16_f16c(const float *s, uint16_t *d, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(d + j), _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++)
        d[j] = f32_to_f16(s[j]);
}

/* Asked once: CPUID traps to the hypervisor in a VM (microseconds). */
static int have_f16c(void)
{
#if defined(HE_SIMD_ONLY) && HE_SIMD_ONLY < 3
    return 0; /* the portable conversions, as on a CPU without F16C */
#endif
    static _Atomic int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        unsigned a, b, c, d; /* (clang has no "f16c" for __builtin_cpu_supports) */
        v = __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}
#else
static int have_f16c(void)
{
    return 0;
}
#define f16_to_f32_f16c(s, d, n) ((void)0)
#define f32_to_f16_f16c(s, d, n) ((void)0)
#endif

HE_SIMD_CLONES_FMA
static void row_to_f32_portable(int dtype, const void *src, float *dst, int64_t n)
{
    if (dtype == HE_F16) {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++)
            dst[j] = f16_to_f32(s[j]);
    } else if (dtype == HE_BF16) {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++)
            dst[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

void he_row_to_f32(int dtype, const void *src, float *dst, int64_t n)
{
    if (dtype == HE_F16 && have_f16c())
        f16_to_f32_f16c(src, dst, n);
    else
        row_to_f32_portable(dtype, src, dst, n);
}

HE_SIMD_CLONES_FMA
static void row_from_f32_nearest(int dtype, const float *src, void *dst, int64_t n)
{
    if (dtype == HE_F16 && have_f16c()) {
        f32_to_f16_f16c(src, dst, n);
    } else if (dtype == HE_F16) {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++)
            d[j] = f32_to_f16(src[j]);
    } else if (dtype == HE_BF16) {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++)
            d[j] = f32_to_bf16(src[j]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

void he_row_from_f32(int dtype, const float *src, void *dst, int64_t n, int stochastic, uint64_t seed, int64_t row,
                     int64_t col0)
{
    if (!stochastic || dtype == HE_F32) {
        row_from_f32_nearest(dtype, src, dst, n);
        return;
    }
    if (dtype == HE_F16) {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++)
            d[j] = f32_to_f16_sr(src[j], he_draw(seed, row, col0 + j));
    } else {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++)
            d[j] = f32_to_bf16_sr(src[j], he_draw(seed, row, col0 + j));
    }
}

void he_round_row_f32(int dtype, const float *src, float *dst, int64_t n)
{
    if (dtype != HE_F16 && dtype != HE_BF16) {
        memmove(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t half[256];
    for (int64_t col = 0; col < n; col += 256) {
        int64_t m = n - col < 256 ? n - col : 256;
        row_from_f32_nearest(dtype, src + col, half, m);
        he_row_to_f32(dtype, half, dst + col, m);
    }
}

double he_elem_to_f64(int dtype, const void *row, int64_t j)
{
    switch (dtype) {
    case HE_F16: return (double)f16_to_f32(((const uint16_t *)row)[j]);
    case HE_BF16: return (double)bf16_to_f32(((const uint16_t *)row)[j]);
    case HE_F64: return ((const double *)row)[j];
    default: return (double)((const float *)row)[j];
    }
}

double he_round_to(int dtype, double x)
{
    switch (dtype) {
    case HE_F16: return (double)f16_to_f32(f32_to_f16((float)x));
    case HE_BF16: return (double)bf16_to_f32(f32_to_bf16((float)x));
    case HE_F64: return x;
    default: return (double)(float)x;
    }
}
