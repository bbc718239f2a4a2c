#define _GNU_SOURCE
#include "host_memory.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "thread_pool.h"

static size_t mapped_size(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes == 0)
        return page;
    return (bytes + page - 1) / page * page;
}

he_status he_host_alloc(size_t bytes, void **out)
{
    *out = NULL;
    size_t len = mapped_size(bytes);
    if (len < bytes)
        return he_fail(HE_ERR_NOMEM, "could not allocate %zu bytes of host memory: size overflows", bytes);
    /* Anonymous mmap rather than malloc: the pages are zero and lazily
     * backed (state for untouched rows costs no RSS), the mapping is
     * page-aligned for cudaHostRegister, and munmap returns it at once. */
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return he_fail(HE_ERR_NOMEM, "could not allocate %zu bytes of host memory: %s", bytes,
                       strerror(errno));
#ifdef MADV_HUGEPAGE
    /* Random row access over tens of GB thrashes the TLB with 4 KiB pages.
     * Only a hint: a kernel without THP simply ignores it. */
    (void)madvise(p, len, MADV_HUGEPAGE);
#endif
#ifdef MADV_DONTFORK
    /* DataLoader workers fork; without this every fork would copy the page
     * tables of the whole table and copy-on-write would pin it twice. The
     * children never touch the table. */
    (void)madvise(p, len, MADV_DONTFORK);
#endif
    *out = p;
    return HE_OK;
}

typedef struct touch_job {
    char *base;
    size_t bytes;
    size_t block;
} touch_job;

static void touch_range(void *ctx, int64_t begin, int64_t end)
{
    touch_job *job = ctx;
    for (int64_t b = begin; b < end; b++) {
        size_t off = (size_t)b * job->block;
        size_t len = job->bytes - off < job->block ? job->bytes - off : job->block;
        memset(job->base + off, 0, len);
    }
}

he_status he_host_first_touch(void *ptr, size_t bytes)
{
    touch_job job = {ptr, bytes, (size_t)2 << 20};
    int64_t blocks = (int64_t)((bytes + job.block - 1) / job.block);
    return he_parallel_for(blocks, 1, touch_range, &job);
}

void he_host_free(void *ptr, size_t bytes)
{
    if (ptr)
        munmap(ptr, mapped_size(bytes));
}
