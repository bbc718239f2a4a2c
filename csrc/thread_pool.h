/* The core's worker threads.
 *
 * In the extension (built with HE_OPENMP) the loops run on OpenMP's
 * threads, which are torch's: one set of threads for torch's ops and the
 * core's. Built without it (the sanitizer tests), one process-wide pool of
 * its own. Either way the caller runs chunks too, so n threads means the
 * caller plus n-1 others, and work is handed out in the same chunks; every
 * parallel loop in the core writes disjoint outputs per item, so results
 * never depend on which thread ran which chunk (identical for any thread
 * count, and for either build). In a forked child the loops run on the
 * calling thread alone. */
#ifndef HE_THREAD_POOL_H
#define HE_THREAD_POOL_H

#include <stdint.h>

#include "he_status.h"

/* Processes items [begin, end). */
typedef void (*he_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Calls fn over [0, n) in chunks of at least `grain` items and returns when
 * all are done. The own pool runs a job on the calling thread alone while
 * it is busy with another caller (two Python threads with the GIL
 * released), so it never deadlocks; OpenMP gives each caller a team. */
he_status he_parallel_for(int64_t n, int64_t grain, he_range_fn fn, void *ctx);

/* Jobs that move less memory than this run on the calling thread alone:
 * waking the workers and waiting for them costs 30-50 us on a 2-vCPU VM,
 * what one thread takes to copy about 1 MiB of random rows (a gather of
 * 512-4096 rows of 256 bytes took 11-83 us on one thread and 41-95 us on
 * two; 8192 rows, 2 MiB, 299 us on one and 192 us on two). */
#define HE_PARALLEL_MIN_BYTES ((int64_t)1 << 20)

/* he_parallel_for of a job that reads and writes about `bytes` of memory in
 * all: on the calling thread alone below HE_PARALLEL_MIN_BYTES. */
he_status he_parallel_for_bytes(int64_t n, int64_t grain, int64_t bytes, he_range_fn fn, void *ctx);

/* Default: the CPUs this process may run on. */
int he_get_num_threads(void);
he_status he_set_num_threads(int n);

#endif
