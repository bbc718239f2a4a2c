#define _GNU_SOURCE
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define HE_MAX_THREADS 1024

typedef struct pool {
    pthread_mutex_t lock;
    pthread_cond_t wake;     /* workers wait here for a new generation */
    pthread_cond_t finished; /* the caller waits here for busy == 0 */
    int num_threads;         /* wanted, caller included; 0 = not yet decided */
    int num_workers;         /* started */
    pthread_t workers[HE_MAX_THREADS];
    uint64_t generation;
    int busy;                /* workers still inside the current job */
    int shutdown;

    /* The current job. */
    he_range_fn fn;
    void *ctx;
    int64_t n, chunk, num_chunks;
    atomic_llong next_chunk;
} pool;

static pool the_pool = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
};
/* Held for a whole job (and while resizing): one job at a time. */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void run_chunks(pool *p)
{
    for (;;) {
        int64_t c = atomic_fetch_add(&p->next_chunk, 1);
        if (c >= p->num_chunks)
            return;
        int64_t begin = c * p->chunk;
        int64_t end = begin + p->chunk < p->n ? begin + p->chunk : p->n;
        p->fn(p->ctx, begin, end);
    }
}

/* arg: the generation when the worker was created. Reading it here instead
 * would race with the caller publishing the first job and lose its wakeup. */
static void *worker_main(void *arg)
{
    pool *p = &the_pool;
    uint64_t seen = (uint64_t)(uintptr_t)arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (p->generation == seen && !p->shutdown)
            pthread_cond_wait(&p->wake, &p->lock);
        if (p->shutdown)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->lock);
        run_chunks(p);
        pthread_mutex_lock(&p->lock);
        if (--p->busy == 0)
            pthread_cond_signal(&p->finished);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* A forked child has none of the parent's threads: forget them (their
 * stacks went with the parent) and start afresh on first use. */
static void reset_in_child(void)
{
    pthread_mutex_init(&the_pool.lock, NULL);
    pthread_cond_init(&the_pool.wake, NULL);
    pthread_cond_init(&the_pool.finished, NULL);
    pthread_mutex_init(&job_lock, NULL);
    the_pool.num_workers = 0;
    the_pool.busy = 0;
    the_pool.shutdown = 0;
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, reset_in_child);
}

static int cpus_available(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0)
            return n > HE_MAX_THREADS ? HE_MAX_THREADS : n;
    }
    return 1;
}

/* Called with job_lock held. */
static void stop_workers(pool *p)
{
    pthread_mutex_lock(&p->lock);
    p->shutdown = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->num_workers; i++)
        pthread_join(p->workers[i], NULL);
    p->num_workers = 0;
    p->shutdown = 0;
}

/* Called with job_lock held. A worker that cannot be started is not an
 * error: the job runs on the threads we have. */
static void start_workers(pool *p)
{
    if (p->num_threads == 0)
        p->num_threads = cpus_available();
    while (p->num_workers < p->num_threads - 1) {
        if (pthread_create(&p->workers[p->num_workers], NULL, worker_main, (void *)(uintptr_t)p->generation) != 0)
            break;
        p->num_workers++;
    }
}

he_status he_parallel_for(int64_t n, int64_t grain, he_range_fn fn, void *ctx)
{
    if (n <= 0)
        return HE_OK;
    if (grain < 1)
        grain = 1;
    pthread_once(&atfork_once, register_atfork);
    if (n <= grain || pthread_mutex_trylock(&job_lock) != 0) {
        fn(ctx, 0, n);
        return HE_OK;
    }
    pool *p = &the_pool;
    start_workers(p);
    if (p->num_workers == 0) {
        pthread_mutex_unlock(&job_lock);
        fn(ctx, 0, n);
        return HE_OK;
    }
    /* About sixteen chunks per thread balances uneven items (a Zipf-hot id
     * sums thousands of rows) for the price of one atomic add per chunk. */
    int64_t threads = p->num_workers + 1;
    int64_t chunk = (n + threads * 16 - 1) / (threads * 16);
    if (chunk < grain)
        chunk = grain;

    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk;
    p->num_chunks = (n + chunk - 1) / chunk;
    atomic_store(&p->next_chunk, 0);
    p->busy = p->num_workers;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);

    run_chunks(p);

    pthread_mutex_lock(&p->lock);
    while (p->busy > 0)
        pthread_cond_wait(&p->finished, &p->lock);
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&job_lock);
    return HE_OK;
}

he_status he_parallel_for_bytes(int64_t n, int64_t grain, int64_t bytes, he_range_fn fn, void *ctx)
{
    return he_parallel_for(n, bytes < HE_PARALLEL_MIN_BYTES ? n : grain, fn, ctx);
}

int he_get_num_threads(void)
{
    pthread_mutex_lock(&job_lock);
    if (the_pool.num_threads == 0)
        the_pool.num_threads = cpus_available();
    int n = the_pool.num_threads;
    pthread_mutex_unlock(&job_lock);
    return n;
}

he_status he_set_num_threads(int n)
{
    if (n < 1 || n > HE_MAX_THREADS)
        return he_fail(HE_ERR_VALUE, "number of threads must be between 1 and %d, got %d",
                       HE_MAX_THREADS, n);
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&job_lock);
    stop_workers(&the_pool);
    the_pool.num_threads = n;
    pthread_mutex_unlock(&job_lock);
    return HE_OK;
}
