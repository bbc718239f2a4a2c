/* The GPU path's C API: extern "C" launchers over raw pointers.
 *
 * Plain C (no cuda_runtime.h), so binding/cuda_ops.c includes it without the
 * CUDA headers. It and the kernels see the core only through include/ (the
 * status codes, he_ids' checks, the Adam scalars, the optimizers' kinds and
 * parameters), never csrc/.
 *
 * Streams travel as void * (torch's current_stream().cuda_stream, an int in
 * Python); `device` is the CUDA device index the work belongs to, made
 * current for the call (the caller's current device is restored before it
 * returns). Every function checks every CUDA call and returns a he_status
 * with a message naming the call and CUDA's error.
 *
 * Memory the caller passes:
 *   - "host rows" (table, exp_avg, exp_avg_sq): device addresses of host
 *     memory registered by he_cuda_register (zero-copy over PCIe);
 *   - everything else: device memory from torch's caching allocator, so
 *     frees are stream-ordered and nothing here calls cudaMalloc. */
#ifndef HE_CUDA_H
#define HE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Inside the extern "C" block: the core is C, and the .cu files call its
 * he_fail, he_fail_out_of_range, he_check_table_shape and
 * he_adam_make_consts (implemented in csrc/, declared in include/). */
#include "he_adam.h"
#include "he_cache_policy.h"
#include "he_ids.h"
#include "he_optim.h"
#include "he_status.h"

/* cudaHostRegister(Mapped | Portable) is refused above some size on some
 * drivers; chunks of at most this keep every call well inside the limit. */
#define HE_CUDA_REGISTER_CHUNK ((size_t)64 << 30)

/* ---- host_register.cu */

/* Pins and maps [ptr, ptr + bytes) in chunks and returns the device address
 * of ptr. Fails (and leaves nothing registered) if a chunk is refused or if
 * the chunks' device addresses are not contiguous, since kernels index the
 * whole table from one base. */
he_status he_cuda_register(void *ptr, size_t bytes, int device, void **device_ptr);

/* Undoes he_cuda_register. Waits first for every device the GPU path has
 * run on (a kernel there may still be reading the rows), leaving the
 * caller's current device as it was. Errors are ignored: this runs from
 * deallocators, also at interpreter exit when the CUDA runtime may already
 * be torn down. */
void he_cuda_unregister(void *ptr, size_t bytes, int device);

/* ---- dedup.cu */

/* Sorted unique ids of a batch, every array sized for count ids (the unique
 * count is known only after the call). */
typedef struct he_cuda_dedup_out {
    int64_t *unique;  /* [count]: ascending; the first num_unique are valid */
    int64_t *offsets; /* [count + 1]: positions of unique[k] are order[offsets[k] .. offsets[k+1]) */
    int32_t *order;   /* [count]: positions sorted by (id, position) */
    int64_t *inverse; /* [count]: index into unique of each position's id */
} he_cuda_dedup_out;

/* Bytes of device scratch he_cuda_dedup needs for count ids in a table of
 * num_rows rows (CUB's temporary storage included). */
he_status he_cuda_dedup_workspace(int64_t count, int64_t num_rows, int device, size_t *bytes);

/* Range check + dedup of count device ids (int64 or int32). Returns
 * HE_ERR_INDEX (the CPU path's message, first bad position) without having
 * written anything but the scratch and `out`; on success *num_unique and
 * *padding_slot (index of padding_idx among the unique ids, or -1) are set.
 * Waits for the stream once: the unique count sizes the caller's buffers and
 * a bad id must raise before any kernel touches the table. */
he_status he_cuda_dedup(const void *ids, int64_t count, int is_int64, int64_t num_rows, int64_t padding_idx,
                        void *workspace, size_t workspace_bytes, const he_cuda_dedup_out *out,
                        int64_t *num_unique, int64_t *padding_slot, int device, void *stream);

/* ---- gather.cu */

/* out[k, :] = table[rows[k], :] for k < count: rows read straight from
 * registered host memory. rows must be in range (he_cuda_dedup checked). */
