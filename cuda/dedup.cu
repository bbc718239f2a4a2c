/* Range check and sort-based dedup of a batch of ids on the GPU.
 *
 * CUB sorts (id, position) pairs; the radix sort is stable and positions
 * go in ascending, so each id's positions come out ascending: the order the
 * gradient sums follow (deterministic). Head flags + an inclusive scan number
 * the unique ids; one scatter writes unique, offsets and inverse. */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <limits.h>

#include "he_cuda_common.cuh"

/* What the host reads back, in one copy. */
struct dedup_readback {
    unsigned long long bad_position; /* lowest position of an out-of-range id; all ones: none */
    long long num_unique;
    long long padding_slot; /* unique index of padding_idx; -1: absent */
};

/* Sub-buffers of the caller's workspace, each 256-byte aligned (CUB's own
 * requirement for its temporary storage, and full cache lines for the rest). */
struct dedup_layout {
    size_t readback, keys_in, keys_out, positions, heads, segments, temp, temp_bytes, total;
};

/* Bits that distinguish ids in [0, num_rows): the sort skips the rest. Ids
 * outside the range are sorted by their low bits only, harmlessly: the batch
 * is refused before anything reads their rows. */
static int key_bits(int64_t num_rows)
{
    int bits = 0;
    for (uint64_t x = num_rows > 1 ? (uint64_t)(num_rows - 1) : 1; x; x >>= 1)
        bits++;
    return bits;
}

static he_status plan(int64_t count, int64_t num_rows, dedup_layout *l)
{
    int n = (int)count;
    size_t sort_bytes = 0, scan_bytes = 0;
    HE_CUDA_TRY(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const uint64_t *)NULL, (uint64_t *)NULL,
                                                (const int32_t *)NULL, (int32_t *)NULL, n, 0, key_bits(num_rows)));
    HE_CUDA_TRY(cub::DeviceScan::InclusiveSum(NULL, scan_bytes, (const int32_t *)NULL, (int32_t *)NULL, n));
    size_t at = 0;
    l->readback = at;
    at += he_cuda_align256(sizeof(dedup_readback));
    l->keys_in = at;
    at += he_cuda_align256((size_t)count * sizeof(uint64_t));
    l->keys_out = at;
    at += he_cuda_align256((size_t)count * sizeof(uint64_t));
    l->positions = at;
    at += he_cuda_align256((size_t)count * sizeof(int32_t));
    l->heads = at;
    at += he_cuda_align256((size_t)count * sizeof(int32_t));
    l->segments = at;
    at += he_cuda_align256((size_t)count * sizeof(int32_t));
    l->temp = at;
    l->temp_bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
    at += he_cuda_align256(l->temp_bytes);
    l->total = at;
    return HE_OK;
}

static he_status check_count(int64_t count)
{
    /* Positions are int32 (half the sort traffic of int64). */
    if (count < 0 || count > INT32_MAX)
        return he_fail(HE_ERR_VALUE, "a GPU lookup takes between 0 and %d ids, got %lld", INT32_MAX,
                       (long long)count);
    return HE_OK;
}

extern "C" he_status he_cuda_dedup_workspace(int64_t count, int64_t num_rows, int device, size_t *bytes)
{
    *bytes = 0;
    he_status st = check_count(count);
    if (st != HE_OK || count == 0)
        return st;
    st = he_check_table_shape(num_rows, 0);
    he_cuda_device_scope scope;
    if (st == HE_OK)
        st = scope.enter(device);
    if (st != HE_OK)
        return st;
    dedup_layout l;
    st = plan(count, num_rows, &l);
    if (st == HE_OK)
        *bytes = l.total;
    return st;
}

/* Keys and positions for the sort; flags the lowest bad position. Writes
 * only the workspace. */
template <typename Id>
__global__ void prepare_keys(const Id *__restrict__ ids, int64_t count, int64_t num_rows,
                             uint64_t *__restrict__ keys, int32_t *__restrict__ positions,
                             dedup_readback *__restrict__ readback)
{
    for (int64_t i = he_thread_index(); i < count; i += he_thread_count()) {
        /* One unsigned compare catches negatives too (as csrc/ids.c). */
        uint64_t key = (uint64_t)(int64_t)ids[i];
        if (key >= (uint64_t)num_rows)
            atomicMin(&readback->bad_position, (unsigned long long)i);
        keys[i] = key;
        positions[i] = (int32_t)i;
    }
}

__global__ void mark_heads(const uint64_t *__restrict__ sorted, int64_t count, int32_t *__restrict__ heads)
{
    for (int64_t i = he_thread_index(); i < count; i += he_thread_count())
        heads[i] = i == 0 || sorted[i] != sorted[i - 1];
}

/* segments[i] = 1 + unique index of sorted element i (inclusive scan of
 * the heads). */
__global__ void scatter_unique(const uint64_t *__restrict__ sorted, const int32_t *__restrict__ order,
                               const int32_t *__restrict__ heads, const int32_t *__restrict__ segments,
                               int64_t count, int64_t padding_idx, int64_t *__restrict__ unique,
                               int64_t *__restrict__ offsets, int64_t *__restrict__ inverse,
                               dedup_readback *__restrict__ readback)
{
    for (int64_t i = he_thread_index(); i < count; i += he_thread_count()) {
        int64_t k = (int64_t)segments[i] - 1;
        inverse[order[i]] = k;
        if (heads[i]) {
            unique[k] = (int64_t)sorted[i];
            offsets[k] = i;
            if ((int64_t)sorted[i] == padding_idx)
                readback->padding_slot = k;
        }
        if (i == count - 1) {
            offsets[k + 1] = count;
            readback->num_unique = k + 1;
        }
    }
}

