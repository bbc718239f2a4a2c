/* One launch of adam_compact_cached (cuda/he_cuda_compact.cuh, compiled
 * from its own source by g++ over device_shim.h) on arrays read from a
 * file; the arrays it updated written to another. A process a launch, so
 * that a kernel that crashes or hangs fails one test, not pytest.
 *
 *   compact_adam IN OUT
 *
 * IN (native byte order), written by tests/test_compact_kernel_twin.py:
 *   int64 rows, slots, dim, m_dtype, v_dtype, nnz, step, maximize, grid, block
 *   double lr, beta1, beta2, eps, weight_decay
 *   uint32 entry[rows] (include/he_cache_policy.h's: slot + 1 in the low bits)
 *   the host rows' arrays, then the records' (as he_cuda_cache_compact
 *   orders them: weight, exp_avg, exp_avg_sq, then an 8-bit moment's
 *   scales), each [rows or slots, its width]
 *   int64 indices[nnz], float values[nnz, dim]
 * OUT: the host rows' arrays, then the records', as in IN. */
#include "device_shim.h"
#include "twin_input.h"

#include "he_cuda_compact.cuh"

#include <cstdio>

namespace {

size_t code_size(int dtype)
{
    return dtype == HE_BF16 ? 2 : 1;
}

}

int main(int argc, char **argv)
{
    if (argc != 3) {
        std::fprintf(stderr, "usage: compact_adam IN OUT\n");
        return 2;
    }
    if (!he_shim_rounds_alone()) {
        std::fprintf(stderr, "compact_adam: built with float operations fused; build with -ffp-contract=off\n");
        return 2;
    }
    he_twin_input in{std::fopen(argv[1], "rb"), "compact_adam", {}};
    if (!in.f) {
        std::perror(argv[1]);
        return 2;
    }
    const int64_t *h = in.read<int64_t>(10);
    const double *d = in.read<double>(5);
    int64_t rows = h[0], slots = h[1], dim = h[2], nnz = h[5];
    he_cuda_cache_compact a = {};
    a.m_dtype = (int)h[3];
    a.v_dtype = (int)h[4];
    a.dim = dim;
    he_adam_params hp = {d[0], d[1], d[2], d[3], h[6], (int)h[7], d[4]};
    int64_t blocks = (dim + HE_CUDA_Q8_BLOCK - 1) / HE_CUDA_Q8_BLOCK;
    /* Bytes a row of each array; 0: absent (a bfloat16 moment has no scales). */
    size_t width[HE_CUDA_COMPACT_ARRAYS] = {
        4 * (size_t)dim, code_size(a.m_dtype) * dim, code_size(a.v_dtype) * dim,
        a.m_dtype == HE_BF16 ? 0 : 4 * (size_t)blocks, a.v_dtype == HE_BF16 ? 0 : 4 * (size_t)blocks};
    const uint32_t *entry = in.read<uint32_t>(rows);
    for (int x = 0; x < HE_CUDA_COMPACT_ARRAYS; x++)
        a.host[x] = width[x] ? in.read<char>(rows * width[x]) : nullptr;
    for (int x = 0; x < HE_CUDA_COMPACT_ARRAYS; x++)
        a.records[x] = width[x] ? in.read<char>(slots * width[x]) : nullptr;
    const int64_t *indices = in.read<int64_t>(nnz);
    const float *values = in.read<float>(nnz * dim);
    std::fclose(in.f);

    /* The scalars from the core's own he_adam_make_consts, as the launcher's. */
    he_adam_consts hc = he_adam_make_consts(&hp);
    int64_t items = nnz * blocks;
    he_shim_launch((unsigned)h[8], (unsigned)h[9],
                   [&] { adam_compact_cached(a, entry, blocks, indices, values, items, hc); });

    FILE *out = std::fopen(argv[2], "wb");
    if (!out) {
        std::perror(argv[2]);
        return 2;
    }
    for (int x = 0; x < HE_CUDA_COMPACT_ARRAYS; x++)
        if (width[x])
            std::fwrite(a.host[x], width[x], rows, out);
    for (int x = 0; x < HE_CUDA_COMPACT_ARRAYS; x++)
        if (width[x])
            std::fwrite(a.records[x], width[x], slots, out);
    return std::fclose(out) == 0 ? 0 : 2;
}