he_status he_cuda_gather(const float *table, int64_t dim, const int64_t *rows, int64_t count, float *out,
                         int device, void *stream);

/* ---- renorm.cu */

/* max_norm in place on registered host rows, as csrc/renorm.c. */
he_status he_cuda_renorm(float *table, int64_t dim, const int64_t *rows, int64_t count, double max_norm,
                         double norm_type, int device, void *stream);

/* ---- grad_reduce.cu */

/* Bytes of device scratch he_cuda_grad_reduce needs. */
he_status he_cuda_grad_reduce_workspace(int64_t count, int64_t num_unique, int64_t dim, int device, size_t *bytes);

/* The coalesced sparse gradient of a lookup: for every unique id but the
 * one at padding_slot (-1: none), out_indices[slot] = id and
 * out_values[slot, :] = the sum of its grad rows (each scaled by
 * 1/occurrences when scale_grad_by_freq). Sums are in ascending position
 * order within chunks of HE_CUDA_REDUCE_CHUNK positions, then over the
 * chunks in order: deterministic, no atomics, and a hot id's rows are
 * summed by many warps. grad: [count, dim] float32 on the device. */
#define HE_CUDA_REDUCE_CHUNK 32
he_status he_cuda_grad_reduce(const float *grad, int64_t dim, int64_t count, const he_cuda_dedup_out *dedup,
                              int64_t num_unique, int64_t padding_slot, int scale_grad_by_freq,
                              void *workspace, size_t workspace_bytes, float *out_values, int64_t *out_indices,
                              int device, void *stream);

/* ---- sparse_adam.cu */

/* csrc/sparse_adam.c's update on rows indices[0..nnz) of registered host
 * w, m, v, with the grad rows values [nnz, dim] in device memory. indices
 * must be unique and in range (the coalesced gradient of he_cuda_grad_reduce):
 * the caller routes any other gradient to the CPU core. Same float32
 * operations in the same order, each rounded on its own. */
he_status he_cuda_sparse_adam(float *weight, float *exp_avg, float *exp_avg_sq, int64_t dim,
                              const int64_t *indices, const float *values, int64_t nnz,
                              const he_adam_params *hp, int device, void *stream);

/* ---- cache.cu: a row cache whose records and planner live in GPU memory */

/* The planner's state, in GPU memory: the same arrays as the CPU planner's
 * (csrc/cache_plan.c, its host twin), following include/he_cache_policy.h. */
typedef struct he_cuda_cache {
    uint32_t *entry;     /* [num_rows]: each row's entry (slot + 1; the clock's recent uses) */
    int64_t num_rows;
    int64_t *row_of;     /* [capacity]: the row in each slot, -1: empty */
    int64_t *used_at;    /* [capacity]: the last batch that used the slot */
    uint8_t *referenced; /* [capacity]: CLOCK's second chance */
    int64_t capacity;
    int64_t *counters;   /* [HE_CUDA_CACHE_COUNTERS], see below */
    int protect;         /* 1 or 2, as the CPU planner's */
    int policy;          /* HE_CACHE_CLOCK or HE_CACHE_FREQUENCY */
    /* HE_CACHE_FREQUENCY's (NULL for the clock): per row its uses, the
     * batch of its last use and of its last turning away (0: never); per
     * slot its row's uses. */
    uint16_t *count;
    uint32_t *last;
    uint32_t *turned_at;
    uint16_t *slot_count;
} he_cuda_cache;

/* counters[]: the hand and a plan's bookkeeping, then counts since the
 * cache was made (bypassed rows = rows - hits - fetches). */
