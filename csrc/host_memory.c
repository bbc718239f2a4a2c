#define _GNU_SOURCE
#include "host_memory.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
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

static he_status map_anonymous(size_t bytes, void **out)
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
    *out = p;
    return HE_OK;
}

he_status he_host_alloc(size_t bytes, void **out)
{
    he_status st = map_anonymous(bytes, out);
#ifdef MADV_HUGEPAGE
    /* Random row access over tens of GB thrashes the TLB with 4 KiB pages.
     * Only a hint: a kernel without THP ignores it. */
    if (st == HE_OK)
        (void)madvise(*out, mapped_size(bytes), MADV_HUGEPAGE);
#endif
#ifdef MADV_DONTFORK
    /* DataLoader workers fork; without this every fork would copy the page
     * tables of the whole table and copy-on-write would pin it twice. The
     * children never touch the table. */
    if (st == HE_OK)
        (void)madvise(*out, mapped_size(bytes), MADV_DONTFORK);
#endif
    return st;
}

he_status he_host_map_shared(int fd, size_t bytes, void **out)
{
    *out = NULL;
    size_t len = mapped_size(bytes);
    if (len < bytes)
        return he_fail(HE_ERR_NOMEM, "could not map %zu bytes of shared memory: size overflows", bytes);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return he_fail(HE_ERR_NOMEM, "could not map %zu bytes of shared memory: %s", bytes, strerror(errno));
#ifdef MADV_DONTFORK
    /* As he_host_alloc's: a forked worker must not inherit the mapping. */
    (void)madvise(p, len, MADV_DONTFORK);
#endif
    *out = p;
    return HE_OK;
}

static struct {
    pthread_mutex_t lock;
    void *ptr[HE_SCRATCH_SLOTS];
    size_t len[HE_SCRATCH_SLOTS]; /* 0: empty slot */
    size_t total;
} scratch = {.lock = PTHREAD_MUTEX_INITIALIZER};

static size_t size_class(size_t bytes)
{
    size_t granule = 4096;
    while (granule * 8 <= bytes)
        granule *= 2;
    size_t len = (bytes + granule - 1) / granule * granule;
    return len < bytes ? bytes : mapped_size(len);
}

/* A fork while another thread holds the lock (a sort or a lookup with the
 * GIL released) would leave the child's copy locked for good: the lock is
 * held across fork() and released on both sides. */
static void scratch_lock(void)
{
    pthread_mutex_lock(&scratch.lock);
}

static void scratch_unlock(void)
{
    pthread_mutex_unlock(&scratch.lock);
}

static pthread_once_t scratch_atfork_once = PTHREAD_ONCE_INIT;

static void scratch_register_atfork(void)
{
    (void)pthread_atfork(scratch_lock, scratch_unlock, scratch_unlock);
}

he_status he_scratch_alloc(size_t bytes, void **out, size_t *mapped)
{
    size_t len = size_class(bytes);
    *mapped = len;
    pthread_once(&scratch_atfork_once, scratch_register_atfork);
    pthread_mutex_lock(&scratch.lock);
    for (int i = 0; i < HE_SCRATCH_SLOTS; i++) {
        if (scratch.len[i] == len) {
            *out = scratch.ptr[i];
            scratch.len[i] = 0;
            scratch.total -= len;
            pthread_mutex_unlock(&scratch.lock);
            return HE_OK;
        }
    }
    pthread_mutex_unlock(&scratch.lock);
    return map_anonymous(len, out);
}

void he_scratch_release(void *ptr, size_t mapped)
{
    if (!ptr)
        return;
    size_t len = mapped;
    pthread_mutex_lock(&scratch.lock);
    if (len <= HE_SCRATCH_MAX_BYTES) {
        /* Make room: drop the largest kept buffers until this one fits. */
        for (;;) {
            int empty = -1, largest = -1;
            for (int i = 0; i < HE_SCRATCH_SLOTS; i++) {
                if (scratch.len[i] == 0)
                    empty = empty < 0 ? i : empty;
                else if (largest < 0 || scratch.len[i] > scratch.len[largest])
                    largest = i;
            }
            if (empty >= 0 && scratch.total + len <= HE_SCRATCH_MAX_BYTES) {
                scratch.ptr[empty] = ptr;
                scratch.len[empty] = len;
                scratch.total += len;
                ptr = NULL;
                break;
            }
            /* largest >= 0 here: a full or over-budget cache is not empty. */
            munmap(scratch.ptr[largest], scratch.len[largest]);
            scratch.total -= scratch.len[largest];
            scratch.len[largest] = 0;
        }
    }
    pthread_mutex_unlock(&scratch.lock);
    if (ptr)
        munmap(ptr, len);
}

void he_scratch_trim(void)
{
    pthread_mutex_lock(&scratch.lock);
    for (int i = 0; i < HE_SCRATCH_SLOTS; i++) {
        if (scratch.len[i]) {
            munmap(scratch.ptr[i], scratch.len[i]);
            scratch.len[i] = 0;
        }
    }
    scratch.total = 0;
    pthread_mutex_unlock(&scratch.lock);
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

#define HE_TEMP_SCRATCH_MIN ((size_t)256 << 10)

he_status he_temp_alloc(he_temp *t, size_t bytes)
{
    t->mapped = 0;
    if (bytes < HE_TEMP_SCRATCH_MIN) {
        t->ptr = malloc(bytes ? bytes : 1);
        return t->ptr ? HE_OK : he_fail(HE_ERR_NOMEM, "could not allocate %zu bytes", bytes);
    }
    he_status st = he_scratch_alloc(bytes, &t->ptr, &t->mapped);
    if (st != HE_OK)
        t->ptr = NULL, t->mapped = 0;
    return st;
}

void he_temp_free(he_temp *t)
{
    if (t->mapped)
        he_scratch_release(t->ptr, t->mapped);
    else
        free(t->ptr);
    t->ptr = NULL;
    t->mapped = 0;
}
