/* Big host buffers for tables and optimizer state. */
#ifndef HE_HOST_MEMORY_H
#define HE_HOST_MEMORY_H

#include <stddef.h>

#include "he_status.h"

/* Reserves `bytes` of zeroed host memory. Pages cost nothing until first
 * written, so optimizer state for rows that are never trained stays free.
 * A zero-byte request still returns a valid (one page) mapping. */
he_status he_host_alloc(size_t bytes, void **out);

/* Writes zeros over the buffer from the worker threads so that, on a NUMA
 * machine, each page lands near the threads that will later use it. */
he_status he_host_first_touch(void *ptr, size_t bytes);

void he_host_free(void *ptr, size_t bytes);

#endif