extern "C" he_status he_cuda_dedup(const void *ids, int64_t count, int is_int64, int64_t num_rows,
                                   int64_t padding_idx, void *workspace, size_t workspace_bytes,
                                   const he_cuda_dedup_out *out, int64_t *num_unique, int64_t *padding_slot,
                                   int device, void *stream_handle)
{
    *num_unique = 0;
    *padding_slot = -1;
    he_status st = check_count(count);
    if (st == HE_OK)
        st = he_check_table_shape(num_rows, 0);
    if (st != HE_OK || count == 0)
        return st;
    he_cuda_device_scope scope;
    st = scope.enter(device);
    if (st != HE_OK)
        return st;
    dedup_layout l;
    st = plan(count, num_rows, &l);
    if (st != HE_OK)
        return st;
    if (workspace_bytes < l.total)
        return he_fail(HE_ERR_VALUE, "dedup workspace of %zu bytes is too small: %zu needed", workspace_bytes,
                       l.total);

    cudaStream_t stream = (cudaStream_t)stream_handle;
    char *ws = (char *)workspace;
    dedup_readback *readback = (dedup_readback *)(ws + l.readback);
    uint64_t *keys_in = (uint64_t *)(ws + l.keys_in), *keys_out = (uint64_t *)(ws + l.keys_out);
    int32_t *positions = (int32_t *)(ws + l.positions);
    int32_t *heads = (int32_t *)(ws + l.heads), *segments = (int32_t *)(ws + l.segments);
    void *temp = ws + l.temp;
    size_t temp_bytes = l.temp_bytes;
    int n = (int)count;
    unsigned blocks = he_cuda_blocks(count, HE_CUDA_THREADS);

    /* All ones: bad_position "none" (atomicMin lowers it), num_unique and
     * padding_slot -1 (scatter_unique overwrites them). */
    HE_CUDA_TRY(cudaMemsetAsync(readback, 0xff, sizeof *readback, stream));
    if (is_int64)
        prepare_keys<int64_t><<<blocks, HE_CUDA_THREADS, 0, stream>>>((const int64_t *)ids, count, num_rows,
                                                                      keys_in, positions, readback);
    else
        prepare_keys<int32_t><<<blocks, HE_CUDA_THREADS, 0, stream>>>((const int32_t *)ids, count, num_rows,
                                                                      keys_in, positions, readback);
    HE_CUDA_LAUNCHED(prepare_keys);
    HE_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, positions, out->order, n, 0,
                                                key_bits(num_rows), stream));
    mark_heads<<<blocks, HE_CUDA_THREADS, 0, stream>>>(keys_out, count, heads);
    HE_CUDA_LAUNCHED(mark_heads);
    temp_bytes = l.temp_bytes;
    /* The same argument types as plan()'s size query: the same template
     * instance, so the same temporary storage layout. */
    HE_CUDA_TRY(cub::DeviceScan::InclusiveSum(temp, temp_bytes, (const int32_t *)heads, segments, n, stream));
    scatter_unique<<<blocks, HE_CUDA_THREADS, 0, stream>>>(keys_out, out->order, heads, segments, count,
                                                           padding_idx, out->unique, out->offsets, out->inverse,
                                                           readback);
    HE_CUDA_LAUNCHED(scatter_unique);

    /* The one wait of a lookup. The range check must raise IndexError
     * before any kernel writes the table (max_norm) or an output, and the
     * unique count sizes the caller's buffers, so the host needs both now:
     * a device-side flag and one small copy, rather than a device assert
     * that would kill the CUDA context. Pageable destination: the copy is
     * synchronous and the stream wait below only makes that explicit. */
    dedup_readback host;
    HE_CUDA_TRY(cudaMemcpyAsync(&host, readback, sizeof host, cudaMemcpyDeviceToHost, stream));
    HE_CUDA_TRY(cudaStreamSynchronize(stream));
    if (host.bad_position != ~0ULL) {
        int64_t position = (int64_t)host.bad_position;
        /* Error path only: one more small copy for the message. */
        int64_t id = 0;
        int32_t id32 = 0;
        size_t width = is_int64 ? sizeof id : sizeof id32;
        const char *at = (const char *)ids + (size_t)position * width;
        HE_CUDA_TRY(cudaMemcpyAsync(is_int64 ? (void *)&id : (void *)&id32, at, width, cudaMemcpyDeviceToHost,
                                    stream));
        HE_CUDA_TRY(cudaStreamSynchronize(stream));
        if (!is_int64)
            id = id32;
        return he_fail_out_of_range(position, id, num_rows);
    }
    if (host.num_unique < 1 || host.num_unique > count)
        return he_fail(HE_ERR_CUDA, "GPU dedup of %lld ids returned %lld unique ids", (long long)count,
                       host.num_unique);
    *num_unique = host.num_unique;
    *padding_slot = host.padding_slot;
    return HE_OK;
}
