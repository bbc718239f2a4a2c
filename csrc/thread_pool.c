#define _GNU_SOURCE
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#ifdef HE_OPENMP
#include <omp.h>
#endif

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

#ifndef HE_OPENMP /* the pool's own workers */
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
#endif

/* Set in a forked child: OpenMP's threads stayed with the parent, and
 * libgomp would wait for them forever; the child's loops run serially. */
static int in_forked_child;

/* A forked child has none of the parent's threads: forget them (their
 * stacks went with the parent) and start afresh on first use. */
static void reset_in_child(void)
{
    in_forked_child = 1;
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

#ifndef HE_OPENMP
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
#endif

/* About sixteen chunks per thread balances uneven items (a Zipf-hot id
 * sums thousands of rows) for the price of one atomic add per chunk. */
static int64_t chunk_size(int64_t n, int64_t grain, int64_t threads)
{
    int64_t chunk = (n + threads * 16 - 1) / (threads * 16);
    return chunk < grain ? grain : chunk;
}

#ifdef HE_OPENMP
/* The extension's build: the loops run on OpenMP's threads, which are
 * torch's own (the extension links libgomp by soname, and torch has loaded
 * it first), so the core and torch's ops share one set of threads instead
 * of two sets contending for the cores: torch's threads spin for a while
 * after each of its parallel ops, and a worker of our own then waits for a
 * core (measured on 2 vCPUs: a fused backward of 8,192 ids took 2.3 ms with
 * torch's threads about, 1.3 ms without them, 1.1 ms on the shared
 * threads). The same chunks as the pthread pool, taken by an atomic
 * counter (no OpenMP loop schedule, whose entry points vary between
 * libgomp versions). */
static void run_job(int64_t n, int64_t grain, he_range_fn fn, void *ctx)
{
    int64_t threads = he_get_num_threads();
    if (n <= grain || threads < 2 || in_forked_child || omp_in_parallel()) {
        fn(ctx, 0, n);
        return;
    }
    int64_t chunk = chunk_size(n, grain, threads);
    int64_t num_chunks = (n + chunk - 1) / chunk;
    if (threads > num_chunks)
        threads = num_chunks;
    atomic_llong next_chunk = 0;
#pragma omp parallel num_threads((int)threads)
    for (;;) {
        int64_t c = atomic_fetch_add(&next_chunk, 1);
        if (c >= num_chunks)
            break;
        int64_t begin = c * chunk;
        fn(ctx, begin, begin + chunk < n ? begin + chunk : n);
    }
}
#else
static void run_job(int64_t n, int64_t grain, he_range_fn fn, void *ctx)
{
    if (n <= grain || pthread_mutex_trylock(&job_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    pool *p = &the_pool;
    start_workers(p);
    if (p->num_workers == 0) {
        pthread_mutex_unlock(&job_lock);
        fn(ctx, 0, n);
        return;
    }
    int64_t chunk = chunk_size(n, grain, p->num_workers + 1);

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
}
#endif

he_status he_parallel_for(int64_t n, int64_t grain, he_range_fn fn, void *ctx)
{
    if (n <= 0)
        return HE_OK;
    pthread_once(&atfork_once, register_atfork);
    run_job(n, grain < 1 ? 1 : grain, fn, ctx);
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