enum {
    HE_CUDA_CACHE_HAND,
    HE_CUDA_CACHE_BASE,   /* misses met by the rounds so far */
    HE_CUDA_CACHE_MISSES, /* this batch's misses */
    HE_CUDA_CACHE_STOP,   /* where the hand settled last in a round */
    HE_CUDA_CACHE_BATCHES,
    HE_CUDA_CACHE_ROWS,
    HE_CUDA_CACHE_HITS,
    HE_CUDA_CACHE_FETCHES,
    HE_CUDA_CACHE_EVICTIONS,
    /* the frequency policy's: the window (its slots, its hand), a batch's
     * eligible main slots, its rows turned away lately and now, the least
     * used main row's uses, the gate's averages and recent counts
     * (include/he_cache_policy.h's he_cache_gate), and the window's free
     * slots met and the last one taken */
    HE_CUDA_CACHE_WINDOW,
    HE_CUDA_CACHE_WINDOW_HAND,
    HE_CUDA_CACHE_ELIGIBLE,
    HE_CUDA_CACHE_BACK,
    HE_CUDA_CACHE_TURNED,
    HE_CUDA_CACHE_LEAST,
    HE_CUDA_CACHE_REUSE,
    HE_CUDA_CACHE_MAIN,
    HE_CUDA_CACHE_RECENT, /* HE_CACHE_GATE_SPAN of them */
    HE_CUDA_CACHE_TAKEN = HE_CUDA_CACHE_RECENT + HE_CACHE_GATE_SPAN,
    HE_CUDA_CACHE_HOST_READS, /* rows of arrays the moves read over PCIe (fetches) */
    HE_CUDA_CACHE_COUNTERS
};

/* One batch's plan, in device arrays sized for its n unique rows: slot[k]
 * is unique[k]'s slot (-1: it bypasses the cache); miss[0..misses) the
 * positions k of the batch's misses, ascending (misses in
 * counters[HE_CUDA_CACHE_MISSES]); evict_row[j] the row whose record the
 * j-th miss's slot held and writes back (-1: none). A miss with a slot
 * fetches its record into it after that write-back. */
typedef struct he_cuda_cache_batch {
    int32_t *slot;
    int64_t *miss;
    int64_t *evict_row;
} he_cuda_cache_batch;

/* The records and the host rows they cache: count arrays (the weight,
 * then the optimizer state), records[i] [capacity, dim] in device memory,
 * host[i] the device address of registered host rows [num_rows, dim].
 * For the moves (he_cuda_cache_move, he_cuda_cache_sync_records; NULL and 0
 * elsewhere): written[row] (device memory, a byte a row) is set once a
 * row's host state may differ from what it was when the state came to the
 * cache (the row was bypassed, so updated there, or written back); array
 * i with bit i of zero_fill set held all-zero bits then, so a row not
 * written since is fetched as zeros instead of read over PCIe. */
#define HE_CUDA_CACHE_ARRAYS 3
typedef struct he_cuda_cache_arrays {
    float *records[HE_CUDA_CACHE_ARRAYS];
    float *host[HE_CUDA_CACHE_ARRAYS];
    int count;
    int64_t dim;
    uint8_t *written;
    unsigned zero_fill;
} he_cuda_cache_arrays;

/* Bytes of device scratch he_cuda_cache_plan needs for n rows. */
he_status he_cuda_cache_plan_workspace(int64_t n, int64_t capacity, int policy, int device, size_t *bytes);

/* Plans batch number `batch` (1, 2, ...: one more than the last) whose
 * unique rows are unique[0..n) (ascending, distinct, in range: a
 * he_cuda_dedup's), as csrc/cache_plan.c would, entirely on the stream:
 * nothing waits for the device. */
he_status he_cuda_cache_plan(const he_cuda_cache *c, const int64_t *unique, int64_t n, int64_t batch,
                             const he_cuda_cache_batch *plan, void *workspace, size_t workspace_bytes, int device,
                             void *stream);

/* Carries out a plan's moves: each miss given a slot writes the slot's
 * record back to its old row (when it held one), then reads its own row's
 * record into it, over the mapping, every array of `a`. It must follow its
 * plan with no update (he_cuda_cache_adam, he_cuda_cache_update) between
 * them: the plan has already put the new rows in the map, and an update
 * would find a new row in a slot that still holds the old row's record. */
