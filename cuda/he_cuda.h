/* The GPU path's C API: extern "C" launchers over raw pointers.
 *
 * Plain C (no cuda_runtime.h), so binding/cuda_ops.c includes it without the
 * CUDA headers. It and the kernels see the core only through include/ (the
 * status codes, he_ids' checks, the Adam scalars), never csrc/.
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
#include "he_ids.h"
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

#ifdef __cplusplus
}
#endif

#endif
