/* One launch of optim_cached (cuda/he_cuda_optim_cached.cuh: the row
 * cache's SGD, Adagrad and row-wise Adagrad, compiled from its own source
 * by g++ over device_shim.h) on arrays read from a file; the arrays it
 * updated written to another. A process a launch, so that a kernel that
 * crashes or hangs fails one test, not pytest.
 *
 *   optim_rows IN OUT [nudge]
 *
 * nudge: the step's scalar that multiplies the gradient (SGD's and
 * Adagrad's alpha, row-wise Adagrad's lr) made one ulp larger, for the
 * test that checks a 1-ulp change is caught.
 *
 * IN (native byte order), written by tests/test_optim_kernel_twin.py:
 *   int64 rows, slots, dim, kind, nnz, step, maximize, grid, block
 *   double lr, eps, lr_decay, weight_decay
 *   uint32 entry[rows] (include/he_cache_policy.h's: slot + 1 in the low bits)
 *   float32 host weight [rows, dim], host state [rows, width]
 *   float32 records' weight [slots, dim], records' state [slots, width]
 *     (width: 0 for SGD, dim for Adagrad's sum, 1 for row-wise Adagrad's row_sum)
 *   int64 indices[nnz], float values[nnz, dim]
 * OUT: the host arrays, then the records', as in IN. */
#include "device_shim.h"
#include "twin_input.h"

#include "he_cuda_optim_cached.cuh"

#include <cstdio>
#include <string>

namespace {

}

int main(int argc, char **argv)
{
    if (argc != 3 && !(argc == 4 && std::string(argv[3]) == "nudge")) {
        std::fprintf(stderr, "usage: optim_rows IN OUT [nudge]\n");
        return 2;
    }
    if (!he_shim_rounds_alone()) {
        std::fprintf(stderr, "optim_rows: built with float operations fused; build with -ffp-contract=off\n");
        return 2;
    }
    he_twin_input in{std::fopen(argv[1], "rb"), "optim_rows", {}};
    if (!in.f) {
        std::perror(argv[1]);
        return 2;
    }
    const int64_t *h = in.read<int64_t>(9);
    const double *d = in.read<double>(4);
    int64_t rows = h[0], slots = h[1], dim = h[2], nnz = h[4];
    he_optim_params hp = {};
    hp.kind = (int)h[3];
    hp.step = h[5];
    hp.maximize = (int)h[6];
    hp.lr = d[0];
    hp.eps = d[1];
    hp.lr_decay = d[2];
    hp.weight_decay = d[3];
    if (hp.kind != HE_OPTIM_SGD && hp.kind != HE_OPTIM_ADAGRAD && hp.kind != HE_OPTIM_ROWWISE_ADAGRAD) {
        std::fprintf(stderr, "optim_rows: kind %d is not SGD, Adagrad or row-wise Adagrad\n", hp.kind);
        return 2;
    }
    int64_t width = hp.kind == HE_OPTIM_SGD ? 0 : hp.kind == HE_OPTIM_ADAGRAD ? dim : 1;
    const uint32_t *entry = in.read<uint32_t>(rows);
    he_cuda_cache_arrays a = {};
    a.count = width ? 2 : 1;
    a.dim = dim;
    a.host[0] = in.read<float>(rows * dim);
    if (width)
        a.host[1] = in.read<float>(rows * width);
    a.records[0] = in.read<float>(slots * dim);
    if (width)
        a.records[1] = in.read<float>(slots * width);
    const int64_t *indices = in.read<int64_t>(nnz);
    const float *values = in.read<float>(nnz * dim);
    std::fclose(in.f);

    /* The scalars as the launcher makes them (the test compares them, with
     * everything else, against the core's). */
    he_cuda_optim_consts oc = he_cuda_optim_make_consts(&hp, dim);
    if (argc == 4) {
        float &scalar = hp.kind == HE_OPTIM_ROWWISE_ADAGRAD ? oc.lr : oc.alpha;
        scalar = std::nextafter(scalar, scalar < 0 ? -INFINITY : INFINITY);
    }
    he_shim_launch((unsigned)h[7], (unsigned)h[8], [&] { optim_cached(a, entry, indices, values, nnz, oc); });

    FILE *out = std::fopen(argv[2], "wb");
    if (!out) {
        std::perror(argv[2]);
        return 2;
    }
    std::fwrite(a.host[0], sizeof(float) * dim, rows, out);
    if (width)
        std::fwrite(a.host[1], sizeof(float) * width, rows, out);
    std::fwrite(a.records[0], sizeof(float) * dim, slots, out);
    if (width)
        std::fwrite(a.records[1], sizeof(float) * width, slots, out);
    return std::fclose(out) == 0 ? 0 : 2;
}