he_status he_cuda_cache_move(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *unique, int64_t n,
                             const he_cuda_cache_batch *plan, int device, void *stream);

/* out[k] = unique[k]'s row of array 0 (the weight): from its slot, or over
 * the mapping where it bypasses the cache. */
he_status he_cuda_cache_gather(const he_cuda_cache_arrays *a, const int64_t *unique, const int32_t *slot, int64_t n,
                               float *out, int device, void *stream);

/* SparseAdam (sparse_adam.cu's arithmetic) of rows indices[0..nnz)
 * (distinct, in range) with gradient rows values [nnz, dim]: each in its
 * slot if the cache holds it now, else in host memory over the mapping.
 * a: weight, exp_avg, exp_avg_sq. */
he_status he_cuda_cache_adam(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *indices,
                             const float *values, int64_t nnz, const he_adam_params *hp, int device, void *stream);

/* SGD, Adagrad or row-wise Adagrad (hp->kind: HE_OPTIM_SGD,
 * HE_OPTIM_ADAGRAD, HE_OPTIM_ROWWISE_ADAGRAD) of rows indices[0..nnz)
 * (distinct, in range) with gradient rows values [nnz, dim], float32
 * state: each row in its slot if the cache holds it now, else in host
 * memory over the mapping, with the CPU core's bits (csrc/optimizer_rows.inc's
 * operations in its order; row-wise Adagrad's squares summed in its 8
 * lanes). a: the weight [*, dim], then the state: none for SGD (count 1),
 * Adagrad's sum [*, dim] or row-wise Adagrad's row_sum [*, 1] (count 2;
 * a->dim is the weight's). hp's lr, eps, lr_decay, step and maximize are
 * read as the core reads them for the kind; like the core's rules for
 * these kinds, none takes weight_decay. */
he_status he_cuda_cache_update(const he_cuda_cache *c, const he_cuda_cache_arrays *a, const int64_t *indices,
                               const float *values, int64_t nnz, const he_optim_params *hp, int device,
                               void *stream);

/* The records and host rows of a SparseAdam whose moments are compact
 * (csrc/quantize.h's 8-bit forms, or bfloat16), as the CPU core keeps
 * them: weight [*, dim] float32; exp_avg and exp_avg_sq [*, dim] codes of
 * m_dtype and v_dtype (HE_BF16, HE_Q8, and for exp_avg_sq HE_Q8_NONNEG);
 * for an 8-bit moment its scales, float32 [*, ceil(dim / 256)] (NULL for a
 * bfloat16 one). records[i] [capacity, ...] in device memory, host[i] the
 * device address of registered host rows [num_rows, ...]. */
#define HE_CUDA_COMPACT_ARRAYS 5
typedef struct he_cuda_cache_compact {
    void *records[HE_CUDA_COMPACT_ARRAYS]; /* weight, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale */
    void *host[HE_CUDA_COMPACT_ARRAYS];
    int m_dtype, v_dtype;
    int64_t dim;
} he_cuda_cache_compact;

/* he_cuda_cache_adam on compact moments, with the CPU core's bits
 * (csrc/sparse_update.c's update_blocks): each block of 256 columns of a
 * row (an 8-bit scale's) widened to float32, updated, and rounded back to
 * nearest, an 8-bit moment's block requantized whole from its new values.
 * The moves and syncs carry the compact arrays as float32 words, so a
 * row's codes must fill whole words (the binding checks). */
he_status he_cuda_cache_adam_compact(const he_cuda_cache *c, const he_cuda_cache_compact *a, const int64_t *indices,
                                     const float *values, int64_t nnz, const he_adam_params *hp, int device,
                                     void *stream);

/* Every occupied slot's record of each array of `a`: written to its host
 * row (to_host), or read from it. */
he_status he_cuda_cache_sync_records(const he_cuda_cache *c, const he_cuda_cache_arrays *a, int to_host, int device,
                                     void *stream);

#ifdef __cplusplus
}
#endif

#endif
