/* Runtime SIMD dispatch for the hot row loops.
 *
 * target_clones builds one copy of a function per ISA and picks one at load
 * time (an ifunc), so the wheel runs on any x86-64 yet uses AVX-512 or AVX2
 * where the CPU has them; never -march=native in a distributed build. The
 * loops are element-wise (no reassociation), so every clone gives the same
 * bits. Sanitizer builds get the plain function: ifunc resolvers run before
 * the sanitizer runtime is ready. */
#ifndef HE_SIMD_H
#define HE_SIMD_H

#if defined(HE_SIMD_ONLY) && defined(__GNUC__) && defined(__x86_64__)
/* One level only, in place of the clones (setup.py's HOSTEMBED_SIMD, for
 * testing): each clone's code runs on a CPU whose resolver would pick
 * another, so a test run per level checks that every level gives the same
 * bits without a machine of each kind. */
#if HE_SIMD_ONLY == 4
#define HE_SIMD_CLONES __attribute__((target("avx512f")))
#define HE_SIMD_CLONES_FMA __attribute__((target("arch=x86-64-v4")))
#define HE_SIMD_CLONES_BYTES __attribute__((target("arch=x86-64-v4")))
#elif HE_SIMD_ONLY == 3
#define HE_SIMD_CLONES __attribute__((target("avx2")))
#define HE_SIMD_CLONES_FMA __attribute__((target("arch=x86-64-v3")))
#define HE_SIMD_CLONES_BYTES __attribute__((target("arch=x86-64-v3")))
#else
#define HE_SIMD_CLONES
#define HE_SIMD_CLONES_FMA
#define HE_SIMD_CLONES_BYTES
#endif
#elif defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__) && !defined(HE_NO_CLONES)
#define HE_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
/* For loops that call fmaf (torch's CPU kernels fuse a dense += sparse *
 * alpha into one FMA, and matching its bits needs the same): only levels
 * with the FMA instructions, else fmaf is a libm call per element. */
#define HE_SIMD_CLONES_FMA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* For loops that convert floats to or from bytes (8-bit state): x86-64-v4
 * has AVX-512BW's byte instructions, without which an "avx512f" clone does
 * its byte work in 256-bit registers (measured: a row's 8-bit encode 24%
 * faster). */
#define HE_SIMD_CLONES_BYTES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HE_SIMD_CLONES
#define HE_SIMD_CLONES_FMA
#define HE_SIMD_CLONES_BYTES
#endif

#include <stddef.h>

/* Rows are scattered over tables far bigger than the caches, so each row
 * copy or update waits on DRAM; asking for a row a few rows ahead overlaps
 * those waits. */
static inline void he_prefetch_row(const void *row, size_t bytes, int for_write)
{
    const char *p = row;
    for (size_t off = 0; off < bytes; off += 64) {
        if (for_write)
            __builtin_prefetch(p + off, 1);
        else
            __builtin_prefetch(p + off, 0);
    }
}

#define HE_PREFETCH_AHEAD 4

#endif
