/* The GPU's frequency planner (cuda/he_cuda_cache_frequency.cuh: its
 * kernels and he_cache_plan_frequency, the order they run in), compiled
 * from its own source by g++ over device_shim.h, with a plain prefix sum
 * and std::sort where the GPU has CUB's: it plans a stream of batches read
 * from a file and writes each plan, as the GPU's arrays hold it.
 *
 *   cache_frequency IN OUT
 *
 * IN (native byte order), written by tests/test_cache_frequency_twin.py:
 *   int64 rows, capacity, protect, batches; then each batch: int64 n, its
 *   n rows (ascending, distinct, in range)
 * OUT: each batch: int64 n, misses, window (its slots for the next batch);
 *   int32 slot[n]; int64 miss[misses], evict_row[misses]; then uint32
 *   entry[rows] (he_cache_policy.h's). */
#include "device_shim.h"
#include "twin_input.h"

#include "he_cuda_cache_frequency.cuh"

#include <algorithm>
#include <cstdio>

namespace {

/* he_cache_plan_frequency's primitives: kernels on the shim's lanes (two
 * warps; the kernels go round their items), a sum and a sort on the host. */
struct shim_prims {
    unsigned threads = 64;

    unsigned blocks(int64_t) const
    {
        return 1;
    }

    template <typename... P, typename... A>
    he_status launch(void (*kernel)(P...), unsigned grid, unsigned block, A... args) const
    {
        he_shim_launch(grid, block < 32 ? 32 : block, [&] { kernel(args...); });
        return HE_OK;
    }

    he_status scan(const int32_t *in, int32_t *out, int64_t n) const
    {
        int32_t sum = 0;
        for (int64_t i = 0; i < n; i++) {
            out[i] = sum;
            sum += in[i];
        }
        return HE_OK;
    }

    he_status sort(const uint64_t *in, uint64_t *out, int64_t n) const
    {
        std::copy(in, in + n, out);
        std::sort(out, out + n);
        return HE_OK;
    }
};

template <typename T> void write_array(FILE *f, const T *v, int64_t n)
{
    if (n && std::fwrite(v, sizeof(T), (size_t)n, f) != (size_t)n)
        std::exit(3);
}

} // namespace

int main(int argc, char **argv)
{
    if (argc != 3 || !he_shim_rounds_alone())
        return 2;
    he_twin_input in{std::fopen(argv[1], "rb"), "cache_frequency", {}};
    FILE *out = std::fopen(argv[2], "wb");
    if (!in.f || !out)
        return 2;
    const int64_t *head = in.read<int64_t>(4);
    int64_t rows = head[0], capacity = head[1];
    std::vector<uint32_t> entry((size_t)rows), last((size_t)rows), turned_at((size_t)rows);
    std::vector<uint16_t> count((size_t)rows), slot_count((size_t)capacity);
    std::vector<int64_t> row_of((size_t)capacity, -1), used_at((size_t)capacity, -1);
    std::vector<uint8_t> referenced((size_t)capacity);
    std::vector<int64_t> counters(HE_CUDA_CACHE_COUNTERS);
    he_cuda_cache c = {entry.data(),   rows,          row_of.data(), used_at.data(), referenced.data(),
                       capacity,       counters.data(), (int)head[2], HE_CACHE_FREQUENCY, count.data(),
                       last.data(),    turned_at.data(), slot_count.data()};
    if (he_cuda_check_cache(&c) != HE_OK)
        return 2;
    for (int64_t batch = 1; batch <= head[3]; batch++) {
        int64_t n = *in.read<int64_t>(1);
        const int64_t *unique = in.read<int64_t>((size_t)n);
        size_t m = (size_t)std::max<int64_t>(n, 1), s = (size_t)capacity;
        std::vector<int32_t> slot(m), flags(m), ranks(m), turned(m), turned_ranks(m), ring(s), ring_ranks(s);
        std::vector<int64_t> miss(m), evict_row(m), turned_list(m);
        std::vector<uint64_t> miss_keys(m), miss_sorted(m), keys(s), sorted(s);
        he_cuda_cache_batch plan = {slot.data(), miss.data(), evict_row.data()};
        he_cache_frequency_buffers b = {flags.data(),       ranks.data(),      turned.data(), turned_ranks.data(),
                                        turned_list.data(), miss_keys.data(),  miss_sorted.data(), keys.data(),
                                        sorted.data(),      ring.data(),       ring_ranks.data()};
        if (he_cache_plan_frequency(&c, unique, n, batch, &plan, b, shim_prims()) != HE_OK)
            return 4;
        shim_prims().launch(plan_done, 1, 1, c.counters, n);
        int64_t misses = n ? counters[HE_CUDA_CACHE_MISSES] : 0;
        write_array(out, &n, 1);
        write_array(out, &misses, 1);
        write_array(out, &counters[HE_CUDA_CACHE_WINDOW], 1);
        write_array(out, slot.data(), n);
        write_array(out, miss.data(), misses);
        write_array(out, evict_row.data(), misses);
    }
    write_array(out, entry.data(), rows);
    return std::fclose(out) == 0 ? 0 : 3;
}
