/* Big host buffers for tables and optimizer state. */
#ifndef HE_HOST_MEMORY_H
#define HE_HOST_MEMORY_H

#include <stddef.h>

#include "he_status.h"

/* Reserves `bytes` of zeroed host memory. Pages cost nothing until first
 * written, so optimizer state for rows that are never trained stays free.
 * A zero-byte request still returns a valid (one page) mapping. */
he_status he_host_alloc(size_t bytes, void **out);

/* Maps `bytes` of the file `fd` (at least that long) shared: the processes
 * of one host that map the same file see one copy of a table, whatever
 * their number. Freed by he_host_free. */
he_status he_host_map_shared(int fd, size_t bytes, void **out);

/* Writes zeros over the buffer from the worker threads so that, on a NUMA
 * machine, each page lands near the threads that will later use it. */
he_status he_host_first_touch(void *ptr, size_t bytes);

void he_host_free(void *ptr, size_t bytes);

/* Scratch buffers: lookup outputs and gradient values, allocated and dropped
 * every step. A fresh mapping costs a page fault per 4 KiB on first write
 * (~10 ms for a 32 MiB output here, 5x the gather itself), so released
 * scratch mappings are kept, up to HE_SCRATCH_SLOTS of them and
 * HE_SCRATCH_MAX_BYTES in all, and handed out again for the same size.
 * Contents are undefined. Not MADV_DONTFORK: a forked child may read an
 * output tensor it inherited. No huge-page hint either: with THP defrag on
 * "madvise" a huge-page fault may stall on compaction, and these buffers
 * are read sequentially. */
#define HE_SCRATCH_SLOTS 32
#define HE_SCRATCH_MAX_BYTES ((size_t)4 << 30)

/* *mapped gets the buffer's real size (>= bytes): sizes are rounded up to
 * size classes 1/8 to 1/16 of the size apart, so batches whose unique-row
 * count varies a little from step to step still reuse one buffer. Pass that
 * size back to he_scratch_release. */
he_status he_scratch_alloc(size_t bytes, void **out, size_t *mapped);
void he_scratch_release(void *ptr, size_t mapped);
/* Unmaps every kept scratch buffer (hostembed.empty_cache()). */
void he_scratch_trim(void);

/* A call's temporary array: from the scratch cache when big, where malloc
 * would map (and fault in) a few fresh MiB a step once glibc had given the
 * last step's back (a 65,536-id sort: 1.7-2.0 ms against 0.50); from
 * malloc's heap when small. */
typedef struct he_temp {
    void *ptr;
    size_t mapped; /* 0: from malloc */
} he_temp;

he_status he_temp_alloc(he_temp *t, size_t bytes);
void he_temp_free(he_temp *t); /* a zeroed or freed he_temp is fine */

#endif
