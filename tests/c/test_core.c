/* C-level tests of hostembed's core (every csrc/ source).
 *
 * Standalone C11, no Python and no test framework. Every result is compared
 * with a simple reference computed here (in double where sums are involved),
 * and the program is meant to run under AddressSanitizer + UBSan (see
 * tests/test_core_sanitized.py), so out-of-bounds accesses, leaks and UB in
 * the core fail it as well.
 *
 * Build (the pytest wrapper does this):
 *   cc -std=c11 -O1 -g -fsanitize=address,undefined -ffp-contract=off
 *      -fno-math-errno -pthread -Iinclude -Icsrc tests/c/test_core.c csrc/[a-z]*.c -lm
 * -ffp-contract=off matters: the SparseAdam reference below must round every
 * float operation on its own, exactly as the core does.
 *
 * tests/test_core_sanitized.py also builds it with -fsanitize=thread and
 * runs it (the "concurrency" group has several program threads call the
 * core on several tables at once while another changes the thread count);
 * simd.h turns target_clones off for sanitizer builds. It runs clean under
 * valgrind too (built without sanitizers).
 *
 * Output: one line per test group, then exactly "N passed, M failed"; the
 * exit status is non-zero if any check failed. */

/* fork, waitpid, kill, nanosleep, sysconf under -std=c11. */
#define _GNU_SOURCE /* O_DIRECT, for the row file test */
#define _POSIX_C_SOURCE 200809L

#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache_plan.h"
#include "convert.h"
#include "quantize.h"
#include "dedup.h"
#include "gather.h"
#include "grad_reduce.h"
#include "he_cache_policy.h"
#include "he_status.h"
#include "host_memory.h"
#include "ids.h"
#include "renorm.h"
#include "row_file.h"
#include "optimizers.h"
#include "pool_bags.h"
#include "sparse_adam.h"
#include "sparse_update.h"
#include "table.h"
#include "thread_pool.h"

#if defined(__SANITIZE_THREAD__)
#define TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TEST_UNDER_TSAN 1
#endif
#endif

/* ------------------------------------------------------------------------ */
/* Checks                                                                   */

static int g_passed, g_failed;
static int g_group_failed; /* failures in the current group */

#define CHECKF(expr, ...)                                                          \
    do {                                                                           \
        if (expr) {                                                                \
            g_passed++;                                                            \
        } else {                                                                   \
            g_failed++;                                                            \
            g_group_failed++;                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n    ", __FILE__, __LINE__, #expr); \
            fprintf(stderr, __VA_ARGS__);                                          \
            fprintf(stderr, "\n");                                                 \
        }                                                                          \
    } while (0)

#define CHECK(expr) CHECKF(expr, "%s", "")

/* A status check that prints the core's message when it is not the one
 * expected. */
#define CHECK_ST(call, want)                                                                     \
    do {                                                                                         \
        he_status st_ = (call);                                                                  \
        CHECKF(st_ == (want), "got status %d, want %d (%s); last error: \"%s\"", (int)st_, (int)(want), \
               #want, he_last_error());                                                          \
    } while (0)

/* The calling thread's last error contains `s`. */
#define CHECK_MSG(s) CHECKF(strstr(he_last_error(), (s)) != NULL, "message \"%s\" lacks \"%s\"", he_last_error(), (s))

static void group_begin(void)
{
    g_group_failed = 0;
}

static void group_end(const char *name)
{
    printf("%-14s %s\n", name, g_group_failed ? "FAILED" : "ok");
    fflush(stdout);
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test harness: out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

static void *xdup(const void *src, size_t bytes)
{
    void *p = xmalloc(bytes);
    if (bytes)
        memcpy(p, src, bytes);
    return p;
}

/* A row-major [rows, dim] table over memory of exactly its size. */
static he_table tab(float *data, int64_t rows, int64_t dim)
{
    size_t bytes = rows > 0 && dim > 0 ? (size_t)rows * (size_t)dim * sizeof(float) : 0;
    return he_table_contiguous(data, bytes, rows, dim);
}

static he_status gather(float *table, int64_t rows, int64_t dim, const he_ids *ids, float *out)
{
    he_table t = tab(table, rows, dim);
    return he_gather(&t, ids, out);
}

static he_status renorm(float *table, int64_t rows, int64_t dim, const he_dedup *d, double max_norm, double p)
{
    he_table t = tab(table, rows, dim);
    return he_renorm(&t, d, max_norm, p);
}

static he_status adam(float *w, float *m, float *v, int64_t rows, int64_t dim, const int64_t *indices,
                      const float *values, int64_t nnz, const he_adam_params *hp)
{
    he_table tw = tab(w, rows, dim), tm = tab(m, rows, dim), tv = tab(v, rows, dim);
    return he_sparse_adam(&tw, &tm, &tv, indices, values, nnz, hp);
}

static void set_threads(int n)
{
    CHECK_ST(he_set_num_threads(n), HE_OK);
}

/* ------------------------------------------------------------------------ */
/* Deterministic random numbers (splitmix64)                                */

static uint64_t g_rng = 0x243F6A8885A308D3ull;

static uint64_t rng_next(void)
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, n); the modulo bias is irrelevant here. */
static int64_t rng_below(uint64_t n)
{
    return (int64_t)(rng_next() % n);
}

/* Uniform in [lo, hi). */
static double rng_uniform(double lo, double hi)
{
    return lo + (hi - lo) * ((double)(rng_next() >> 11) * 0x1.0p-53);
}

static void fill_uniform(float *x, int64_t n, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)rng_uniform(lo, hi);
}

/* ------------------------------------------------------------------------ */
/* Status messages                                                          */

static void *fail_in_other_thread(void *arg)
{
    (void)arg;
    he_fail(HE_ERR_VALUE, "set by another thread");
    return NULL;
}

static void test_status(void)
{
    group_begin();
    /* Nothing has failed yet on this thread. */
    CHECK(strcmp(he_last_error(), "") == 0);
    CHECK(he_fail(HE_ERR_SYSTEM, "code %d", 7) == HE_ERR_SYSTEM);
    CHECK(strcmp(he_last_error(), "code 7") == 0);
    /* The message is per thread: another thread's failure is not seen here. */
    pthread_t t;
    CHECK(pthread_create(&t, NULL, fail_in_other_thread, NULL) == 0);
    pthread_join(t, NULL);
    CHECK(strcmp(he_last_error(), "code 7") == 0);
    group_end("status");
}

/* ------------------------------------------------------------------------ */
/* Host memory                                                              */

static int all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

static void test_host_memory(void)
{
    group_begin();
    size_t page = (size_t)sysconf(_SC_PAGESIZE);

    /* Not a multiple of the page or of first_touch's 2 MiB block, so the
     * last block is a partial one. */
    size_t bytes = (5u << 20) + 123;
    void *p = NULL;
    CHECK_ST(he_host_alloc(bytes, &p), HE_OK);
    CHECK(p != NULL);
    if (p) {
        CHECK((uintptr_t)p % page == 0);
        CHECK(all_zero(p, bytes));
        /* first_touch writes zeros over whatever is there, from several
         * threads. */
        memset(p, 0xAB, bytes);
        for (int t = 1; t <= 3; t += 2) {
            set_threads(t);
            CHECK_ST(he_host_first_touch(p, bytes), HE_OK);
            CHECK(all_zero(p, bytes));
            memset(p, 0xCD, bytes);
        }
        CHECK_ST(he_host_first_touch(p, 0), HE_OK);
        CHECK(((unsigned char *)p)[0] == 0xCD);
        he_host_free(p, bytes);
    }

    /* Zero bytes: still a valid mapping (one page). */
    void *z = NULL;
    CHECK_ST(he_host_alloc(0, &z), HE_OK);
    CHECK(z != NULL);
    he_host_free(z, 0);
    he_host_free(NULL, 123); /* a no-op */

    /* 4 EiB: more than any address space; the message gives the size. */
    void *huge = (void *)&huge;
    CHECK_ST(he_host_alloc((size_t)1 << 62, &huge), HE_ERR_NOMEM);
    CHECK(huge == NULL);
    CHECK_MSG("4611686018427387904");

    /* Rounding SIZE_MAX up to whole pages overflows. */
    huge = (void *)&huge;
    CHECK_ST(he_host_alloc(SIZE_MAX, &huge), HE_ERR_NOMEM);
    CHECK(huge == NULL);
    CHECK_MSG("18446744073709551615");

    /* Two mappings of one file (as two ranks of a host map it) are one
     * copy: a write through one is read through the other, and a file that
     * is not open fails with the system's reason. */
    char path[] = "/tmp/he_test_shared_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd >= 0) {
        unlink(path);
        size_t shared_bytes = 3 * page + 5;
        CHECK(ftruncate(fd, (off_t)shared_bytes) == 0);
        void *a = NULL, *b = NULL;
        CHECK_ST(he_host_map_shared(fd, shared_bytes, &a), HE_OK);
        CHECK_ST(he_host_map_shared(fd, shared_bytes, &b), HE_OK);
        if (a && b) {
            CHECK(a != b);
            CHECK(all_zero(b, shared_bytes));
            memset(a, 0x5A, shared_bytes);
            CHECK(((unsigned char *)b)[shared_bytes - 1] == 0x5A && ((unsigned char *)b)[0] == 0x5A);
        }
        he_host_free(a, shared_bytes);
        he_host_free(b, shared_bytes);
        close(fd);
        void *none = (void *)&none;
        CHECK_ST(he_host_map_shared(fd, shared_bytes, &none), HE_ERR_NOMEM);
        CHECK(none == NULL);
        CHECK_MSG("shared memory");
    }

    set_threads(1);
    group_end("host_memory");
}

/* ------------------------------------------------------------------------ */
/* Thread pool                                                              */

typedef struct cover_ctx {
    atomic_int *hits; /* [n]: how often each index was handed out */
    int64_t n, grain;
    atomic_int bad_range;   /* a call with begin/end outside [0, n) or empty */
    atomic_int short_chunk; /* a chunk below grain that is not the last one */
} cover_ctx;

static void cover_init(cover_ctx *c, int64_t n, int64_t grain)
{
    c->hits = xmalloc((size_t)(n > 0 ? n : 1) * sizeof *c->hits);
    for (int64_t i = 0; i < n; i++)
        atomic_init(&c->hits[i], 0);
    c->n = n;
    c->grain = grain;
    atomic_init(&c->bad_range, 0);
    atomic_init(&c->short_chunk, 0);
}

static void cover_fn(void *ctx, int64_t begin, int64_t end)
{
    cover_ctx *c = ctx;
    if (begin < 0 || end > c->n || begin >= end) {
        atomic_fetch_add(&c->bad_range, 1);
        return;
    }
    if (end - begin < c->grain && end != c->n)
        atomic_fetch_add(&c->short_chunk, 1);
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&c->hits[i], 1);
}

/* Every index hit exactly once; returns the first index that was not. */
static int64_t cover_first_wrong(const cover_ctx *c)
{
    for (int64_t i = 0; i < c->n; i++)
        if (atomic_load(&c->hits[i]) != 1)
            return i;
    return -1;
}

/* Nested parallel_for from inside a job: must neither deadlock nor lose
 * work (the inner call runs on the calling thread). */
#define NEST_OUTER 64
#define NEST_INNER 100

typedef struct nest_ctx {
    cover_ctx inner[NEST_OUTER];
} nest_ctx;

static void nest_fn(void *ctx, int64_t begin, int64_t end)
{
    nest_ctx *nc = ctx;
    for (int64_t i = begin; i < end; i++)
        he_parallel_for(NEST_INNER, 1, cover_fn, &nc->inner[i]);
}

/* Several threads of the program calling the pool at once, as two Python
 * threads with the GIL released would. */
typedef struct caller_arg {
    int rounds_ok;
} caller_arg;

static void *concurrent_caller(void *arg)
{
    caller_arg *a = arg;
    a->rounds_ok = 0;
    for (int r = 0; r < 20; r++) {
        cover_ctx c;
        cover_init(&c, 10000, 1);
        if (he_parallel_for(c.n, 1, cover_fn, &c) == HE_OK && cover_first_wrong(&c) < 0 &&
            atomic_load(&c.bad_range) == 0)
            a->rounds_ok++;
        free(c.hits);
    }
    return NULL;
}

static void test_thread_pool(void)
{
    group_begin();
    int before = he_get_num_threads();
    CHECK(before >= 1);
    CHECK_ST(he_set_num_threads(0), HE_ERR_VALUE);
    CHECK_MSG("got 0");
    CHECK_ST(he_set_num_threads(-3), HE_ERR_VALUE);
    CHECK_ST(he_set_num_threads(1 << 20), HE_ERR_VALUE);
    CHECK(he_get_num_threads() == before); /* a refused value changes nothing */

    static const int threads[] = {1, 2, 3, 8};
    static const int64_t sizes[] = {0, 1, 7, 100000};
    static const int64_t grains[] = {1, 1000};
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        set_threads(threads[t]);
        CHECK(he_get_num_threads() == threads[t]);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            for (size_t g = 0; g < sizeof grains / sizeof *grains; g++) {
                cover_ctx c;
                cover_init(&c, sizes[s], grains[g]);
                CHECK_ST(he_parallel_for(c.n, c.grain, cover_fn, &c), HE_OK);
                int64_t wrong = cover_first_wrong(&c);
                CHECKF(wrong < 0, "threads %d n %" PRId64 " grain %" PRId64 ": index %" PRId64 " hit %d times",
                       threads[t], c.n, c.grain, wrong, wrong < 0 ? 1 : atomic_load(&c.hits[wrong]));
                CHECKF(atomic_load(&c.bad_range) == 0, "threads %d n %" PRId64 " grain %" PRId64, threads[t], c.n,
                       c.grain);
                CHECKF(atomic_load(&c.short_chunk) == 0, "threads %d n %" PRId64 " grain %" PRId64, threads[t],
                       c.n, c.grain);
                free(c.hits);
            }
        }
        /* grain < 1 is treated as 1. */
        cover_ctx c;
        cover_init(&c, 1000, 0);
        CHECK_ST(he_parallel_for(c.n, 0, cover_fn, &c), HE_OK);
        CHECK(cover_first_wrong(&c) < 0);
        free(c.hits);
    }

    /* Nested calls. */
    set_threads(8);
    nest_ctx *nc = xmalloc(sizeof *nc);
    for (int i = 0; i < NEST_OUTER; i++)
        cover_init(&nc->inner[i], NEST_INNER, 1);
    CHECK_ST(he_parallel_for(NEST_OUTER, 1, nest_fn, nc), HE_OK);
    int nested_ok = 1;
    for (int i = 0; i < NEST_OUTER; i++) {
        nested_ok &= cover_first_wrong(&nc->inner[i]) < 0 && atomic_load(&nc->inner[i].bad_range) == 0;
        free(nc->inner[i].hits);
    }
    CHECK(nested_ok);
    free(nc);

    /* Concurrent callers. */
    enum { CALLERS = 4 };
    pthread_t callers[CALLERS];
    caller_arg args[CALLERS];
    for (int i = 0; i < CALLERS; i++)
        CHECK(pthread_create(&callers[i], NULL, concurrent_caller, &args[i]) == 0);
    for (int i = 0; i < CALLERS; i++) {
        pthread_join(callers[i], NULL);
        CHECKF(args[i].rounds_ok == 20, "caller %d: %d of 20 rounds right", i, args[i].rounds_ok);
    }

    /* After fork the child has none of the parent's workers; the pool must
     * notice and start new ones rather than wait on threads that are gone
     * (DataLoader workers fork). The parent's workers are running here.
     * ThreadSanitizer cannot start threads in the child of a multi-threaded
     * process, so a TSan build leaves this part out. */
#if !defined(TEST_UNDER_TSAN)
    set_threads(4);
    {
        cover_ctx warm;
        cover_init(&warm, 10000, 1);
        CHECK_ST(he_parallel_for(warm.n, 1, cover_fn, &warm), HE_OK);
        free(warm.hits);
    }
    fflush(NULL); /* or the child would print the parent's buffered output too */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        cover_ctx c;
        cover_init(&c, 100000, 1);
        int ok = he_parallel_for(c.n, 1, cover_fn, &c) == HE_OK && cover_first_wrong(&c) < 0 &&
                 he_get_num_threads() == 4;
        free(c.hits);
        /* Join the child's workers so that a leak checker that also follows
         * the child (valgrind does) finds nothing live; _exit then skips the
         * atexit handlers (the leak check belongs to the parent). */
        ok &= he_set_num_threads(1) == HE_OK;
        _exit(ok ? 0 : 1);
    }
    if (child > 0) {
        int status = 0;
        /* Bounded wait: a child stuck on the parent's threads must fail the
         * check, not hang the run. */
        pid_t done = 0;
        for (int i = 0; i < 3000 && done == 0; i++) {
            done = waitpid(child, &status, WNOHANG);
            if (done == 0)
                nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
        }
        if (done == 0) {
            kill(child, SIGKILL);
            waitpid(child, &status, 0);
        }
        CHECKF(done == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
               "forked child: %s, status 0x%x", done == 0 ? "hung (killed after 30 s)" : "finished", status);
    }
#endif

    set_threads(1);
    group_end("thread_pool");
}

/* ------------------------------------------------------------------------ */
/* Dedup                                                                    */

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* A batch held in both layouts so each case runs for int32 and int64. */
typedef struct batch {
    int64_t *ids64;
    int32_t *ids32; /* NULL where an id does not fit */
    int64_t n;
} batch;

static batch batch_new(int64_t n)
{
    batch b = {xmalloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)), NULL, n};
    return b;
}

/* Call after filling ids64. */
static void batch_finish(batch *b)
{
    int fits = 1;
    for (int64_t i = 0; i < b->n; i++)
        fits &= b->ids64[i] >= INT32_MIN && b->ids64[i] <= INT32_MAX;
    if (fits) {
        b->ids32 = xmalloc((size_t)(b->n > 0 ? b->n : 1) * sizeof(int32_t));
        for (int64_t i = 0; i < b->n; i++)
            b->ids32[i] = (int32_t)b->ids64[i];
    }
}

static void batch_free(batch *b)
{
    free(b->ids64);
    free(b->ids32);
}

static he_ids batch_ids(const batch *b, int is_int64)
{
    he_ids ids = {is_int64 ? (const void *)b->ids64 : (const void *)b->ids32, b->n, is_int64};
    return ids;
}

/* Checks d against a sort of the ids done here. On failure writes why. */
static int dedup_matches(const batch *b, int64_t num_rows, const he_dedup *d, char *why, size_t why_len)
{
    int64_t n = b->n;
    if (d->count != n) {
        snprintf(why, why_len, "count %" PRId64 ", want %" PRId64, d->count, n);
        return 0;
    }
    int64_t *sorted = xdup(b->ids64, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_i64);
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || sorted[i] != sorted[i - 1])
            sorted[u++] = sorted[i]; /* distinct ids, ascending, in place */
    int ok = 0;
    unsigned char *seen = calloc((size_t)(n > 0 ? n : 1), 1);
    if (!seen)
        exit(2);
    if (d->num_unique != u) {
        snprintf(why, why_len, "num_unique %" PRId64 ", want %" PRId64, d->num_unique, u);
        goto out;
    }
    if (d->offsets[0] != 0 || d->offsets[u] != n) {
        snprintf(why, why_len, "offsets run from %" PRId64 " to %" PRId64, d->offsets[0], d->offsets[u]);
        goto out;
    }
    for (int64_t k = 0; k < u; k++) {
        if (d->unique[k] != sorted[k] || d->unique[k] < 0 || d->unique[k] >= num_rows) {
            snprintf(why, why_len, "unique[%" PRId64 "] = %" PRId64 ", want %" PRId64, k, d->unique[k], sorted[k]);
            goto out;
        }
        if (d->offsets[k + 1] <= d->offsets[k]) {
            snprintf(why, why_len, "offsets[%" PRId64 "..] not increasing", k);
            goto out;
        }
        for (int64_t i = d->offsets[k]; i < d->offsets[k + 1]; i++) {
            uint32_t p = d->order[i];
            if ((int64_t)p >= n || seen[p] || b->ids64[p] != d->unique[k] ||
                (i > d->offsets[k] && p <= d->order[i - 1])) {
                snprintf(why, why_len, "order[%" PRId64 "] = %" PRIu32 " wrong for id %" PRId64, i, p,
                         d->unique[k]);
                goto out;
            }
            seen[p] = 1;
        }
    }
    /* offsets[u] == n and every position seen at most once: a permutation. */
    ok = 1;
out:
    free(seen);
    free(sorted);
    return ok;
}

/* Builds the dedup of b for each id width that holds it and checks it. */
static void check_dedup_case(const char *label, const batch *b, int64_t num_rows)
{
    for (int is_int64 = 1; is_int64 >= 0; is_int64--) {
        if (!is_int64 && !b->ids32)
            continue;
        he_ids ids = batch_ids(b, is_int64);
        he_dedup *d = NULL;
        he_status st = he_dedup_build(&ids, num_rows, &d);
        CHECKF(st == HE_OK && d != NULL, "%s (int%d): status %d: %s", label, is_int64 ? 64 : 32, (int)st,
               he_last_error());
        if (st == HE_OK && d) {
            char why[200] = "";
            CHECKF(dedup_matches(b, num_rows, d, why, sizeof why), "%s (int%d): %s", label, is_int64 ? 64 : 32,
                   why);
        }
        he_dedup_free(d);
    }
}

/* A bad id is refused with a message naming it, its position and num_rows. */
static void check_dedup_refuses(const char *label, const batch *b, int64_t num_rows, int64_t bad_pos)
{
    char want_id[64], want_rows[64];
    snprintf(want_id, sizeof want_id, "id %" PRId64 " at position %" PRId64 " ", b->ids64[bad_pos], bad_pos);
    snprintf(want_rows, sizeof want_rows, "[0, %" PRId64 ")", num_rows);
    for (int is_int64 = 1; is_int64 >= 0; is_int64--) {
        if (!is_int64 && !b->ids32)
            continue;
        he_ids ids = batch_ids(b, is_int64);
        he_dedup *d = (he_dedup *)&d; /* must be reset to NULL */
        he_status st = he_dedup_build(&ids, num_rows, &d);
        CHECKF(st == HE_ERR_INDEX, "%s (int%d): status %d", label, is_int64 ? 64 : 32, (int)st);
        CHECKF(d == NULL, "%s", label);
        CHECK_MSG(want_id);
        CHECK_MSG(want_rows);
        if (st == HE_OK)
            he_dedup_free(d);
    }
}

static void test_dedup(void)
{
    group_begin();
    char label[96];

    /* Empty batch, with the NULL data pointer torch may hand over for it. */
    {
        for (int is_int64 = 0; is_int64 <= 1; is_int64++) {
            he_ids ids = {NULL, 0, is_int64};
            he_dedup *d = NULL;
            CHECK_ST(he_dedup_build(&ids, 10, &d), HE_OK);
            CHECK(d && d->count == 0 && d->num_unique == 0 && d->offsets[0] == 0);
            he_dedup_free(d);
        }
        he_dedup_free(NULL); /* a no-op */
    }

    /* num_rows = 1 (a key of 0 bits: no radix pass at all). */
    {
        batch b = batch_new(17);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = 0;
        batch_finish(&b);
        check_dedup_case("num_rows 1", &b, 1);
        batch_free(&b);
    }

    /* One id repeated, and a single id. */
    {
        batch b = batch_new(1000);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = 5;
        batch_finish(&b);
        check_dedup_case("all same", &b, 10);
        batch_free(&b);
        b = batch_new(1);
        b.ids64[0] = 9;
        batch_finish(&b);
        check_dedup_case("single max id", &b, 10);
        batch_free(&b);
    }

    /* Random batches with many duplicates, always including 0 and
     * num_rows - 1. The sizes give 1, 2, 3, 4 and 6 radix passes of 11 bits,
     * so the sorted positions end in either buffer; 2049 and 2^22 + 1 need
     * one key bit more than a whole number of passes (12 and 23 bits), so a
     * pass count one short would leave the top bit unsorted. */
    static const int64_t rows[] = {
        100, 2049, 2000000, (1 << 22) + 1, (int64_t)INT32_MAX + 1, 3000000000LL, 1LL << 40, INT64_MAX,
    };
    static const int64_t sizes[] = {5000, 20000};
    for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            batch b = batch_new(sizes[s]);
            /* Draw from a pool smaller than the batch so ids repeat. */
            int64_t pool_n = sizes[s] / 4;
            int64_t *pool = xmalloc((size_t)pool_n * sizeof *pool);
            for (int64_t i = 0; i < pool_n; i++)
                pool[i] = rng_below((uint64_t)rows[r]);
            pool[0] = 0;
            pool[1] = rows[r] - 1;
            for (int64_t i = 0; i < b.n; i++)
                b.ids64[i] = pool[rng_below((uint64_t)pool_n)];
            b.ids64[b.n - 1] = rows[r] - 1;
            batch_finish(&b);
            snprintf(label, sizeof label, "random num_rows %" PRId64 " n %" PRId64, rows[r], b.n);
            check_dedup_case(label, &b, rows[r]);
            free(pool);
            batch_free(&b);
        }
    }

    /* Already sorted and reverse sorted input. */
    {
        batch b = batch_new(3000);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = i / 3;
        batch_finish(&b);
        check_dedup_case("sorted", &b, 1000);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = 999 - i / 3;
        free(b.ids32);
        batch_finish(&b);
        check_dedup_case("reversed", &b, 1000);
        batch_free(&b);
    }

    /* Out of range: id == num_rows, id == -1, and the first of several. */
    {
        batch b = batch_new(10);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = i % 7;
        b.ids64[4] = 7;
        batch_finish(&b);
        check_dedup_refuses("id == num_rows", &b, 7, 4);
        batch_free(&b);

        b = batch_new(10);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = i % 7;
        b.ids64[0] = -1;
        batch_finish(&b);
        check_dedup_refuses("id == -1", &b, 7, 0);
        batch_free(&b);

        b = batch_new(10);
        for (int64_t i = 0; i < b.n; i++)
            b.ids64[i] = i % 7;
        b.ids64[3] = -1;
        b.ids64[6] = 7;
        b.ids64[9] = 1000;
        batch_finish(&b);
        check_dedup_refuses("several bad", &b, 7, 3);
        batch_free(&b);

        /* Large num_rows, int64 only. */
        b = batch_new(3);
        b.ids64[0] = 0;
        b.ids64[1] = 3000000000LL;
        b.ids64[2] = 2999999999LL;
        batch_finish(&b);
        check_dedup_refuses("id == 3e9", &b, 3000000000LL, 1);
        batch_free(&b);
    }

    /* A batch too long for the uint32 positions, or of negative length, is
     * refused before the ids are read (so no data is needed). */
    {
        he_ids ids = {NULL, (int64_t)UINT32_MAX + 1, 1};
        he_dedup *d = NULL;
        CHECK_ST(he_dedup_build(&ids, 10, &d), HE_ERR_VALUE);
        CHECK(d == NULL);
        CHECK_MSG("4294967296");
        ids.count = -1;
        CHECK_ST(he_dedup_build(&ids, 10, &d), HE_ERR_VALUE);
        CHECK(d == NULL);
    }
    group_end("dedup");
}

/* ------------------------------------------------------------------------ */
/* Gather                                                                   */

static void test_gather(void)
{
    group_begin();
    const int64_t num_rows = 1000, dim = 37, n = 5000;
    float *table = xmalloc((size_t)(num_rows * dim) * sizeof *table);
    fill_uniform(table, num_rows * dim, -2.0, 2.0);
    /* Values an arithmetic copy could alter; a byte copy keeps them. */
    table[0] = -0.0f;
    table[1] = NAN;
    table[2] = INFINITY;
    table[3] = FLT_TRUE_MIN;
    float *table_copy = xdup(table, (size_t)(num_rows * dim) * sizeof *table);

    batch b = batch_new(n);
    for (int64_t i = 0; i < n; i++)
        b.ids64[i] = rng_below((uint64_t)num_rows);
    b.ids64[0] = 0;
    b.ids64[n - 1] = num_rows - 1;
    batch_finish(&b);

    float *want = xmalloc((size_t)(n * dim) * sizeof *want);
    for (int64_t i = 0; i < n; i++)
        memcpy(want + i * dim, table + b.ids64[i] * dim, (size_t)dim * sizeof *want);
    float *out = xmalloc((size_t)(n * dim) * sizeof *out);

    static const int threads[] = {1, 3, 8};
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        set_threads(threads[t]);
        for (int is_int64 = 0; is_int64 <= 1; is_int64++) {
            he_ids ids = batch_ids(&b, is_int64);
            memset(out, 0xFF, (size_t)(n * dim) * sizeof *out);
            CHECK_ST(gather(table, num_rows, dim, &ids, out), HE_OK);
            CHECKF(memcmp(out, want, (size_t)(n * dim) * sizeof *out) == 0, "threads %d int%d", threads[t],
                   is_int64 ? 64 : 32);
        }
    }
    CHECK(memcmp(table, table_copy, (size_t)(num_rows * dim) * sizeof *table) == 0);

    /* Rows of 64 floats, 16-byte aligned: small outputs stored normally,
     * from HE_GATHER_STREAM_MIN_BYTES (8 MiB) on with streaming stores. */
    {
        const int64_t sdim = 64;
        static const int64_t counts[] = {100, 40000};
        float *stable = xmalloc((size_t)(num_rows * sdim) * sizeof *stable);
        fill_uniform(stable, num_rows * sdim, -2.0, 2.0);
        for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
            int64_t sn = counts[c];
            batch sb = batch_new(sn);
            for (int64_t i = 0; i < sn; i++)
                sb.ids64[i] = rng_below((uint64_t)num_rows);
            batch_finish(&sb);
            float *sout = xmalloc((size_t)(sn * sdim) * sizeof *sout);
            he_ids ids = batch_ids(&sb, 1);
            set_threads(3);
            CHECK_ST(gather(stable, num_rows, sdim, &ids, sout), HE_OK);
            int same = 1;
            for (int64_t i = 0; i < sn && same; i++)
                same = memcmp(sout + i * sdim, stable + sb.ids64[i] * sdim, (size_t)sdim * sizeof *sout) == 0;
            CHECKF(same, "%" PRId64 " rows of 64 floats", sn);
            free(sout);
            batch_free(&sb);
        }
        free(stable);
    }

    /* Empty batch; zero-width rows. */
    {
        he_ids ids = {NULL, 0, 1};
        CHECK_ST(gather(table, num_rows, dim, &ids, out), HE_OK);
        he_ids some = batch_ids(&b, 1);
        CHECK_ST(gather(table, num_rows, 0, &some, out), HE_OK);
    }

    /* Bad ids: many small chunks (dim 4 -> ~1000 rows a chunk), bad ids in
     * several of them, the lowest not in the first chunk; the error must name
     * the lowest position whichever thread finds it first. */
    {
        const int64_t bn = 100000, bdim = 4;
        batch bb = batch_new(bn);
        for (int64_t i = 0; i < bn; i++)
            bb.ids64[i] = rng_below((uint64_t)num_rows);
        bb.ids64[99999] = 123456;
        bb.ids64[70000] = num_rows;
        bb.ids64[40000] = -1;
        bb.ids64[40001] = num_rows;
        batch_finish(&bb);
        float *bout = xmalloc((size_t)(bn * bdim) * sizeof *bout);
        for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
            set_threads(threads[t]);
            for (int is_int64 = 0; is_int64 <= 1; is_int64++) {
                he_ids ids = batch_ids(&bb, is_int64);
                CHECK_ST(gather(table, num_rows, bdim, &ids, bout), HE_ERR_INDEX);
                CHECK_MSG("id -1 at position 40000 ");
                CHECK_MSG("1000 rows");
            }
        }
        /* The bad id at position 0; and at the very end. */
        set_threads(8);
        bb.ids64[0] = num_rows;
        free(bb.ids32);
        batch_finish(&bb);
        for (int is_int64 = 0; is_int64 <= 1; is_int64++) {
            he_ids ids = batch_ids(&bb, is_int64);
            CHECK_ST(gather(table, num_rows, bdim, &ids, bout), HE_ERR_INDEX);
            CHECK_MSG("id 1000 at position 0 ");
        }
        /* Zero-width rows still check the ids. */
        he_ids ids = batch_ids(&bb, 1);
        CHECK_ST(gather(table, num_rows, 0, &ids, bout), HE_ERR_INDEX);
        CHECK_MSG("id 1000 at position 0 ");
        bb.n = 40000; /* only the last id bad now */
        bb.ids64[0] = 0;
        bb.ids64[bb.n - 1] = num_rows;
        ids = batch_ids(&bb, 1);
        CHECK_ST(gather(table, num_rows, bdim, &ids, bout), HE_ERR_INDEX);
        CHECK_MSG("id 1000 at position 39999 ");
        bb.n = bn;
        free(bout);
        batch_free(&bb);
    }
    CHECK(memcmp(table, table_copy, (size_t)(num_rows * dim) * sizeof *table) == 0);

    set_threads(1);
    free(out);
    free(want);
    batch_free(&b);
    free(table_copy);
    free(table);
    group_end("gather");
}

/* ------------------------------------------------------------------------ */
/* Gradient reduction                                                       */

/* Runs he_grad_reduce for one option set on `threads` threads into freshly
 * allocated outputs sized for exactly the rows the contract promises, so an
 * extra row written would be caught by ASan. */
static he_status reduce_once(const he_dedup *d, const float *grad, int64_t dim, he_reduce_opts opts,
                             int64_t want_count, float **values, int64_t **indices, int64_t *count)
{
    *values = xmalloc((size_t)(want_count * dim) * sizeof **values);
    *indices = xmalloc((size_t)want_count * sizeof **indices);
    *count = -7;
    return he_grad_reduce(d, grad, dim, &opts, *values, *indices, count);
}

static void test_grad_reduce(void)
{
    group_begin();
    const int64_t num_rows = 5000, n = 30000, dim = 33;
    batch b = batch_new(n);
    /* Skewed: a few ids very often, most rarely (like a Zipf batch). */
    for (int64_t i = 0; i < n; i++) {
        double r = rng_uniform(0.0, 1.0);
        b.ids64[i] = (int64_t)(r * r * r * (double)num_rows);
    }
    batch_finish(&b);
    float *grad = xmalloc((size_t)(n * dim) * sizeof *grad);
    fill_uniform(grad, n * dim, -1.0, 1.0);

    he_ids ids = batch_ids(&b, 1);
    he_dedup *d = NULL;
    CHECK_ST(he_dedup_build(&ids, num_rows, &d), HE_OK);
    if (!d) {
        group_end("grad_reduce");
        return;
    }
    const int64_t u = d->num_unique;
    /* Enough unique ids for several chunks (grain is 8192/dim + 1). */
    CHECK(u > 4 * (8192 / dim + 1));
    /* An id absent from the batch, for a padding_idx that removes nothing. */
    int64_t absent = -1;
    for (int64_t k = 0; k + 1 < u && absent < 0; k++)
        if (d->unique[k + 1] > d->unique[k] + 1)
            absent = d->unique[k] + 1;
    CHECK(absent >= 0);

    const int64_t paddings[] = {-1, d->unique[0], d->unique[u / 2], d->unique[u - 1], absent};
    double *ref = xmalloc((size_t)(u * dim) * sizeof *ref);
    double *mag = xmalloc((size_t)(u * dim) * sizeof *mag); /* sum of |terms|, for the tolerance */
    for (int scale = 0; scale <= 1; scale++) {
        /* Reference in double, from the batch directly (not from d). */
        memset(ref, 0, (size_t)(u * dim) * sizeof *ref);
        memset(mag, 0, (size_t)(u * dim) * sizeof *mag);
        int64_t *freq = calloc((size_t)num_rows, sizeof *freq);
        int64_t *slot_of = xmalloc((size_t)num_rows * sizeof *slot_of);
        for (int64_t i = 0; i < n; i++)
            freq[b.ids64[i]]++;
        int64_t slots = 0;
        for (int64_t id = 0; id < num_rows; id++)
            slot_of[id] = freq[id] ? slots++ : -1;
        CHECK(slots == u);
        for (int64_t i = 0; i < n; i++) {
            int64_t id = b.ids64[i];
            double f = scale ? 1.0 / (double)freq[id] : 1.0;
            for (int64_t j = 0; j < dim; j++) {
                ref[slot_of[id] * dim + j] += (double)grad[i * dim + j] * f;
                mag[slot_of[id] * dim + j] += fabs((double)grad[i * dim + j] * f);
            }
        }

        for (size_t pi = 0; pi < sizeof paddings / sizeof *paddings; pi++) {
            int64_t pad = paddings[pi];
            int64_t pad_slot = pad >= 0 ? slot_of[pad] : -1;
            int64_t want_count = u - (pad_slot >= 0);
            he_reduce_opts opts = {pad, scale};
            float *first_values = NULL;
            int64_t *first_indices = NULL;
            static const int threads[] = {1, 2, 5};
            for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
                set_threads(threads[t]);
                float *values;
                int64_t *indices, count;
                CHECK_ST(reduce_once(d, grad, dim, opts, want_count, &values, &indices, &count), HE_OK);
                CHECKF(count == want_count, "count %" PRId64 ", want %" PRId64, count, want_count);
                if (count != want_count) {
                    free(values);
                    free(indices);
                    continue;
                }
                if (t == 0) {
                    /* Against the reference: ids ascending with the padding
                     * id left out and the later ones shifted up. */
                    int idx_ok = 1, val_ok = 1;
                    int64_t out = 0;
                    for (int64_t id = 0; id < num_rows; id++) {
                        int64_t s = slot_of[id];
                        if (s < 0 || s == pad_slot)
                            continue;
                        idx_ok &= indices[out] == id;
                        for (int64_t j = 0; j < dim; j++) {
                            double got = values[out * dim + j], want = ref[s * dim + j];
                            /* Recursive float summation errs by at most about
                             * count * eps * sum|terms|; the scaled path adds
                             * one rounding per term. */
                            double tol = 2.0 * (double)freq[id] * FLT_EPSILON * mag[s * dim + j] + 1e-30;
                            if (!(fabs(got - want) <= tol)) {
                                if (val_ok)
                                    fprintf(stderr, "    id %" PRId64 " [%" PRId64 "]: %.9g vs %.9g (tol %.3g)\n",
                                            id, j, got, want, tol);
                                val_ok = 0;
                            }
                        }
                        out++;
                    }
                    CHECKF(idx_ok, "indices, padding %" PRId64 " scale %d", pad, scale);
                    CHECKF(val_ok, "values, padding %" PRId64 " scale %d", pad, scale);
                    first_values = values;
                    first_indices = indices;
                } else {
                    /* Bit for bit the same whatever the thread count. */
                    CHECKF(memcmp(values, first_values, (size_t)(count * dim) * sizeof *values) == 0 &&
                               memcmp(indices, first_indices, (size_t)count * sizeof *indices) == 0,
                           "threads %d differ from 1, padding %" PRId64 " scale %d", threads[t], pad, scale);
                    free(values);
                    free(indices);
                }
            }
            free(first_values);
            free(first_indices);
        }
        free(freq);
        free(slot_of);
    }
    free(ref);
    free(mag);
    he_dedup_free(d);

    /* A single row repeated: scale_grad_by_freq gives the mean. Values are
     * multiples of 1/4 so every sum is exact. */
    {
        int64_t one[4] = {2, 2, 2, 2};
        float g[4 * 2] = {1, 2, 3, 4, 5, 6, 7, 8};
        he_ids oids = {one, 4, 1};
        he_dedup *od = NULL;
        CHECK_ST(he_dedup_build(&oids, 3, &od), HE_OK);
        float v[2];
        int64_t idx, cnt;
        he_reduce_opts mean = {-1, 1}, sum = {-1, 0};
        CHECK_ST(he_grad_reduce(od, g, 2, &mean, v, &idx, &cnt), HE_OK);
        CHECK(cnt == 1 && idx == 2 && v[0] == 4.0f && v[1] == 5.0f);
        CHECK_ST(he_grad_reduce(od, g, 2, &sum, v, &idx, &cnt), HE_OK);
        CHECK(cnt == 1 && idx == 2 && v[0] == 16.0f && v[1] == 20.0f);
        he_reduce_opts pad = {2, 0};
        CHECK_ST(he_grad_reduce(od, g, 2, &pad, v, &idx, &cnt), HE_OK);
        CHECK(cnt == 0);
        he_dedup_free(od);
    }

    /* Empty batch. */
    {
        he_ids none = {NULL, 0, 1};
        he_dedup *ed = NULL;
        CHECK_ST(he_dedup_build(&none, 3, &ed), HE_OK);
        float v[1];
        int64_t idx[1], cnt = -1;
        he_reduce_opts opts = {0, 1};
        CHECK_ST(he_grad_reduce(ed, grad, dim, &opts, v, idx, &cnt), HE_OK);
        CHECK(cnt == 0);
        he_dedup_free(ed);
    }

    set_threads(1);
    free(grad);
    batch_free(&b);
    group_end("grad_reduce");
}

/* ------------------------------------------------------------------------ */
/* Renorm                                                                   */

/* The p-norm in double (p = INFINITY: max |x|). */
static double ref_norm(const float *row, int64_t dim, double p)
{
    double acc = 0.0;
    for (int64_t j = 0; j < dim; j++) {
        double a = fabs((double)row[j]);
        if (isinf(p))
            acc = a > acc ? a : acc;
        else
            acc += pow(a, p);
    }
    return isinf(p) ? acc : pow(acc, 1.0 / p);
}

static void test_renorm(void)
{
    group_begin();
    const int64_t num_rows = 3000, dim = 19, referenced = 2000;
    const double max_norm = 1.5;
    const double ps[] = {1.0, 2.0, 3.0, INFINITY};
    float *table = xmalloc((size_t)(num_rows * dim) * sizeof *table);
    float *before = xmalloc((size_t)(num_rows * dim) * sizeof *before);
    float *first = xmalloc((size_t)(num_rows * dim) * sizeof *first);

    /* Rows 0..referenced-1 appear in the batch (with repeats), the rest
     * never; both kinds get norms well under and well over max_norm, so no
     * row sits at the boundary where rounding would decide. */
    batch b = batch_new(3 * referenced);
    for (int64_t i = 0; i < b.n; i++)
        b.ids64[i] = i < referenced ? i : rng_below((uint64_t)referenced);
    batch_finish(&b);
    he_ids ids = batch_ids(&b, 0);
    he_dedup *d = NULL;
    CHECK_ST(he_dedup_build(&ids, num_rows, &d), HE_OK);
    if (!d) {
        group_end("renorm");
        return;
    }

    for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
        double p = ps[pi];
        int over_count = 0;
        for (int64_t r = 0; r < num_rows; r++) {
            float *row = table + r * dim;
            fill_uniform(row, dim, -1.0, 1.0);
            int over = rng_below(2) == 0;
            over_count += over && r < referenced;
            double target = over ? rng_uniform(1.2, 8.0) * max_norm : rng_uniform(0.1, 0.9) * max_norm;
            double s = target / ref_norm(row, dim, p);
            for (int64_t j = 0; j < dim; j++)
                row[j] = (float)(row[j] * s);
        }
        CHECK(over_count > 100);
        memcpy(before, table, (size_t)(num_rows * dim) * sizeof *table);

        static const int threads[] = {1, 4};
        for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
            set_threads(threads[t]);
            memcpy(table, before, (size_t)(num_rows * dim) * sizeof *table);
            CHECK_ST(renorm(table, num_rows, dim, d, max_norm, p), HE_OK);
            if (t > 0) {
                CHECKF(memcmp(table, first, (size_t)(num_rows * dim) * sizeof *table) == 0,
                       "p %g: threads %d differ from 1", p, threads[t]);
                continue;
            }
            memcpy(first, table, (size_t)(num_rows * dim) * sizeof *table);
            int64_t bad_under = -1, bad_unref = -1, bad_over = -1;
            for (int64_t r = 0; r < num_rows; r++) {
                const float *old = before + r * dim, *now = table + r * dim;
                double old_norm = ref_norm(old, dim, p);
                int same = memcmp(old, now, (size_t)dim * sizeof *now) == 0;
                if (r >= referenced) {
                    if (!same && bad_unref < 0)
                        bad_unref = r;
                } else if (old_norm <= max_norm) {
                    if (!same && bad_under < 0)
                        bad_under = r;
                } else {
                    /* Scaled to max_norm (just under: the core divides by
                     * norm + 1e-7), every element by the same factor. */
                    double new_norm = ref_norm(now, dim, p);
                    double s = max_norm / old_norm;
                    int ok = fabs(new_norm / max_norm - 1.0) <= 1e-5 && new_norm <= max_norm * (1.0 + 4 * FLT_EPSILON);
                    for (int64_t j = 0; j < dim; j++)
                        ok &= fabs((double)now[j] - old[j] * s) <= 4 * FLT_EPSILON * fabs(old[j] * s);
                    if (!ok && bad_over < 0) {
                        bad_over = r;
                        fprintf(stderr, "    p %g row %" PRId64 ": norm %.9g -> %.9g\n", p, r, old_norm, new_norm);
                    }
                }
            }
            CHECKF(bad_under < 0, "p %g: row %" PRId64 " under max_norm was changed", p, bad_under);
            CHECKF(bad_unref < 0, "p %g: unreferenced row %" PRId64 " was changed", p, bad_unref);
            CHECKF(bad_over < 0, "p %g: row %" PRId64 " not scaled to max_norm", p, bad_over);
        }
    }

    /* Bad arguments are refused and change nothing. */
    memcpy(before, table, (size_t)(num_rows * dim) * sizeof *table);
    CHECK_ST(renorm(table, num_rows, dim, d, max_norm, -1.0), HE_ERR_VALUE);
    CHECK_ST(renorm(table, num_rows, dim, d, max_norm, NAN), HE_ERR_VALUE);
    CHECK_ST(renorm(table, num_rows, dim, d, -1.0, 2.0), HE_ERR_VALUE);
    CHECK_ST(renorm(table, num_rows, dim, d, NAN, 2.0), HE_ERR_VALUE);
    CHECK(memcmp(before, table, (size_t)(num_rows * dim) * sizeof *table) == 0);

    set_threads(1);
    he_dedup_free(d);
    batch_free(&b);
    free(first);
    free(before);
    free(table);
    group_end("renorm");
}

/* ------------------------------------------------------------------------ */
/* SparseAdam                                                               */

/* The update as documented in sparse_adam.h, element by element, each
 * operation a separate float rounding (the file is built with
 * -ffp-contract=off). indices must be unique; rows are updated in place. */
static void ref_adam(float *w, float *m, float *v, int64_t dim, const int64_t *indices, const float *values,
                     int64_t nnz, const he_adam_params *hp)
{
    /* Python-float (double) scalars, rounded to float where torch multiplies
     * a float tensor by them. */
    const float one_minus_b1 = (float)(1.0 - hp->beta1);
    const float one_minus_b2 = (float)(1.0 - hp->beta2);
    const float eps = (float)hp->eps;
    const double bias1 = 1.0 - pow(hp->beta1, (double)hp->step);
    const double bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    const float neg_step = (float)-(hp->lr * sqrt(bias2) / bias1);
    for (int64_t k = 0; k < nnz; k++) {
        for (int64_t j = 0; j < dim; j++) {
            int64_t at = indices[k] * dim + j;
            float g = values[k * dim + j];
            if (hp->maximize)
                g = -g;
            float u1 = (g - m[at]) * one_minus_b1;
            float m1 = m[at] + u1;
            float gg = g * g;
            float u2 = (gg - v[at]) * one_minus_b2;
            float v1 = v[at] + u2;
            float denom = sqrtf(v1) + eps;
            float ratio = m1 / denom;
            float delta = ratio * neg_step;
            m[at] = m1;
            v[at] = v1;
            w[at] = w[at] + delta;
        }
    }
}

/* Optimizer state for a table: w, m, v of [rows, dim]. */
typedef struct adam_state {
    float *w, *m, *v;
    int64_t rows, dim;
} adam_state;

static adam_state state_new(int64_t rows, int64_t dim)
{
    size_t bytes = (size_t)(rows * dim) * sizeof(float);
    adam_state s = {xmalloc(bytes), xmalloc(bytes), xmalloc(bytes), rows, dim};
    fill_uniform(s.w, rows * dim, -1.0, 1.0);
    fill_uniform(s.m, rows * dim, -0.1, 0.1);
    fill_uniform(s.v, rows * dim, 0.0, 0.01); /* a second moment is >= 0 */
    return s;
}

static adam_state state_copy(const adam_state *s)
{
    size_t bytes = (size_t)(s->rows * s->dim) * sizeof(float);
    adam_state c = {xdup(s->w, bytes), xdup(s->m, bytes), xdup(s->v, bytes), s->rows, s->dim};
    return c;
}

static int state_equal(const adam_state *a, const adam_state *b)
{
    size_t bytes = (size_t)(a->rows * a->dim) * sizeof(float);
    return memcmp(a->w, b->w, bytes) == 0 && memcmp(a->m, b->m, bytes) == 0 && memcmp(a->v, b->v, bytes) == 0;
}

static void state_free(adam_state *s)
{
    free(s->w);
    free(s->m);
    free(s->v);
}

static he_status core_adam(adam_state *s, const int64_t *indices, const float *values, int64_t nnz,
                           const he_adam_params *hp)
{
    return adam(s->w, s->m, s->v, s->rows, s->dim, indices, values, nnz, hp);
}

/* Coalesces (indices, values): ascending unique ids and, for each, its rows
 * summed in float in ascending position order from 0, as the core documents.
 * Returns the number of unique ids. */
static int64_t presum(const int64_t *indices, const float *values, int64_t nnz, int64_t rows, int64_t dim,
                      int64_t *out_idx, float *out_val)
{
    int64_t u = 0;
    for (int64_t id = 0; id < rows; id++) {
        int found = 0;
        for (int64_t k = 0; k < nnz; k++) {
            if (indices[k] != id)
                continue;
            if (!found) {
                out_idx[u] = id;
                for (int64_t j = 0; j < dim; j++)
                    out_val[u * dim + j] = 0.0f;
                found = 1;
            }
            for (int64_t j = 0; j < dim; j++)
                out_val[u * dim + j] += values[k * dim + j];
        }
        u += found;
    }
    return u;
}

static void test_sparse_adam(void)
{
    group_begin();
    const int64_t rows = 500, dim = 45;
    he_adam_params hp = {1e-2, 0.9, 0.999, 1e-8, 1, 0};

    /* Sorted unique indices (the fast path), several steps so the bias
     * correction changes, both signs, on 1 and 4 threads (grain is
     * 4096/dim + 1 = 92 rows, so 4 threads split the 300 rows). */
    {
        const int64_t nnz = 300;
        int64_t *idx = xmalloc((size_t)nnz * sizeof *idx);
        int64_t at = 0;
        for (int64_t r = 0; r < rows && at < nnz; r++)
            if (rng_below((uint64_t)(rows - r)) < nnz - at) /* sample without replacement */
                idx[at++] = r;
        CHECK(at == nnz && idx[nnz - 1] < rows);
        float *g = xmalloc((size_t)(nnz * dim) * sizeof *g);
        for (int maximize = 0; maximize <= 1; maximize++) {
            for (int threads = 1; threads <= 4; threads += 3) {
                set_threads(threads);
                g_rng = 12345; /* the same data for every thread count */
                adam_state s = state_new(rows, dim), r = state_copy(&s);
                int steps_ok = 1;
                for (int64_t step = 1; step <= 5; step++) {
                    fill_uniform(g, nnz * dim, -1.0, 1.0);
                    hp.step = step;
                    hp.maximize = maximize;
                    CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_OK);
                    ref_adam(r.w, r.m, r.v, dim, idx, g, nnz, &hp);
                    steps_ok &= state_equal(&s, &r);
                }
                CHECKF(steps_ok, "sorted indices, maximize %d, threads %d: not bitwise equal to the reference",
                       maximize, threads);
                state_free(&s);
                state_free(&r);
            }
        }
        hp.maximize = 0;
        free(g);
        free(idx);
    }

    /* Unsorted indices with repeats: the same as updating with the
     * pre-summed rows, both through the core's fast path and the reference. */
    {
        static const int64_t cases[][2] = {{400, 300}, {7, 3}, {50, 500}}; /* nnz, ids drawn from [0, n) */
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            const int64_t nnz = cases[c][0];
            int64_t *idx = xmalloc((size_t)nnz * sizeof *idx);
            for (int64_t k = 0; k < nnz; k++)
                idx[k] = rng_below((uint64_t)cases[c][1]);
            float *g = xmalloc((size_t)(nnz * dim) * sizeof *g);
            fill_uniform(g, nnz * dim, -1.0, 1.0);
            int64_t *sidx = xmalloc((size_t)nnz * sizeof *sidx);
            float *sg = xmalloc((size_t)(nnz * dim) * sizeof *sg);
            int64_t u = presum(idx, g, nnz, rows, dim, sidx, sg);
            for (int threads = 1; threads <= 4; threads += 3) {
                set_threads(threads);
                hp.step = 3;
                adam_state s = state_new(rows, dim), viasum = state_copy(&s), r = state_copy(&s);
                CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_OK);
                CHECK_ST(core_adam(&viasum, sidx, sg, u, &hp), HE_OK);
                ref_adam(r.w, r.m, r.v, dim, sidx, sg, u, &hp);
                CHECKF(state_equal(&s, &viasum), "case %zu threads %d: differs from the pre-summed update", c,
                       threads);
                CHECKF(state_equal(&s, &r), "case %zu threads %d: differs from the reference", c, threads);
                state_free(&s);
                state_free(&viasum);
                state_free(&r);
            }
            free(sg);
            free(sidx);
            free(g);
            free(idx);
        }
        /* Ascending but with an adjacent repeat also has to be summed. */
        int64_t idx[3] = {1, 1, 2};
        float g[3 * 45];
        fill_uniform(g, 3 * dim, -1.0, 1.0);
        int64_t sidx[3];
        float sg[3 * 45];
        int64_t u = presum(idx, g, 3, rows, dim, sidx, sg);
        adam_state s = state_new(rows, dim), r = state_copy(&s);
        CHECK_ST(core_adam(&s, idx, g, 3, &hp), HE_OK);
        ref_adam(r.w, r.m, r.v, dim, sidx, sg, u, &hp);
        CHECK(u == 2 && state_equal(&s, &r));
        state_free(&s);
        state_free(&r);
    }

    /* Refusals change nothing: an index out of range (at the end of a sorted
     * gradient, or in an unsorted one), and step < 1. */
    {
        const int64_t nnz = 20;
        int64_t idx[20];
        float g[20 * 45];
        fill_uniform(g, nnz * dim, -1.0, 1.0);
        adam_state s = state_new(rows, dim), copy = state_copy(&s);
        set_threads(4);
        char want[64];

        for (int64_t k = 0; k < nnz; k++)
            idx[k] = k * 20;
        idx[nnz - 1] = rows; /* still ascending */
        CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_ERR_INDEX);
        snprintf(want, sizeof want, "id %" PRId64 " at position %" PRId64 " ", rows, nnz - 1);
        CHECK_MSG(want);
        CHECK_MSG("[0, 500)");
        CHECK(state_equal(&s, &copy));

        for (int64_t k = 0; k < nnz; k++)
            idx[k] = (k * 37) % rows; /* unsorted */
        idx[5] = idx[6];              /* and a repeat */
        idx[12] = -1;
        CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_ERR_INDEX);
        CHECK_MSG("id -1 at position 12 ");
        CHECK(state_equal(&s, &copy));

        for (int64_t k = 0; k < nnz; k++)
            idx[k] = k;
        hp.step = 0;
        CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_ERR_VALUE);
        CHECK_MSG("got 0");
        hp.step = -4;
        CHECK_ST(core_adam(&s, idx, g, nnz, &hp), HE_ERR_VALUE);
        CHECK(state_equal(&s, &copy));
        hp.step = 1;

        /* An empty gradient is a no-op. */
        CHECK_ST(core_adam(&s, idx, g, 0, &hp), HE_OK);
        CHECK(state_equal(&s, &copy));
        state_free(&s);
        state_free(&copy);
    }
    set_threads(1);
    group_end("sparse_adam");
}

/* Scratch buffers are reused for the same size class, never handed out
 * twice, and dropped by he_scratch_trim. */
/* The fused backward + update against grad_reduce then sparse_adam on
 * copies: the same bits, for rows narrower and wider than its column block
 * (256), padding_idx and scale_grad_by_freq, 1 and 3 threads; and its
 * refusals change nothing. */
static void test_sparse_adam_fused(void)
{
    group_begin();
    const int64_t rows = 200, count = 700;
    const int64_t dims[] = {1, 45, 256, 300, 600};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        int64_t dim = dims[di];
        int64_t *ids = xmalloc((size_t)count * sizeof *ids);
        float *grad = xmalloc((size_t)(count * dim) * sizeof *grad);
        for (int threads = 1; threads <= 3; threads += 2) {
            for (int variant = 0; variant < 3; variant++) {
                set_threads(threads);
                g_rng = 777 + (uint64_t)dim; /* the same data for every thread count */
                for (int64_t i = 0; i < count; i++) /* hot ids repeat often */
                    ids[i] = (int64_t)(rng_below(4) ? rng_below(16) : rng_below((uint64_t)rows));
                fill_uniform(grad, count * dim, -1.0, 1.0);
                he_reduce_opts opts = {variant == 1 ? 5 : -1, variant == 2};
                he_adam_params hp = {1e-2, 0.9, 0.999, 1e-8, 3, variant == 2};
                adam_state s = state_new(rows, dim), r = state_copy(&s);
                he_ids view = {ids, count, 1};
                he_dedup *d = NULL;
                CHECK_ST(he_dedup_build(&view, rows, &d), HE_OK);
                he_table w = he_table_contiguous(s.w, (size_t)(rows * dim) * sizeof(float), rows, dim);
                he_table m = he_table_contiguous(s.m, (size_t)(rows * dim) * sizeof(float), rows, dim);
                he_table v = he_table_contiguous(s.v, (size_t)(rows * dim) * sizeof(float), rows, dim);
                CHECK_ST(he_sparse_adam_fused(d, grad, &opts, &w, &m, &v, &hp), HE_OK);

                float *values = xmalloc((size_t)(d->num_unique * dim) * sizeof *values);
                int64_t *indices = xmalloc((size_t)d->num_unique * sizeof *indices);
                int64_t nnz = 0;
                CHECK_ST(he_grad_reduce(d, grad, dim, &opts, values, indices, &nnz), HE_OK);
                CHECK_ST(core_adam(&r, indices, values, nnz, &hp), HE_OK);
                CHECKF(state_equal(&s, &r), "dim %" PRId64 ", variant %d, threads %d: fused differs from "
                       "grad_reduce + sparse_adam", dim, variant, threads);

                /* Refused before any write: a dedup of another row count, step 0. */
                adam_state before = state_copy(&s);
                he_table w_more = he_table_contiguous(s.w, (size_t)(rows * dim) * sizeof(float), rows - 1, dim);
                he_table m_more = he_table_contiguous(s.m, (size_t)(rows * dim) * sizeof(float), rows - 1, dim);
                he_table v_more = he_table_contiguous(s.v, (size_t)(rows * dim) * sizeof(float), rows - 1, dim);
                CHECK_ST(he_sparse_adam_fused(d, grad, &opts, &w_more, &m_more, &v_more, &hp), HE_ERR_VALUE);
                CHECK_MSG("checked against 200 rows");
                he_adam_params step0 = hp;
                step0.step = 0;
                CHECK_ST(he_sparse_adam_fused(d, grad, &opts, &w, &m, &v, &step0), HE_ERR_VALUE);
                CHECK(state_equal(&s, &before));
                state_free(&before);
                free(values);
                free(indices);
                he_dedup_free(d);
                state_free(&s);
                state_free(&r);
            }
        }
        free(ids);
        free(grad);
    }
    set_threads(1);
    group_end("sparse_adam_fused");
}

/* Every optimizer: the fused backward gives the same bits as grad_reduce
 * then he_sparse_update (row-wise Adagrad, which needs whole rows, also
 * past the reduce's column block), and a bad table changes nothing. */
/* A batch skewed to its first `hot` rows (two ids in three), seeded: ids
 * [count] of a table of `rows`, and gradient rows [count, dim] in (-1, 1). */
static void skewed_batch(uint64_t seed, int64_t count, int64_t rows, uint64_t hot, int64_t dim, int64_t **ids,
                         float **grad)
{
    *ids = xmalloc((size_t)count * sizeof **ids);
    *grad = xmalloc((size_t)(count * dim) * sizeof **grad);
    g_rng = seed;
    for (int64_t i = 0; i < count; i++)
        (*ids)[i] = (int64_t)(rng_below(3) ? rng_below(hot) : rng_below((uint64_t)rows));
    fill_uniform(*grad, count * dim, -1.0, 1.0);
}

/* Two copies (c = 0, 1) of a weight and two state tables of `rows` rows,
 * widths[i] wide, filled with the same draws: one for the path under test,
 * one for its reference. */
static void twin_tables(float *mem[2][3], he_table t[2][3], int64_t rows, const int64_t widths[3])
{
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++) {
            mem[c][i] = xmalloc((size_t)(rows * widths[i]) * sizeof(float));
            g_rng = 5 + (uint64_t)i;
            fill_uniform(mem[c][i], rows * widths[i], i ? 0.0 : -1.0, 1.0);
            t[c][i] = he_table_contiguous(mem[c][i], (size_t)(rows * widths[i]) * sizeof(float), rows, widths[i]);
        }
}

static void free_twin_tables(float *mem[2][3])
{
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++)
            free(mem[c][i]);
}

static void test_sparse_update_every_optimizer(void)
{
    group_begin();
    const int64_t rows = 120, count = 400;
    const int64_t dims[] = {3, 64, 300};
    for (int kind = 0; kind < HE_OPTIM_KINDS; kind++) {
        const he_optim_rule *rule = he_optim_rule_of(kind);
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
            int64_t dim = dims[di], *ids;
            float *grad;
            skewed_batch(99 + (uint64_t)dim, count, rows, 10, dim, &ids, &grad);
            /* weight, then up to two states, twice: fused and reference. */
            float *mem[2][3];
            he_table t[2][3];
            int64_t widths[3] = {dim, rule->per_row[0] ? 1 : dim, rule->per_row[1] ? 1 : dim};
            twin_tables(mem, t, rows, widths);
            he_optim_params hp = {.kind = kind, .lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6,
                                  .lr_decay = 0.01, .step = 2, .maximize = (int)(dim % 2),
                                  .weight_decay = kind == HE_OPTIM_ADAM ? 0.2 : 0.0};
            he_reduce_opts opts = {4, 0};
            he_ids view = {ids, count, 1};
            he_dedup *d = NULL;
            CHECK_ST(he_dedup_build(&view, rows, &d), HE_OK);
            CHECK_ST(he_sparse_update_fused(d, grad, &opts, &hp, &t[0][0], &t[0][1], rule->num_state), HE_OK);
            float *values = xmalloc((size_t)(d->num_unique * dim) * sizeof *values);
            int64_t *indices = xmalloc((size_t)d->num_unique * sizeof *indices), nnz = 0;
            CHECK_ST(he_grad_reduce(d, grad, dim, &opts, values, indices, &nnz), HE_OK);
            CHECK_ST(he_sparse_update(&hp, &t[1][0], &t[1][1], rule->num_state, indices, values, HE_F32, nnz), HE_OK);
            for (int i = 0; i <= rule->num_state; i++)
                CHECKF(memcmp(mem[0][i], mem[1][i], t[0][i].nbytes) == 0,
                       "%s, dim %" PRId64 ": table %d differs between fused and unfused", rule->name, dim, i);
            CHECKF(nnz > 0, "%s: no rows", rule->name);
            /* A miscounted or mis-shaped state is refused before any write. */
            CHECK_ST(he_sparse_update(&hp, &t[1][0], &t[1][1], rule->num_state + 1, indices, values, HE_F32, nnz),
                     HE_ERR_VALUE);
            if (rule->num_state > 0) {
                he_table wrong[2] = {t[1][1], t[1][2]};
                wrong[0].dim = rule->per_row[0] ? dim : 1;
                CHECK_ST(he_sparse_update(&hp, &t[1][0], wrong, rule->num_state, indices, values, HE_F32, nnz),
                         HE_ERR_VALUE);
            }
            for (int i = 0; i <= rule->num_state; i++)
                CHECK(memcmp(mem[0][i], mem[1][i], t[0][i].nbytes) == 0);
            free_twin_tables(mem);
            free(values);
            free(indices);
            free(ids);
            free(grad);
            he_dedup_free(d);
        }
    }
    he_optim_params negative_decay = {.kind = HE_OPTIM_ADAM, .lr = 0.1, .step = 1, .weight_decay = -0.5};
    float w1 = 1.0f, m1 = 0.0f, v1 = 0.0f, g1 = 1.0f;
    int64_t row0 = 0;
    he_table tw = he_table_contiguous(&w1, sizeof w1, 1, 1);
    he_table ts[2] = {he_table_contiguous(&m1, sizeof m1, 1, 1), he_table_contiguous(&v1, sizeof v1, 1, 1)};
    CHECK_ST(he_sparse_update(&negative_decay, &tw, ts, 2, &row0, &g1, HE_F32, 1), HE_ERR_VALUE);
    CHECK_MSG("weight_decay must be >= 0");
    CHECK(w1 == 1.0f && m1 == 0.0f && v1 == 0.0f);
    he_optim_params bad = {.kind = 17};
    he_table none = he_table_contiguous(NULL, 0, 0, 0);
    CHECK_ST(he_sparse_update(&bad, &none, NULL, 0, NULL, NULL, HE_F32, 0), HE_ERR_VALUE);
    CHECK_MSG("unknown optimizer kind 17");
    group_end("sparse_update_every_optimizer");
}

/* A pooled gradient (EmbeddingBag: a row per bag, each position pointing at
 * its bag with a weight) reduces to the same bits as the rows expanded per
 * position in memory, with and without the frequency scale, on 1 and 3
 * threads; the fused update agrees; a bag index out of range is refused
 * before anything is written. */
static void test_grad_reduce_pooled(void)
{
    group_begin();
    const int64_t rows = 300, count = 2000, bags = 150;
    const int64_t dims[] = {7, 300};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        int64_t dim = dims[di];
        g_rng = 41 + (uint64_t)dim;
        int64_t *ids = xmalloc((size_t)count * sizeof *ids), *bag_of = xmalloc((size_t)count * sizeof *bag_of);
        float *weights = xmalloc((size_t)count * sizeof *weights);
        float *grad = xmalloc((size_t)(bags * dim) * sizeof *grad);
        float *expanded = xmalloc((size_t)(count * dim) * sizeof *expanded);
        for (int64_t i = 0; i < count; i++) {
            ids[i] = (int64_t)(rng_below(2) ? rng_below(12) : rng_below((uint64_t)rows));
            bag_of[i] = (int64_t)rng_below((uint64_t)bags);
        }
        fill_uniform(weights, count, -2.0, 2.0);
        fill_uniform(grad, bags * dim, -1.0, 1.0);
        for (int64_t i = 0; i < count; i++)
            for (int64_t j = 0; j < dim; j++)
                expanded[i * dim + j] = grad[bag_of[i] * dim + j] * weights[i];
        he_ids view = {ids, count, 1};
        he_dedup *d = NULL;
        CHECK_ST(he_dedup_build(&view, rows, &d), HE_OK);
        for (int scale = 0; scale < 2; scale++)
            for (int threads = 1; threads <= 3; threads += 2) {
                set_threads(threads);
                he_reduce_opts plain = {5, scale}, pooled = {5, scale, bag_of, weights, bags};
                float *want, *got;
                int64_t *want_idx, *got_idx, want_n, got_n;
                CHECK_ST(reduce_once(d, expanded, dim, plain, d->num_unique, &want, &want_idx, &want_n), HE_OK);
                CHECK_ST(reduce_once(d, grad, dim, pooled, d->num_unique, &got, &got_idx, &got_n), HE_OK);
                CHECKF(got_n == want_n && memcmp(got_idx, want_idx, (size_t)want_n * sizeof *got_idx) == 0 &&
                           memcmp(got, want, (size_t)(want_n * dim) * sizeof *got) == 0,
                       "dim %" PRId64 ", scale %d, %d threads: pooled sums differ from expanded ones", dim, scale,
                       threads);
                free(want);
                free(want_idx);
                free(got);
                free(got_idx);
            }
        /* Fused Adam from the pooled gradient == reduce then update. */
        const he_optim_rule *rule = he_optim_rule_of(HE_OPTIM_ADAM);
        float *mem[2][3];
        he_table t[2][3];
        twin_tables(mem, t, rows, (const int64_t[3]){dim, dim, dim});
        he_optim_params hp = {.kind = HE_OPTIM_ADAM, .lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6,
                              .step = 3};
        he_reduce_opts pooled = {5, 1, bag_of, weights, bags};
        CHECK_ST(he_sparse_update_fused(d, grad, &pooled, &hp, &t[0][0], &t[0][1], rule->num_state), HE_OK);
        float *values = xmalloc((size_t)(d->num_unique * dim) * sizeof *values);
        int64_t *indices = xmalloc((size_t)d->num_unique * sizeof *indices), nnz = 0;
        CHECK_ST(he_grad_reduce(d, grad, dim, &pooled, values, indices, &nnz), HE_OK);
        CHECK_ST(he_sparse_update(&hp, &t[1][0], &t[1][1], rule->num_state, indices, values, HE_F32, nnz), HE_OK);
        for (int i = 0; i < 3; i++)
            CHECKF(memcmp(mem[0][i], mem[1][i], t[0][i].nbytes) == 0,
                   "dim %" PRId64 ": table %d differs between fused and unfused pooled updates", dim, i);
        /* A bag index out of range: refused, nothing written. */
        bag_of[count / 2] = bags;
        float sentinel = values[0];
        CHECK_ST(he_grad_reduce(d, grad, dim, &pooled, values, indices, &nnz), HE_ERR_INDEX);
        CHECK_MSG("is not in [0, 150)");
        CHECK(values[0] == sentinel);
        CHECK_ST(he_sparse_update_fused(d, grad, &pooled, &hp, &t[0][0], &t[0][1], rule->num_state),
                 HE_ERR_INDEX);
        for (int i = 0; i < 3; i++)
            CHECK(memcmp(mem[0][i], mem[1][i], t[0][i].nbytes) == 0);
        free_twin_tables(mem);
        free(values);
        free(indices);
        he_dedup_free(d);
        free(ids);
        free(bag_of);
        free(weights);
        free(grad);
        free(expanded);
    }
    set_threads(1);
    group_end("grad_reduce_pooled");
}

static void test_scratch(void)
{
    group_begin();
    void *a = NULL, *b = NULL, *c = NULL;
    size_t la = 0, lb = 0, lc = 0;
    CHECK_ST(he_scratch_alloc(7000000, &a, &la), HE_OK);
    CHECK(a != NULL && la >= 7000000 && la % 4096 == 0);
    CHECK(la <= 7000000 + 7000000 / 8 + 4096);
    memset(a, 0x5a, la); /* the whole size class is usable */
    CHECK_ST(he_scratch_alloc(7000000, &b, &lb), HE_OK);
    CHECK(b != a); /* a is still in use */
    he_scratch_release(a, la);
    /* A slightly different size in the same class gets a's pages back. */
    CHECK_ST(he_scratch_alloc(7000000 + 1000, &c, &lc), HE_OK);
    CHECK(lc == la && c == a);
    CHECK(((unsigned char *)c)[la - 1] == 0x5a);
    he_scratch_release(b, lb);
    he_scratch_release(c, lc);
    /* More releases than slots: the cache stays bounded and nothing leaks
     * (LeakSanitizer does not see mmap, so count the kept bytes instead). */
    void *many[HE_SCRATCH_SLOTS + 3];
    size_t lens[HE_SCRATCH_SLOTS + 3];
    for (int i = 0; i < HE_SCRATCH_SLOTS + 3; i++)
        CHECK_ST(he_scratch_alloc((size_t)(i + 1) << 16, &many[i], &lens[i]), HE_OK);
    for (int i = 0; i < HE_SCRATCH_SLOTS + 3; i++)
        he_scratch_release(many[i], lens[i]);
    he_scratch_trim();
    CHECK_ST(he_scratch_alloc(7000000, &a, &la), HE_OK);
    CHECK(a != NULL);
    he_scratch_release(a, la);
    he_scratch_trim();
    group_end("scratch");
}

/* Negative sizes: the unsigned range checks would otherwise accept any id. */
static void test_negative_shapes(void)
{
    group_begin();
    int64_t id[1] = {5};
    he_ids ids = {id, 1, 1};
    float table[8] = {0}, out[8] = {0}, m[8] = {0}, v[8] = {0}, g[4] = {1, 1, 1, 1};
    he_dedup *d = NULL;
    he_adam_params hp = {1e-3, 0.9, 0.999, 1e-8, 1, 0};
    CHECK_ST(he_dedup_build(&ids, -1, &d), HE_ERR_VALUE);
    CHECK(d == NULL);
    CHECK_MSG("num_rows >= 0");
    CHECK_ST(gather(table, -1, 4, &ids, out), HE_ERR_VALUE);
    CHECK_ST(gather(table, 2, -4, &ids, out), HE_ERR_VALUE);
    CHECK_ST(adam(table, m, v, -1, 4, id, g, 1, &hp), HE_ERR_VALUE);
    int64_t ok_id[1] = {1};
    he_ids ok = {ok_id, 1, 1};
    CHECK_ST(he_dedup_build(&ok, 2, &d), HE_OK);
    CHECK_ST(renorm(table, -2, 4, d, 1.0, 2.0), HE_ERR_VALUE);
    he_reduce_opts opts = {-1, 0};
    int64_t idx_out[1], count = -7;
    CHECK_ST(he_grad_reduce(d, g, -4, &opts, out, idx_out, &count), HE_ERR_VALUE);
    CHECK(count == -7);
    he_dedup_free(d);
    for (int i = 0; i < 8; i++)
        CHECK(table[i] == 0.0f && m[i] == 0.0f && v[i] == 0.0f);
    group_end("shapes");
}


/* ------------------------------------------------------------------------ */
/* Tables checked against their buffers                                     */

/* The entry points that touch a table check its shape against the bytes
 * they are told it has, before reading or writing anything: a buffer one
 * float short is refused (and ASan would report the read or write past it
 * otherwise: the buffers here are malloc'ed to exactly nbytes). */
static void test_table_bounds(void)
{
    group_begin();
    const int64_t rows = 7, dim = 5;
    const size_t exact = (size_t)(rows * dim) * sizeof(float);
    float *w = xmalloc(exact), *m = xmalloc(exact), *v = xmalloc(exact);
    fill_uniform(w, rows * dim, 1.0, 4.0);
    memset(m, 0, exact);
    memset(v, 0, exact);
    float *w_copy = xdup(w, exact);
    int64_t id64[3] = {6, 0, 6};
    he_ids ids = {id64, 3, 1};
    float out[3 * 5];
    float g[3 * 5];
    fill_uniform(g, 3 * dim, -1.0, 1.0);
    he_adam_params hp = {1e-2, 0.9, 0.999, 1e-8, 1, 0};
    he_dedup *d = NULL;
    CHECK_ST(he_dedup_build(&ids, rows, &d), HE_OK);
    CHECK(d && d->num_rows == rows);

    /* Exactly big enough: fine. */
    he_table t = he_table_contiguous(w, exact, rows, dim);
    CHECK_ST(he_table_check(&t, "table"), HE_OK);
    CHECK_ST(he_gather(&t, &ids, out), HE_OK);
    CHECK(memcmp(out, w + 6 * dim, (size_t)dim * sizeof *out) == 0);

    /* One float short: every entry point refuses, naming the argument and
     * the sizes. */
    he_table short_t = he_table_contiguous(w, exact - sizeof(float), rows, dim);
    CHECK_ST(he_gather(&short_t, &ids, out), HE_ERR_VALUE);
    CHECK_MSG("table: a [7, 5] float32 table (row stride 5) needs 140 bytes, but its buffer has 136");
    CHECK_ST(he_renorm(&short_t, d, 0.1, 2.0), HE_ERR_VALUE);
    he_table tm = he_table_contiguous(m, exact, rows, dim), tv = he_table_contiguous(v, exact, rows, dim);
    he_table short_m = he_table_contiguous(m, exact - 1, rows, dim);
    CHECK_ST(he_sparse_adam(&short_t, &tm, &tv, id64, g, 3, &hp), HE_ERR_VALUE);
    CHECK_MSG("weight: ");
    CHECK_ST(he_sparse_adam(&t, &short_m, &tv, id64, g, 3, &hp), HE_ERR_VALUE);
    CHECK_MSG("exp_avg: ");
    /* More rows than the buffer holds (what a stale num_rows would ask). */
    he_table more_rows = he_table_contiguous(w, exact, rows + 1, dim);
    CHECK_ST(he_gather(&more_rows, &ids, out), HE_ERR_VALUE);
    /* A shape whose byte count overflows 64 bits. */
    he_table huge = he_table_contiguous(w, exact, INT64_MAX, 4);
    CHECK_ST(he_table_check(&huge, "table"), HE_ERR_VALUE);
    CHECK_MSG("needs more than");
    huge = (he_table){w, exact, 2, 1, INT64_MAX};
    CHECK_ST(he_table_check(&huge, "table"), HE_ERR_VALUE);
    /* A row stride shorter than a row; NULL or misaligned rows. */
    he_table overlapping_rows = {w, exact, rows, dim, dim - 1};
    CHECK_ST(he_table_check(&overlapping_rows, "table"), HE_ERR_VALUE);
    CHECK_MSG("shorter than a row");
    he_table null_rows = he_table_contiguous(NULL, exact, rows, dim);
    CHECK_ST(he_table_check(&null_rows, "table"), HE_ERR_VALUE);
    he_table misaligned = he_table_contiguous((float *)((char *)w + 1), exact - 4, 1, 1);
    CHECK_ST(he_table_check(&misaligned, "table"), HE_ERR_VALUE);
    CHECK_MSG("aligned");
    /* Empty tables need no bytes at all. */
    he_table empty = he_table_contiguous(NULL, 0, 0, dim);
    CHECK_ST(he_table_check(&empty, "table"), HE_OK);
    empty = he_table_contiguous(NULL, 0, rows, 0);
    CHECK_ST(he_table_check(&empty, "table"), HE_OK);

    /* A Dedup built for another row count: renorm refuses it. */
    he_table fewer = he_table_contiguous(w, exact, rows - 1, dim);
    CHECK_ST(he_renorm(&fewer, d, 0.1, 2.0), HE_ERR_VALUE);
    CHECK_MSG("checked against a table of 7 rows, the table has 6");

    /* State shaped unlike the weight, or sharing its memory. */
    he_table m_wrong = he_table_contiguous(m, exact, rows, dim - 1);
    CHECK_ST(he_sparse_adam(&t, &m_wrong, &tv, id64, g, 3, &hp), HE_ERR_VALUE);
    CHECK_MSG("exp_avg: a [7, 4] table for a [7, 5] weight");
    CHECK_ST(he_sparse_adam(&t, &t, &tv, id64, g, 3, &hp), HE_ERR_VALUE);
    CHECK_MSG("exp_avg overlaps the weight");
    CHECK_ST(he_sparse_adam(&t, &tm, &tm, id64, g, 3, &hp), HE_ERR_VALUE);
    CHECK_MSG("overlap");
    CHECK_ST(he_sparse_adam(&t, &tm, &tv, id64, g, -1, &hp), HE_ERR_VALUE);
    CHECK(memcmp(w, w_copy, exact) == 0);
    CHECK(all_zero((const unsigned char *)m, exact) && all_zero((const unsigned char *)v, exact));

    /* Strided tables: rows of `dim` floats every `stride` floats, the gaps
     * never read (poisoned with NaN) nor written; the state has a stride of
     * its own. */
    {
        const int64_t stride = 9, ms = 6;
        const size_t sbytes = (size_t)((rows - 1) * stride + dim) * sizeof(float);
        const size_t mbytes = (size_t)((rows - 1) * ms + dim) * sizeof(float);
        float *sw = xmalloc(sbytes), *sm = xmalloc(mbytes), *sv = xmalloc(mbytes);
        for (size_t i = 0; i < sbytes / sizeof(float); i++)
            sw[i] = NAN;
        for (size_t i = 0; i < mbytes / sizeof(float); i++)
            sm[i] = sv[i] = NAN;
        for (int64_t r = 0; r < rows; r++) {
            memcpy(sw + r * stride, w + r * dim, (size_t)dim * sizeof(float));
            memset(sm + r * ms, 0, (size_t)dim * sizeof(float));
            memset(sv + r * ms, 0, (size_t)dim * sizeof(float));
        }
        he_table st_w = {sw, sbytes, rows, dim, stride};
        he_table st_m = {sm, mbytes, rows, dim, ms}, st_v = {sv, mbytes, rows, dim, ms};
        CHECK_ST(he_table_check(&st_w, "table"), HE_OK);
        float sout[3 * 5];
        CHECK_ST(he_gather(&st_w, &ids, sout), HE_OK);
        int gathered_ok = 1;
        for (int k = 0; k < 3; k++)
            gathered_ok &= memcmp(sout + k * dim, w + id64[k] * dim, (size_t)dim * sizeof(float)) == 0;
        CHECK(gathered_ok);
        /* The same update as on the contiguous copy. */
        float *cw = xdup(w, exact), *cm = xdup(m, exact), *cv = xdup(v, exact);
        he_table ct = he_table_contiguous(cw, exact, rows, dim), ctm = he_table_contiguous(cm, exact, rows, dim),
                 ctv = he_table_contiguous(cv, exact, rows, dim);
        CHECK_ST(he_sparse_adam(&ct, &ctm, &ctv, id64, g, 3, &hp), HE_OK);
        CHECK_ST(he_sparse_adam(&st_w, &st_m, &st_v, id64, g, 3, &hp), HE_OK);
        CHECK_ST(he_renorm(&ct, d, 0.5, 3.0), HE_OK);
        CHECK_ST(he_renorm(&st_w, d, 0.5, 3.0), HE_OK);
        int same = 1, gaps = 1;
        for (int64_t r = 0; r < rows; r++) {
            same &= memcmp(sw + r * stride, cw + r * dim, (size_t)dim * sizeof(float)) == 0;
            same &= memcmp(sm + r * ms, cm + r * dim, (size_t)dim * sizeof(float)) == 0;
            same &= memcmp(sv + r * ms, cv + r * dim, (size_t)dim * sizeof(float)) == 0;
            for (int64_t j = dim; j < stride && r + 1 < rows; j++)
                gaps &= isnan(sw[r * stride + j]);
            for (int64_t j = dim; j < ms && r + 1 < rows; j++)
                gaps &= isnan(sm[r * ms + j]) && isnan(sv[r * ms + j]);
        }
        CHECK(same);
        CHECK(gaps);
        free(cw);
        free(cm);
        free(cv);
        free(sw);
        free(sm);
        free(sv);
    }

    he_dedup_free(d);
    free(w_copy);
    free(w);
    free(m);
    free(v);
    group_end("table_bounds");
}

/* ------------------------------------------------------------------------ */
/* Renorm at the edges of the floating-point range                          */

/* The p-norm in long double, scaled by max|x| (the textbook way to keep
 * |x|^p in range). */
static long double ref_norm_scaled(const float *row, int64_t dim, double p)
{
    long double m = 0.0L;
    for (int64_t j = 0; j < dim; j++)
        m = fabsl((long double)row[j]) > m ? fabsl((long double)row[j]) : m;
    if (m == 0.0L || isinf(p))
        return m;
    long double acc = 0.0L;
    for (int64_t j = 0; j < dim; j++)
        acc += powl(fabsl((long double)row[j]) / m, (long double)p);
    return m * powl(acc, 1.0L / (long double)p);
}

/* Rows of huge (1e30..1e38) and tiny (1e-38..1e-30, subnormals too) values
 * for p from 0.5 to 1e9: |x|^p over- or underflows double for most of
 * them, and a row whose norm came out inf would be scaled to 0 (torch's
 * float norm does that at p = 300 for |x| > 1.35). Every row over max_norm
 * must end at max_norm (within float rounding), the others unchanged. */
static void test_renorm_extremes(void)
{
    group_begin();
    const double ps[] = {0.5, 1.0, 2.0, 3.0, 7.5, 300.0, 1e9, INFINITY};
    const int64_t rows = 8, dim = 6;
    float *table = xmalloc((size_t)(rows * dim) * sizeof *table);
    float *before = xmalloc((size_t)(rows * dim) * sizeof *before);
    int64_t all[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    he_ids ids = {all, rows, 1};
    he_dedup *d = NULL;
    CHECK_ST(he_dedup_build(&ids, rows, &d), HE_OK);
    if (!d) {
        group_end("renorm_edges");
        return;
    }
    for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
        double p = ps[pi];
        /* Per row: magnitude scale and max_norm relative to the row's norm. */
        static const double scales[] = {1e38, 1e30, 1.0, 12.0, 1e-30, 1e-38, 1e-44, 3.0};
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < dim; j++)
                table[r * dim + j] = (float)(rng_uniform(0.25, 1.0) * scales[r] * (j % 2 ? -1.0 : 1.0));
        /* Row 7: a single non-zero element (dim 1 in effect). */
        for (int64_t j = 1; j < dim; j++)
            table[7 * dim + j] = 0.0f;
        memcpy(before, table, (size_t)(rows * dim) * sizeof *table);
        for (int under = 0; under <= 1; under++) {
            memcpy(table, before, (size_t)(rows * dim) * sizeof *table);
            /* max_norm: half of the smallest norm (every row over it), or
             * twice the largest (none). Renorm one row at a time, each with
             * its own max_norm, so tiny and huge rows both get tested. */
            int bad = 0;
            for (int64_t r = 0; r < rows; r++) {
                long double norm = ref_norm_scaled(before + r * dim, dim, p);
                double max_norm = (double)(under ? norm * 2.0L : norm / 2.0L);
                if (norm > FLT_MAX)
                    continue; /* see below */
                int64_t one[1] = {r};
                he_ids oid = {one, 1, 1};
                he_dedup *od = NULL;
                CHECK_ST(he_dedup_build(&oid, rows, &od), HE_OK);
                CHECK_ST(renorm(table, rows, dim, od, max_norm, p), HE_OK);
                he_dedup_free(od);
                const float *now = table + r * dim, *old = before + r * dim;
                if (under) {
                    if (memcmp(now, old, (size_t)dim * sizeof *now) != 0) {
                        bad = 1;
                        fprintf(stderr, "    p %g row %" PRId64 ": changed under max_norm\n", p, r);
                    }
                    continue;
                }
                /* Scaled by (float)(max_norm / (norm + 1e-7)), norm rounded
                 * to float: the new norm is max_norm within a few float
                 * roundings; for tiny rows the + 1e-7 dominates the norm
                 * and the factor is correspondingly smaller. */
                long double want = (long double)max_norm * norm / (norm + 1e-7L);
                long double got = ref_norm_scaled(now, dim, p);
                long double tol = 8 * FLT_EPSILON * want + 4 * dim * FLT_TRUE_MIN;
                if (!(fabsl(got - want) <= tol)) {
                    bad = 1;
                    fprintf(stderr, "    p %g row %" PRId64 ": norm %.9Lg, max_norm %.9g -> %.9Lg (want %.9Lg)\n", p,
                            r, norm, max_norm, got, want);
                }
            }
            CHECKF(!bad, "p %g, max_norm %s every norm", p, under ? "above" : "below");
        }
    }
    /* A norm past float's range (p = 1 or 0.5 of 1e38s) rounds to inf, as
     * torch's float norm does, and the row is scaled by max_norm / inf = 0,
     * as torch scales it. */
    {
        float big[4] = {3e38f, -3e38f, 3e38f, 1.0f};
        int64_t zero[1] = {0};
        he_ids zid = {zero, 1, 1};
        he_dedup *zd = NULL;
        CHECK_ST(he_dedup_build(&zid, 1, &zd), HE_OK);
        CHECK_ST(renorm(big, 1, 4, zd, 1e30, 1.0), HE_OK);
        CHECK(big[0] == 0.0f && big[1] == 0.0f && big[3] == 0.0f);
        he_dedup_free(zd);
    }
    /* The reproducer of the bug: a row [12] and a row [-40] at p 300 and
     * 1e9 with max_norm 2 end at exactly 2 and -2, as torch gives. */
    {
        float r3[3] = {1.5f, 12.0f, -40.0f};
        for (int i = 0; i < 2; i++) {
            float t3[3];
            memcpy(t3, r3, sizeof t3);
            int64_t three[3] = {0, 1, 2};
            he_ids tid = {three, 3, 1};
            he_dedup *td = NULL;
            CHECK_ST(he_dedup_build(&tid, 3, &td), HE_OK);
            CHECK_ST(renorm(t3, 3, 1, td, 2.0, i ? 1e9 : 300.0), HE_OK);
            CHECKF(t3[0] == 1.5f && t3[1] == 2.0f && t3[2] == -2.0f, "p %g: %g %g %g", i ? 1e9 : 300.0, t3[0], t3[1],
                   t3[2]);
            he_dedup_free(td);
        }
    }
    /* NaN and inf rows: a NaN norm never renorms, an inf one scales by 0
     * like torch. */
    {
        float t2[2 * 2] = {NAN, 1e30f, INFINITY, 1.0f};
        int64_t two[2] = {0, 1};
        he_ids tid = {two, 2, 1};
        he_dedup *td = NULL;
        CHECK_ST(he_dedup_build(&tid, 2, &td), HE_OK);
        CHECK_ST(renorm(t2, 2, 2, td, 1.0, 300.0), HE_OK);
        CHECK(isnan(t2[0]) && t2[1] == 1e30f);
        CHECK(isnan(t2[2]) && t2[3] == 0.0f); /* inf * 0 */
        he_dedup_free(td);
    }
    he_dedup_free(d);
    free(before);
    free(table);
    group_end("renorm_edges");
}

/* ------------------------------------------------------------------------ */
/* Concurrent callers                                                       */

/* Several program threads call gather, grad_reduce, renorm and SparseAdam
 * on tables of their own and gather from one shared table, all at once,
 * while another thread keeps changing the pool's thread count: what two
 * Python threads with the GIL released (and a third calling
 * set_num_threads) do. Each worker's results must equal, bit for bit, the
 * same calls made serially beforehand (the core's results never depend on
 * the thread count). Run under ThreadSanitizer by test_core_sanitized.py. */
#define CC_WORKERS 4
#define CC_ROUNDS 12
#define CC_ROWS 300
#define CC_DIM 24
#define CC_BATCH 700

typedef struct cc_worker {
    int id;
    const float *shared; /* [CC_ROWS, CC_DIM], read by everyone */
    float *w, *m, *v;    /* the worker's own table and state */
    int64_t ids[CC_ROUNDS][CC_BATCH];
    float grad[CC_BATCH * CC_DIM];
    /* Outputs: the last round's gather of the shared table, every round's
     * reduced gradient sum (a checksum), and the final table. */
    float shared_out[CC_BATCH * CC_DIM];
    double grad_sum[CC_ROUNDS];
    int64_t grad_rows[CC_ROUNDS];
    int failures;
    char why[200];
} cc_worker;

static atomic_int cc_stop;

static void cc_fail(cc_worker *c, const char *what)
{
    if (!c->failures++)
        snprintf(c->why, sizeof c->why, "%s: %s", what, he_last_error());
}

static void cc_run(cc_worker *c)
{
    he_table shared = he_table_contiguous((float *)c->shared, sizeof(float) * CC_ROWS * CC_DIM, CC_ROWS, CC_DIM);
    he_table w = tab(c->w, CC_ROWS, CC_DIM), m = tab(c->m, CC_ROWS, CC_DIM), v = tab(c->v, CC_ROWS, CC_DIM);
    float *out = xmalloc(sizeof(float) * CC_BATCH * CC_DIM);
    float *values = xmalloc(sizeof(float) * CC_BATCH * CC_DIM);
    int64_t *indices = xmalloc(sizeof(int64_t) * CC_BATCH);
    for (int r = 0; r < CC_ROUNDS; r++) {
        he_ids ids = {c->ids[r], CC_BATCH, 1};
        if (he_gather(&shared, &ids, c->shared_out) != HE_OK)
            cc_fail(c, "gather shared");
        he_dedup *d = NULL;
        if (he_dedup_build(&ids, CC_ROWS, &d) != HE_OK) {
            cc_fail(c, "dedup");
            continue;
        }
        if (he_renorm(&w, d, 3.0, r % 2 ? 2.0 : 300.0) != HE_OK)
            cc_fail(c, "renorm");
        if (he_gather(&w, &ids, out) != HE_OK)
            cc_fail(c, "gather own");
        he_reduce_opts opts = {c->id, r % 3 == 0};
        int64_t count = 0;
        if (he_grad_reduce(d, c->grad, CC_DIM, &opts, values, indices, &count) != HE_OK)
            cc_fail(c, "grad_reduce");
        double sum = 0.0;
        for (int64_t i = 0; i < count * CC_DIM; i++)
            sum += values[i];
        c->grad_sum[r] = sum;
        c->grad_rows[r] = count;
        he_adam_params hp = {1e-2, 0.9, 0.999, 1e-8, r + 1, r % 2};
        if (he_sparse_adam(&w, &m, &v, indices, values, count, &hp) != HE_OK)
            cc_fail(c, "sparse_adam");
        /* And the unsorted path (dedup inside), with the batch's ids. */
        if (he_sparse_adam(&w, &m, &v, c->ids[r], c->grad, CC_BATCH, &hp) != HE_OK)
            cc_fail(c, "sparse_adam unsorted");
        he_dedup_free(d);
    }
    free(out);
    free(values);
    free(indices);
}

static void *cc_thread(void *arg)
{
    cc_run(arg);
    return NULL;
}

static void *cc_flipper(void *arg)
{
    int *flips = arg;
    static const int counts[] = {1, 3, 2, 5, 4};
    while (!atomic_load(&cc_stop)) {
        he_set_num_threads(counts[*flips % 5]);
        (void)he_get_num_threads();
        ++*flips;
        nanosleep(&(struct timespec){0, 200 * 1000}, NULL);
    }
    return NULL;
}

static cc_worker *cc_new(int id, const float *shared)
{
    cc_worker *c = xmalloc(sizeof *c);
    memset(c, 0, sizeof *c);
    c->id = id;
    c->shared = shared;
    size_t bytes = sizeof(float) * CC_ROWS * CC_DIM;
    c->w = xmalloc(bytes);
    c->m = xmalloc(bytes);
    c->v = xmalloc(bytes);
    fill_uniform(c->w, CC_ROWS * CC_DIM, -3.0, 3.0);
    memset(c->m, 0, bytes);
    memset(c->v, 0, bytes);
    for (int r = 0; r < CC_ROUNDS; r++)
        for (int i = 0; i < CC_BATCH; i++) /* skewed: hot rows repeat */
            c->ids[r][i] = (int64_t)(pow(rng_uniform(0.0, 1.0), 3.0) * CC_ROWS);
    fill_uniform(c->grad, CC_BATCH * CC_DIM, -1.0, 1.0);
    return c;
}

static cc_worker *cc_clone(const cc_worker *src)
{
    cc_worker *c = xdup(src, sizeof *c);
    size_t bytes = sizeof(float) * CC_ROWS * CC_DIM;
    c->w = xdup(src->w, bytes);
    c->m = xdup(src->m, bytes);
    c->v = xdup(src->v, bytes);
    return c;
}

static void cc_free(cc_worker *c)
{
    free(c->w);
    free(c->m);
    free(c->v);
    free(c);
}

static int cc_same(const cc_worker *a, const cc_worker *b)
{
    size_t bytes = sizeof(float) * CC_ROWS * CC_DIM;
    return memcmp(a->w, b->w, bytes) == 0 && memcmp(a->m, b->m, bytes) == 0 && memcmp(a->v, b->v, bytes) == 0 &&
           memcmp(a->shared_out, b->shared_out, sizeof a->shared_out) == 0 &&
           memcmp(a->grad_sum, b->grad_sum, sizeof a->grad_sum) == 0 &&
           memcmp(a->grad_rows, b->grad_rows, sizeof a->grad_rows) == 0;
}

static void test_concurrent_callers(void)
{
    group_begin();
    float *shared = xmalloc(sizeof(float) * CC_ROWS * CC_DIM);
    fill_uniform(shared, CC_ROWS * CC_DIM, -1.0, 1.0);
    for (int attempt = 0; attempt < 2; attempt++) {
        cc_worker *serial[CC_WORKERS], *par[CC_WORKERS];
        for (int i = 0; i < CC_WORKERS; i++) {
            par[i] = cc_new(i, shared);
            serial[i] = cc_clone(par[i]);
        }
        /* The reference: one caller at a time. */
        set_threads(attempt + 1);
        for (int i = 0; i < CC_WORKERS; i++)
            cc_run(serial[i]);

        set_threads(3);
        atomic_store(&cc_stop, 0);
        int flips = 0;
        pthread_t flipper, workers[CC_WORKERS];
        CHECK(pthread_create(&flipper, NULL, cc_flipper, &flips) == 0);
        for (int i = 0; i < CC_WORKERS; i++)
            CHECK(pthread_create(&workers[i], NULL, cc_thread, par[i]) == 0);
        for (int i = 0; i < CC_WORKERS; i++)
            pthread_join(workers[i], NULL);
        atomic_store(&cc_stop, 1);
        pthread_join(flipper, NULL);
        CHECK(flips > 0);
        for (int i = 0; i < CC_WORKERS; i++) {
            CHECKF(par[i]->failures == 0, "worker %d: %d failures, first %s", i, par[i]->failures, par[i]->why);
            CHECKF(cc_same(par[i], serial[i]), "worker %d (attempt %d): results differ from the serial run", i,
                   attempt);
            cc_free(par[i]);
            cc_free(serial[i]);
        }
    }
    free(shared);
    set_threads(1);
    group_end("concurrency");
}


/* ---- dtypes */

static float half_value(int dtype, uint16_t h)
{
    float f;
    he_row_to_f32(dtype, &h, &f, 1);
    return f;
}

static uint16_t half_of(int dtype, float f)
{
    uint16_t h;
    he_row_from_f32(dtype, &f, &h, 1, 0, 0, 0, 0);
    return h;
}

static int is_nan_half(int dtype, uint16_t h)
{
    return dtype == HE_F16 ? (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) : (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu);
}

/* Every half value of both types: it round-trips; the float32 values
 * between it and the next one up round to the nearer, ties to the even
 * one; past the largest finite value, to inf at the midpoint. Stochastic
 * rounding only ever gives one of the two neighbours, and is unbiased. */
static void test_convert(void)
{
    group_begin();
    const int types[2] = {HE_F16, HE_BF16};
    for (int t = 0; t < 2; t++) {
        int dt = types[t];
        long bad = 0;
        for (uint32_t h = 0; h < 0x10000u; h++) {
            if (is_nan_half(dt, (uint16_t)h)) {
                bad += !isnan(half_value(dt, (uint16_t)h)) || !is_nan_half(dt, half_of(dt, half_value(dt, (uint16_t)h)));
                continue;
            }
            float lo = half_value(dt, (uint16_t)h);
            bad += half_of(dt, lo) != h;
            uint16_t next = (uint16_t)(h + 1);
            if ((h & 0x7FFFu) == 0x7FFFu || is_nan_half(dt, next) || isinf(lo))
                continue;
            float hi = half_value(dt, next); /* one ulp further from zero */
            if (isinf(hi))
                continue; /* past the largest finite value: checked below */
            float mid = (float)(((double)lo + (double)hi) / 2); /* exact: a half has <= 11 bits */
            uint16_t even = (h & 1u) ? next : (uint16_t)h;
            bad += half_of(dt, mid) != even;
            bad += half_of(dt, nextafterf(mid, lo)) != h;
            bad += half_of(dt, nextafterf(mid, hi)) != next;
        }
        CHECKF(bad == 0, "%s: %ld conversions off", he_dtype_name(dt), bad);
    }
    /* Whole rows go the vector way (F16C for float16 where the CPU has
     * it), one element the scalar one: the same bits for every half, and
     * for the float32 values at and around every midpoint. */
    for (int t = 0; t < 2; t++) {
        int dt = types[t];
        int64_t n = 0x10000, bad = 0;
        uint16_t *all = xmalloc((size_t)n * sizeof *all), *narrow = xmalloc((size_t)(4 * n) * sizeof *narrow);
        float *wide = xmalloc((size_t)n * sizeof *wide), *around = xmalloc((size_t)(4 * n) * sizeof *around);
        for (int64_t h = 0; h < n; h++)
            all[h] = (uint16_t)h;
        he_row_to_f32(dt, all, wide, n);
        for (int64_t h = 0; h < n; h++) {
            float one = half_value(dt, (uint16_t)h);
            bad += memcmp(&one, &wide[h], sizeof one) != 0;
            float next = half_value(dt, (uint16_t)(h + 1));
            float mid = (isfinite(one) && isfinite(next)) ? (float)(((double)one + (double)next) / 2) : one;
            around[4 * h] = one;
            around[4 * h + 1] = mid;
            around[4 * h + 2] = nextafterf(mid, -INFINITY);
            around[4 * h + 3] = nextafterf(mid, INFINITY);
        }
        he_row_from_f32(dt, around, narrow, 4 * n, 0, 0, 0, 0);
        for (int64_t i = 0; i < 4 * n; i++)
            bad += narrow[i] != half_of(dt, around[i]);
        CHECKF(bad == 0, "%s: %" PRId64 " row conversions differ from element ones", he_dtype_name(dt), bad);
        free(all);
        free(narrow);
        free(wide);
        free(around);
    }
    CHECK(half_of(HE_F16, 65519.99f) == 0x7BFFu && half_of(HE_F16, 65520.0f) == 0x7C00u);
    CHECK(half_of(HE_F16, -65520.0f) == 0xFC00u && half_of(HE_F16, INFINITY) == 0x7C00u);
    CHECK(half_of(HE_F16, 0x1p-25f) == 0 && half_of(HE_F16, nextafterf(0x1p-25f, 1.0f)) == 1);
    CHECK(half_of(HE_BF16, 3.4e38f) == 0x7F80u && half_of(HE_BF16, NAN) == 0x7FC0u);
    /* Stochastic: x a quarter of the way from lo to hi rounds up a quarter
     * of the time (within 5 standard deviations over 40,000 draws). */
    for (int t = 0; t < 2; t++) {
        int dt = types[t];
        float lo = 1.0f, hi = half_value(dt, (uint16_t)(half_of(dt, 1.0f) + 1));
        float x[200], got[200];
        uint16_t h[200];
        for (int j = 0; j < 200; j++)
            x[j] = lo + (hi - lo) * 0.25f;
        long up = 0, other = 0;
        for (int64_t row = 0; row < 200; row++) {
            he_row_from_f32(dt, x, h, 200, 1, 1234, row, 0);
            he_row_to_f32(dt, h, got, 200);
            for (int j = 0; j < 200; j++) {
                up += got[j] == hi;
                other += got[j] != hi && got[j] != lo;
            }
        }
        CHECKF(other == 0 && fabs((double)up - 10000.0) < 5 * sqrt(40000 * 0.25 * 0.75),
               "%s: %ld of 40000 rounded up (10000 expected), %ld off both neighbours", he_dtype_name(dt), up, other);
        /* The same (seed, row, column) draws the same whatever the block. */
        uint16_t a[200], b[200];
        he_row_from_f32(dt, x, a, 200, 1, 7, 3, 0);
        he_row_from_f32(dt, x, b, 100, 1, 7, 3, 0);
        he_row_from_f32(dt, x + 100, b + 100, 100, 1, 7, 3, 100);
        CHECK(memcmp(a, b, sizeof a) == 0);
    }
    group_end("convert");
}

/* Optimizer updates of float16, bfloat16 and float64 tables: fused and
 * unfused give the same bits; a half table's update is the float32 update
 * of its widened rows (with the gradient rounded to the table's dtype, as
 * weight.grad is) rounded back, with the same float32 state; a half
 * gradient (the output gradient, weight.grad) gives the same bits as its
 * float32 widening, fused and unfused, summed (and rounded) and not; state
 * and gradients of the wrong dtype are refused. */
enum { UPD_FUSED, UPD_UNFUSED, UPD_F32_REF, UPD_FUSED_HALF, UPD_UNFUSED_HALF, UPD_COPIES };

static void test_sparse_update_dtypes(void)
{
    group_begin();
    const int64_t rows = 60, count = 300;
    const int64_t dims[] = {5, 300};
    const int types[3] = {HE_F16, HE_BF16, HE_F64};
    for (int kind = 0; kind < HE_OPTIM_KINDS; kind++) {
        const he_optim_rule *rule = he_optim_rule_of(kind);
        for (int t = 0; t < 3; t++) {
            for (size_t di = 0; di < 2; di++) {
                int dt = types[t], ct = he_compute_dtype(dt), half = ct != dt;
                int64_t dim = dims[di];
                size_t we = he_dtype_size(dt), ce = he_dtype_size(ct);
                int64_t *ids;
                float *grad32;
                skewed_batch(7 + (uint64_t)dim + (uint64_t)t, count, rows, 8, dim, &ids, &grad32);
                uint16_t *grad16 = xmalloc((size_t)(count * dim) * sizeof(uint16_t));
                void *grad = grad32;
                if (ct == HE_F64) {
                    double *g64 = xmalloc((size_t)(count * dim) * sizeof(double));
                    for (int64_t i = 0; i < count * dim; i++)
                        g64[i] = (double)grad32[i] * (1.0 + 1e-9);
                    grad = g64;
                } else {
                    /* A half table's output gradient is half: grad32 is its widening. */
                    he_row_from_f32(dt, grad32, grad16, count * dim, 0, 0, 0, 0);
                    he_row_to_f32(dt, grad16, grad32, count * dim);
                }
                void *w[UPD_COPIES], *s[UPD_COPIES][2];
                he_table tw[UPD_COPIES], ts[UPD_COPIES][2];
                float *w0 = xmalloc((size_t)(rows * dim) * sizeof(float));
                fill_uniform(w0, rows * dim, -1.0, 1.0);
                for (int c = 0; c < UPD_COPIES; c++) {
                    int wdt = c == UPD_F32_REF ? HE_F32 : dt;
                    size_t wbytes = (size_t)(rows * dim) * he_dtype_size(wdt);
                    w[c] = xmalloc(wbytes);
                    for (int64_t r = 0; r < rows; r++) {
                        if (dt == HE_F64 && c != UPD_F32_REF) {
                            for (int64_t j = 0; j < dim; j++)
                                ((double *)w[c])[r * dim + j] = (double)w0[r * dim + j];
                        } else if (c != UPD_F32_REF) {
                            he_row_from_f32(dt, w0 + r * dim, (char *)w[c] + (size_t)(r * dim) * we, dim, 0, 0, 0, 0);
                        } else if (half) {
                            he_round_row_f32(dt, w0 + r * dim, (float *)w[c] + r * dim, dim);
                        }
                    }
                    tw[c] = he_table_typed(w[c], wbytes, rows, dim, wdt);
                    for (int i = 0; i < 2; i++) {
                        int64_t width = rule->per_row[i] ? 1 : dim;
                        size_t bytes = (size_t)(rows * width) * ce;
                        s[c][i] = calloc(1, bytes ? bytes : 1);
                        ts[c][i] = he_table_typed(s[c][i], bytes, rows, width, c == UPD_F32_REF ? HE_F32 : ct);
                    }
                }
                he_optim_params hp = {.kind = kind, .lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6,
                                      .lr_decay = 0.01, .step = 3, .maximize = (int)(dim % 2),
                                      .weight_decay = kind == HE_OPTIM_ADAM ? 0.2 : 0.0};
                he_reduce_opts opts = {4, 0};
                opts.dtype = ct;
                he_ids view = {ids, count, 1};
                he_dedup *d = NULL;
                CHECK_ST(he_dedup_build(&view, rows, &d), HE_OK);
                CHECK_ST(he_sparse_update_fused(d, grad, &opts, &hp, &tw[UPD_FUSED], ts[UPD_FUSED], rule->num_state),
                         HE_OK);
                void *values = xmalloc((size_t)(d->num_unique * dim) * ce);
                int64_t *indices = xmalloc((size_t)d->num_unique * sizeof *indices), nnz = 0;
                CHECK_ST(he_grad_reduce(d, grad, dim, &opts, values, indices, &nnz), HE_OK);
                if (half)
                    he_round_row_f32(dt, values, values, nnz * dim); /* weight.grad is in the table's dtype */
                CHECK_ST(he_sparse_update(&hp, &tw[UPD_UNFUSED], ts[UPD_UNFUSED], rule->num_state, indices, values,
                                          ct, nnz),
                         HE_OK);
                CHECKF(memcmp(w[UPD_FUSED], w[UPD_UNFUSED], tw[0].nbytes) == 0,
                       "%s %s dim %" PRId64 ": fused and unfused differ", rule->name, he_dtype_name(dt), dim);
                for (int i = 0; i < rule->num_state; i++)
                    CHECK(memcmp(s[UPD_FUSED][i], s[UPD_UNFUSED][i], ts[0][i].nbytes) == 0);
                if (half) {
                    CHECK_ST(he_sparse_update(&hp, &tw[UPD_F32_REF], ts[UPD_F32_REF], rule->num_state, indices,
                                              values, HE_F32, nnz),
                             HE_OK);
                    float *widened = xmalloc((size_t)(rows * dim) * sizeof(float));
                    he_row_to_f32(dt, w[UPD_UNFUSED], widened, rows * dim);
                    he_round_row_f32(dt, w[UPD_F32_REF], w[UPD_F32_REF], rows * dim);
                    CHECKF(memcmp(widened, w[UPD_F32_REF], (size_t)(rows * dim) * sizeof(float)) == 0,
                           "%s %s dim %" PRId64 ": not the rounded float32 update", rule->name, he_dtype_name(dt), dim);
                    for (int i = 0; i < rule->num_state; i++)
                        CHECK(memcmp(s[UPD_UNFUSED][i], s[UPD_F32_REF][i], ts[1][i].nbytes) == 0);
                    free(widened);

                    /* The half gradient itself: summed, fused, and as weight.grad. */
                    he_reduce_opts half_opts = opts;
                    half_opts.dtype = dt;
                    float *sums = xmalloc((size_t)(d->num_unique * dim) * sizeof(float));
                    int64_t *sum_rows = xmalloc((size_t)d->num_unique * sizeof *sum_rows), sum_count = 0;
                    CHECK_ST(he_grad_reduce(d, grad16, dim, &half_opts, sums, sum_rows, &sum_count), HE_OK);
                    he_round_row_f32(dt, sums, sums, sum_count * dim);
                    CHECKF(sum_count == nnz && memcmp(sums, values, (size_t)(nnz * dim) * sizeof(float)) == 0 &&
                               memcmp(sum_rows, indices, (size_t)nnz * sizeof *indices) == 0,
                           "%s dim %" PRId64 ": a half gradient's sums are not its widening's", he_dtype_name(dt),
                           dim);
                    /* round_sums writes them rounded, in the half dtype. */
                    half_opts.round_sums = 1;
                    uint16_t *rounded = xmalloc((size_t)(d->num_unique * dim) * sizeof(uint16_t));
                    CHECK_ST(he_grad_reduce(d, grad16, dim, &half_opts, rounded, sum_rows, &sum_count), HE_OK);
                    he_row_to_f32(dt, rounded, sums, sum_count * dim);
                    CHECK(sum_count == nnz && memcmp(sums, values, (size_t)(nnz * dim) * sizeof(float)) == 0);
                    free(rounded); /* (the fused update takes no round_sums: it must not matter) */
                    CHECK_ST(he_sparse_update_fused(d, grad16, &half_opts, &hp, &tw[UPD_FUSED_HALF],
                                                    ts[UPD_FUSED_HALF], rule->num_state),
                             HE_OK);
                    uint16_t *values16 = xmalloc((size_t)(nnz * dim) * sizeof(uint16_t));
                    he_row_from_f32(dt, values, values16, nnz * dim, 0, 0, 0, 0);
                    CHECK_ST(he_sparse_update(&hp, &tw[UPD_UNFUSED_HALF], ts[UPD_UNFUSED_HALF], rule->num_state,
                                              indices, values16, dt, nnz),
                             HE_OK);
                    for (int c = UPD_FUSED_HALF; c <= UPD_UNFUSED_HALF; c++) {
                        CHECKF(memcmp(w[c], w[UPD_UNFUSED], tw[0].nbytes) == 0,
                               "%s %s dim %" PRId64 ": a half gradient (%s) updates otherwise than float32", rule->name,
                               he_dtype_name(dt), dim, c == UPD_FUSED_HALF ? "fused" : "unfused");
                        for (int i = 0; i < rule->num_state; i++)
                            CHECK(memcmp(s[c][i], s[UPD_UNFUSED][i], ts[0][i].nbytes) == 0);
                    }
                    /* A gradient of the other half dtype is refused, nothing written. */
                    int other = dt == HE_F16 ? HE_BF16 : HE_F16;
                    CHECK_ST(he_sparse_update(&hp, &tw[UPD_UNFUSED_HALF], ts[UPD_UNFUSED_HALF], rule->num_state,
                                              indices, values16, other, nnz),
                             HE_ERR_VALUE);
                    CHECK_MSG("must be ");
                    half_opts.dtype = other;
                    CHECK_ST(he_sparse_update_fused(d, grad16, &half_opts, &hp, &tw[UPD_FUSED_HALF],
                                                    ts[UPD_FUSED_HALF], rule->num_state),
                             HE_ERR_VALUE);
                    CHECK(memcmp(w[UPD_FUSED_HALF], w[UPD_UNFUSED], tw[0].nbytes) == 0);
                    free(values16);
                    free(sums);
                    free(sum_rows);
                }
                if (rule->num_state > 0) {
                    he_table wrong[2] = {ts[1][0], ts[1][1]};
                    wrong[0].dtype = ct == HE_F64 ? HE_F32 : HE_F64;
                    CHECK_ST(he_sparse_update(&hp, &tw[1], wrong, rule->num_state, indices, values, ct, nnz),
                             HE_ERR_VALUE);
                    /* (float64 state is twice the buffer of float32: refused for its size first) */
                    if (ct == HE_F64)
                        CHECK_MSG("must be float64, got float32");
                }
                for (int c = 0; c < UPD_COPIES; c++) {
                    free(w[c]);
                    free(s[c][0]);
                    free(s[c][1]);
                }
                if (grad != grad32)
                    free(grad);
                free(grad32);
                free(grad16);
                free(w0);
                free(values);
                free(indices);
                free(ids);
                he_dedup_free(d);
            }
        }
    }
    group_end("sparse_update_dtypes");
}

/* A gather of any dtype copies the rows' bytes. */
static void test_gather_dtypes(void)
{
    group_begin();
    const int types[3] = {HE_F16, HE_BF16, HE_F64};
    for (int t = 0; t < 3; t++) {
        int64_t rows = 50, dim = 7, n = 90;
        size_t e = he_dtype_size(types[t]);
        unsigned char *table = xmalloc((size_t)(rows * dim) * e), *out = xmalloc((size_t)(n * dim) * e);
        for (size_t i = 0; i < (size_t)(rows * dim) * e; i++)
            table[i] = (unsigned char)(i * 31 + 7);
        int64_t ids[90];
        for (int64_t i = 0; i < n; i++)
            ids[i] = (i * 17) % rows;
        he_table tab = he_table_typed(table, (size_t)(rows * dim) * e, rows, dim, types[t]);
        he_ids view = {ids, n, 1};
        CHECK_ST(he_gather(&tab, &view, out), HE_OK);
        for (int64_t i = 0; i < n; i++)
            CHECK(memcmp(out + (size_t)(i * dim) * e, table + (size_t)(ids[i] * dim) * e, (size_t)dim * e) == 0);
        tab.nbytes -= 1;
        CHECK_ST(he_gather(&tab, &view, out), HE_ERR_VALUE);
        CHECK_MSG(he_dtype_name(types[t]));
        free(table);
        free(out);
    }
    he_table odd = he_table_typed(NULL, 0, 0, 0, 9);
    CHECK(he_table_check(&odd, "table") == HE_ERR_VALUE);
    CHECK_MSG("unknown dtype code 9");
    group_end("gather_dtypes");
}

/* ------------------------------------------------------------------------ */

/* The frequency policy on a stream that opens its window (a long tail of
 * rows used once, and rows that come back within three batches; checked
 * when the test was written: the window held up to 30% of the slots),
 * under the sanitizers: every plan keeps the cache's model (evictions of
 * rows held and not in use, also the last batch's, planned ahead; fetches
 * into free slots, ascending; each row where its slot says). Its decisions
 * are checked against the simulator in tests/test_cache_plan_oracles.py. */
static void test_cache_window(void)
{
    group_begin();
    enum { ROWS = 20000, CAPACITY = 200, COUNT = 200, BATCHES = 60 };
    he_cache *c = NULL;
    he_cache_plan plan;
    CHECK_ST(he_cache_new(ROWS, CAPACITY, 2, HE_CACHE_FREQUENCY, &c), HE_OK);
    CHECK_ST(he_cache_plan_init(&plan, COUNT), HE_OK);
    int64_t held[CAPACITY], recent[3][COUNT], unique[COUNT];
    int64_t last_batch[COUNT], num_last = 0, num_recent[3] = {0, 0, 0}, hits = 0;
    uint8_t *in_batch = calloc(ROWS, 1);
    CHECK(in_batch != NULL);
    for (int s = 0; s < CAPACITY; s++)
        held[s] = -1;
    g_rng = 5;
    for (int b = 0; b < BATCHES; b++) {
        int64_t ids[COUNT], n = 0;
        for (int i = 0; i < COUNT; i++) {
            int64_t from = b > 0 ? (int64_t)rng_uniform(0.0, 3.0) : 0;
            ids[i] = i % 2 && num_recent[from] ? recent[from][(int64_t)rng_uniform(0.0, (double)num_recent[from])]
                                               : (int64_t)rng_uniform(0.0, (double)ROWS);
            if (ids[i] >= ROWS)
                ids[i] = ROWS - 1;
        }
        for (int i = 0; i < COUNT; i++)
            in_batch[ids[i]] = 1;
        for (int64_t r = 0; r < ROWS; r++) /* ascending, as a Dedup gives them */
            if (in_batch[r])
                unique[n++] = r;
        CHECK_ST(he_cache_plan_batch(c, unique, n, &plan), HE_OK);
        for (int64_t e = 0; e < plan.num_evict; e++) {
            int32_t s = plan.evict_slot[e];
            CHECK(held[s] == plan.evict_row[e] && !in_batch[plan.evict_row[e]]);
            for (int64_t k = 0; k < num_last; k++)
                CHECK(last_batch[k] != plan.evict_row[e]); /* planned ahead: the last batch's stay */
            held[s] = -1;
        }
        for (int64_t f = 0; f < plan.num_fetch; f++) {
            CHECK(held[plan.fetch_slot[f]] == -1 && (f == 0 || plan.fetch_row[f] > plan.fetch_row[f - 1]));
            held[plan.fetch_slot[f]] = plan.fetch_row[f];
        }
        for (int64_t k = 0; k < n; k++) {
            CHECK(plan.slot[k] < 0 || held[plan.slot[k]] == unique[k]);
            CHECK(he_cache_slot_of(c, unique[k]) == plan.slot[k]);
            hits += plan.slot[k] >= 0;
        }
        for (int64_t r = 0; r < n; r++)
            in_batch[unique[r]] = 0;
        memcpy(recent[b % 3], unique, (size_t)n * sizeof *unique);
        num_recent[b % 3] = n;
        memcpy(last_batch, unique, (size_t)n * sizeof *unique);
        num_last = n;
    }
    he_cache_stats st = he_cache_get_stats(c);
    CHECK(st.hits + st.fetches + st.bypassed == st.rows && st.batches == BATCHES && st.hits > 0);
    CHECK(hits == st.hits + st.fetches);
    free(in_batch);
    he_cache_free(c);
    he_cache_plan_free(&plan);
    group_end("cache_window");
}

/* The cache planner's decisions on small cases: free slots first, hits
 * protected, CLOCK's second chance, admission by recent use (a row used
 * once does not evict one used as often, a row used more does), look-ahead
 * protection and bypass, the fetch of a row the last batch updated in host
 * memory flagged, bad batches refused with nothing changed. */
static void test_cache_plan(void)
{
    group_begin();
    he_cache *c = NULL;
    he_cache_plan plan;
    CHECK_ST(he_cache_plan_init(&plan, 8), HE_OK);
    CHECK_ST(he_cache_new(10, 4, 1, HE_CACHE_CLOCK, &c), HE_OK);
    int64_t a[] = {1, 2, 3};
    CHECK_ST(he_cache_plan_batch(c, a, 3, &plan), HE_OK);
    CHECK(plan.num_fetch == 3 && plan.num_evict == 0);
    CHECK(plan.slot[0] == 0 && plan.slot[1] == 1 && plan.slot[2] == 2);
    CHECK(he_cache_slot_of(c, 2) == 1 && he_cache_row_of(c, 2) == 3 && he_cache_slot_of(c, 4) == -1);
    int64_t b[] = {2, 3, 4, 5};
    CHECK_ST(he_cache_plan_batch(c, b, 4, &plan), HE_OK);
    /* 2, 3 hit; 4 takes the free slot; 5's victim would be 1, used as
     * often lately: 5 bypasses. */
    CHECK(plan.slot[0] == 1 && plan.slot[1] == 2 && plan.slot[2] == 3 && plan.slot[3] == -1);
    CHECK(plan.num_fetch == 1 && plan.fetch_row[0] == 4 && plan.num_evict == 0);
    int64_t again[] = {5};
    CHECK_ST(he_cache_plan_batch(c, again, 1, &plan), HE_OK);
    /* Used twice now, 5 evicts 1; the last batch updated it in host memory. */
    CHECK(plan.num_evict == 1 && plan.evict_slot[0] == 0 && plan.evict_row[0] == 1);
    CHECK(plan.num_fetch == 1 && plan.fetch_row[0] == 5 && plan.fetch_slot[0] == 0 && plan.fetch_after_update[0]);
    CHECK(he_cache_slot_of(c, 1) == -1 && he_cache_slot_of(c, 5) == 0);
    he_cache_stats st = he_cache_get_stats(c);
    CHECK(st.batches == 3 && st.rows == 8 && st.hits == 2 && st.fetches == 5 && st.evictions == 1 && st.bypassed == 1);
    /* Refused, nothing changed: out of range, not ascending, too many. */
    int64_t bad_range[] = {3, 10}, bad_order[] = {3, 3}, many[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_ST(he_cache_plan_batch(c, bad_range, 2, &plan), HE_ERR_INDEX);
    CHECK_MSG("row 10 at 1 is not in [0, 10)");
    CHECK_ST(he_cache_plan_batch(c, bad_order, 2, &plan), HE_ERR_VALUE);
    CHECK_MSG("ascending and distinct");
    CHECK_ST(he_cache_plan_batch(c, many, 9, &plan), HE_ERR_VALUE);
    he_cache_stats after = he_cache_get_stats(c);
    CHECK(memcmp(&st, &after, sizeof st) == 0 && he_cache_slot_of(c, 5) == 0 && he_cache_slot_of(c, 3) == 2);
    he_cache_free(c);
    CHECK_ST(he_cache_new(10, 0, 1, HE_CACHE_CLOCK, &c), HE_ERR_VALUE);
    CHECK(c == NULL);
    CHECK_ST(he_cache_new(10, 4, 3, HE_CACHE_CLOCK, &c), HE_ERR_VALUE);

    /* Planned a step ahead (protect 2): the last batch's slots are in use. */
    CHECK_ST(he_cache_new(10, 4, 2, HE_CACHE_CLOCK, &c), HE_OK);
    int64_t first[] = {1, 2, 3, 4}, second[] = {5}, third[] = {5, 6};
    CHECK_ST(he_cache_plan_batch(c, first, 4, &plan), HE_OK);
    CHECK_ST(he_cache_plan_batch(c, second, 1, &plan), HE_OK);
    CHECK(plan.slot[0] == -1 && plan.num_fetch == 0 && plan.num_evict == 0); /* bypassed */
    CHECK_ST(he_cache_plan_batch(c, third, 2, &plan), HE_OK);
    /* 5 (used twice) takes 1's slot, after the last step's update of it in
     * host memory; 6 (once) bypasses. */
    CHECK(plan.num_fetch == 1 && plan.num_evict == 1 && plan.evict_row[0] == 1);
    CHECK(plan.fetch_row[0] == 5 && plan.fetch_after_update[0] == 1 && plan.slot[1] == -1);
    st = he_cache_get_stats(c);
    CHECK(st.bypassed == 2 && st.evictions == 1);
    he_cache_free(c);

    /* A row used often keeps its slot through rows used once; a row used
     * again and again gets one, from a row used less. */
    CHECK_ST(he_cache_new(10, 2, 1, HE_CACHE_CLOCK, &c), HE_OK);
    int64_t zero[] = {0}, one[] = {1};
    for (int i = 0; i < 3; i++)
        CHECK_ST(he_cache_plan_batch(c, zero, 1, &plan), HE_OK);
    CHECK_ST(he_cache_plan_batch(c, one, 1, &plan), HE_OK);
    int evictions = 0;
    for (int64_t r = 2; r < 7; r++) {
        int64_t once[] = {r};
        CHECK_ST(he_cache_plan_batch(c, once, 1, &plan), HE_OK);
        evictions += (int)plan.num_evict;
    }
    CHECK(evictions == 0 && he_cache_slot_of(c, 0) == 0 && he_cache_slot_of(c, 1) == 1);
    int64_t six[] = {6};
    for (int i = 0; i < 3 && he_cache_slot_of(c, 6) < 0; i++)
        CHECK_ST(he_cache_plan_batch(c, six, 1, &plan), HE_OK);
    CHECK(he_cache_slot_of(c, 6) == 1 && he_cache_slot_of(c, 1) == -1 && he_cache_slot_of(c, 0) == 0);
    he_cache_free(c);

    /* The hand goes round at most twice a batch (HE_CACHE_ROUNDS), so that
     * the GPU can decide a round at once: a miss turned away uses up the
     * slot it met for that round, and the misses left after the second
     * round bypass the cache unseen. Then, in a batch of its own, the row
     * used more than the residents gets a slot. */
    CHECK_ST(he_cache_new(100, 2, 1, HE_CACHE_CLOCK, &c), HE_OK);
    int64_t residents[] = {0, 1}, fifty[] = {50}, crowd[] = {2, 3, 4, 5, 50};
    for (int i = 0; i < 2; i++)
        CHECK_ST(he_cache_plan_batch(c, residents, 2, &plan), HE_OK);
    for (int i = 0; i < 2; i++)
        CHECK_ST(he_cache_plan_batch(c, fifty, 1, &plan), HE_OK);
    CHECK_ST(he_cache_plan_batch(c, crowd, 5, &plan), HE_OK); /* 2, 3 turned away, then 4, 5; 50 unseen */
    CHECK(plan.num_fetch == 0 && plan.slot[4] == -1);
    CHECK(he_cache_slot_of(c, 0) == 0 && he_cache_slot_of(c, 1) == 1);
    CHECK_ST(he_cache_plan_batch(c, fifty, 1, &plan), HE_OK);
    CHECK(plan.num_fetch == 1 && plan.slot[0] >= 0 && plan.num_evict == 1 && plan.evict_row[0] == plan.slot[0]);
    CHECK(he_cache_slot_of(c, 50) == plan.slot[0] && he_cache_slot_of(c, plan.evict_row[0]) == -1);
    he_cache_free(c);

    /* The frequency policy: a row used once does not take the slot of one
     * used as often, used again it takes the least recently used one's;
     * a row used twice is kept until a miss was used more than one time
     * more; refusals as the clock's. */
    CHECK_ST(he_cache_new(10, 2, 1, HE_CACHE_FREQUENCY, &c), HE_OK);
    int64_t pair[] = {0, 1}, two[] = {2};
    CHECK_ST(he_cache_plan_batch(c, pair, 2, &plan), HE_OK);
    CHECK(plan.num_fetch == 2 && plan.slot[0] == 0 && plan.slot[1] == 1);
    CHECK_ST(he_cache_plan_batch(c, zero, 1, &plan), HE_OK);
    CHECK(plan.slot[0] == 0 && plan.num_fetch == 0);
    CHECK_ST(he_cache_plan_batch(c, two, 1, &plan), HE_OK);
    CHECK(plan.slot[0] == -1 && plan.num_fetch == 0 && plan.num_evict == 0);
    CHECK_ST(he_cache_plan_batch(c, two, 1, &plan), HE_OK);
    CHECK(plan.num_evict == 1 && plan.evict_row[0] == 1 && plan.evict_slot[0] == 1);
    CHECK(plan.num_fetch == 1 && plan.fetch_row[0] == 2 && plan.fetch_slot[0] == 1 && plan.fetch_after_update[0]);
    CHECK(he_cache_slot_of(c, 0) == 0 && he_cache_slot_of(c, 2) == 1 && he_cache_slot_of(c, 1) == -1);
    CHECK_ST(he_cache_plan_batch(c, bad_range, 2, &plan), HE_ERR_INDEX);
    st = he_cache_get_stats(c);
    CHECK(st.batches == 4 && st.rows == 5 && st.hits == 1 && st.fetches == 3 && st.evictions == 1 && st.bypassed == 1);
    he_cache_free(c);
    CHECK_ST(he_cache_new(10, 1, 1, HE_CACHE_FREQUENCY, &c), HE_OK);
    for (int i = 0; i < 2; i++)
        CHECK_ST(he_cache_plan_batch(c, zero, 1, &plan), HE_OK);
    for (int i = 0; i < 4; i++) {
        CHECK_ST(he_cache_plan_batch(c, one, 1, &plan), HE_OK);
        CHECK(plan.slot[0] == -1 && he_cache_slot_of(c, 0) == 0);
    }
    CHECK_ST(he_cache_plan_batch(c, one, 1, &plan), HE_OK); /* 4 uses before against 2 */
    CHECK(plan.slot[0] == 0 && plan.num_evict == 1 && plan.evict_row[0] == 0);
    he_cache_free(c);
    CHECK_ST(he_cache_new(10, 1, 1, 2, &c), HE_ERR_VALUE);
    CHECK_MSG("policy");
    he_cache_plan_free(&plan);
    group_end("cache_plan");
}

/* Training through a small cache (rows and optimizer state in records of
 * a CPU buffer standing in for HBM) gives the bits of training without one:
 * 100 skewed batches with many evictions and bypassed rows, every
 * optimizer, planned after each step (protect 1) or a step ahead (protect
 * 2, the moves that may run early done before the last step's update, as
 * a GPU would overlap them). Each batch's rows are read back and compared
 * first: never stale. */
static void copy_record_row(const he_table *dst, int64_t dst_row, const he_table *src, int64_t src_row)
{
    memcpy(he_table_row(dst, dst_row), he_table_row(src, src_row), (size_t)dst->dim * he_table_elem(dst));
}

typedef struct cached_tables {
    he_table host[1 + HE_OPTIM_MAX_STATE]; /* weight, state... */
    he_table record[1 + HE_OPTIM_MAX_STATE];
    int n;
} cached_tables;

static void move_records(const cached_tables *t, const he_cache_plan *p, int evictions, int early, int late)
{
    for (int i = 0; i < t->n; i++) {
        if (evictions)
            for (int64_t e = 0; e < p->num_evict; e++)
                copy_record_row(&t->host[i], p->evict_row[e], &t->record[i], p->evict_slot[e]);
        for (int64_t f = 0; f < p->num_fetch; f++)
            if (p->fetch_after_update[f] ? late : early)
                copy_record_row(&t->record[i], p->fetch_slot[f], &t->host[i], p->fetch_row[f]);
    }
}

static void test_cache_trains_bit_identically(void)
{
    group_begin();
    const int64_t rows = 3000, count = 300, steps = 100, capacity = 96;
    const int64_t dims[] = {8, 40};
    for (int kind = 0; kind < HE_OPTIM_KINDS; kind++) {
        const he_optim_rule *rule = he_optim_rule_of(kind);
        for (int protect = 1; protect <= 2; protect++) {
            for (size_t di = 0; di < 2; di++) {
                int64_t dim = dims[di];
                /* [0]: the uncached reference; [1]: the cached table's host copy. */
                float *w[2], *s[2][2];
                int64_t widths[2];
                int64_t record_elems = dim;
                for (int i = 0; i < rule->num_state; i++) {
                    widths[i] = rule->per_row[i] ? 1 : dim;
                    record_elems += widths[i];
                }
                g_rng = 99 + (uint64_t)kind * 7 + (uint64_t)protect * 3 + di;
                for (int c = 0; c < 2; c++) {
                    w[c] = xmalloc((size_t)(rows * dim) * sizeof(float));
                    for (int i = 0; i < 2; i++)
                        s[c][i] = calloc((size_t)(rows * (i < rule->num_state ? widths[i] : 1)), sizeof(float));
                }
                fill_uniform(w[0], rows * dim, -1.0, 1.0);
                memcpy(w[1], w[0], (size_t)(rows * dim) * sizeof(float));
                float *records = calloc((size_t)(capacity * record_elems), sizeof(float));
                size_t record_bytes = (size_t)(capacity * record_elems) * sizeof(float);
                he_table ref_w = he_table_contiguous(w[0], (size_t)(rows * dim) * sizeof(float), rows, dim);
                he_table ref_s[2];
                cached_tables t = {.n = 1 + rule->num_state};
                t.host[0] = he_table_contiguous(w[1], (size_t)(rows * dim) * sizeof(float), rows, dim);
                t.record[0] = he_table_contiguous(records, record_bytes, capacity, dim);
                t.record[0].row_stride = record_elems;
                int64_t at = dim;
                for (int i = 0; i < rule->num_state; i++) {
                    size_t bytes = (size_t)(rows * widths[i]) * sizeof(float);
                    ref_s[i] = he_table_contiguous(s[0][i], bytes, rows, widths[i]);
                    t.host[1 + i] = he_table_contiguous(s[1][i], bytes, rows, widths[i]);
                    t.record[1 + i] = he_table_contiguous(records + at, record_bytes - (size_t)at * sizeof(float),
                                                          capacity, widths[i]);
                    t.record[1 + i].row_stride = record_elems;
                    at += widths[i];
                }
                he_cache *cache = NULL;
                /* Each policy planned at the lookup and a step ahead. */
                int policy = (protect + (int)di) % 2 ? HE_CACHE_FREQUENCY : HE_CACHE_CLOCK;
                CHECK_ST(he_cache_new(rows, capacity, protect, policy, &cache), HE_OK);
                he_cache_plan plan[2];
                CHECK_ST(he_cache_plan_init(&plan[0], count), HE_OK);
                CHECK_ST(he_cache_plan_init(&plan[1], count), HE_OK);
                int64_t *ids[2] = {xmalloc((size_t)count * sizeof(int64_t)), xmalloc((size_t)count * sizeof(int64_t))};
                he_dedup *d[2] = {NULL, NULL};
                float *grad = xmalloc((size_t)(count * dim) * sizeof(float));
                float *values = xmalloc((size_t)(count * dim) * sizeof(float));
                float *split_values[2] = {xmalloc((size_t)(count * dim) * sizeof(float)),
                                          xmalloc((size_t)(count * dim) * sizeof(float))};
                int64_t *indices = xmalloc((size_t)count * sizeof(int64_t));
                int64_t *split_index[2] = {xmalloc((size_t)count * sizeof(int64_t)),
                                           xmalloc((size_t)count * sizeof(int64_t))};
                int mismatched_reads = 0;
                /* Batch b's ids (skewed: a few hot rows, a long cold tail), its
                 * Dedup and its plan; with protect 2 the plan of b + 1 and its
                 * early moves come before b's update. */
                for (int64_t b = 0; b <= steps; b++) {
                    int cur = (int)(b % 2), nxt = 1 - cur;
                    if (b < steps) {
                        for (int64_t i = 0; i < count; i++) {
                            double u = rng_uniform(0.0, 1.0);
                            ids[nxt][i] = (int64_t)((double)rows * u * u * u * u);
                        }
                        he_ids view = {ids[nxt], count, 1};
                        he_dedup_free(d[nxt]);
                        d[nxt] = NULL;
                        CHECK_ST(he_dedup_build(&view, rows, &d[nxt]), HE_OK);
                        CHECK_ST(he_cache_plan_batch(cache, d[nxt]->unique, d[nxt]->num_unique, &plan[nxt]), HE_OK);
                        /* Planned a step ahead, evictions and the fetches not
                         * waiting on the last update run before it; planned after
                         * it, all of them (the last step is then complete). */
                        if (protect == 2 || b == 0)
                            move_records(&t, &plan[nxt], 1, 1, b == 0);
                    }
                    if (b == 0)
                        continue;
                    /* Step b - 1 runs on the batch in [cur]. */
                    const he_dedup *dd = d[cur];
                    const he_cache_plan *p = &plan[cur];
                    for (int64_t k = 0; k < dd->num_unique; k++) {
                        const he_table *where = p->slot[k] >= 0 ? &t.record[0] : &t.host[0];
                        int64_t r = p->slot[k] >= 0 ? p->slot[k] : dd->unique[k];
                        mismatched_reads += memcmp(he_table_row(where, r), he_table_row(&ref_w, dd->unique[k]),
                                                   (size_t)dim * sizeof(float)) != 0;
                    }
                    fill_uniform(grad, count * dim, -1.0, 1.0);
                    he_reduce_opts opts = {-1, 0};
                    int64_t nnz = 0;
                    CHECK_ST(he_grad_reduce(dd, grad, dim, &opts, values, indices, &nnz), HE_OK);
                    he_optim_params hp = {.kind = kind, .lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6,
                                          .lr_decay = 0.01, .step = b, .weight_decay = kind == 0 ? 0.1 : 0.0};
                    CHECK_ST(he_sparse_update(&hp, &ref_w, ref_s, rule->num_state, indices, values, HE_F32, nnz),
                             HE_OK);
                    /* The cached table: rows in slots update their records, the
                     * bypassed ones the host rows. */
                    int64_t n[2] = {0, 0};
                    for (int64_t k = 0; k < nnz; k++) {
                        int side = p->slot[k] >= 0;
                        split_index[side][n[side]] = side ? p->slot[k] : indices[k];
                        memcpy(split_values[side] + n[side] * dim, values + k * dim, (size_t)dim * sizeof(float));
                        n[side]++;
                    }
                    CHECK_ST(he_sparse_update(&hp, &t.record[0], &t.record[1], rule->num_state, split_index[1],
                                              split_values[1], HE_F32, n[1]),
                             HE_OK);
                    CHECK_ST(he_sparse_update(&hp, &t.host[0], &t.host[1], rule->num_state, split_index[0],
                                              split_values[0], HE_F32, n[0]),
                             HE_OK);
                    if (b < steps)
                        move_records(&t, &plan[nxt], protect == 1, protect == 1, 1);
                }
                /* Flush: every cached record back to its row. */
                for (int32_t slot = 0; slot < capacity; slot++) {
                    int64_t r = he_cache_row_of(cache, slot);
                    if (r >= 0)
                        for (int i = 0; i < t.n; i++)
                            copy_record_row(&t.host[i], r, &t.record[i], slot);
                }
                he_cache_stats st = he_cache_get_stats(cache);
                CHECKF(mismatched_reads == 0, "%s protect %d dim %" PRId64 ": %d stale rows read", rule->name, protect,
                       dim, mismatched_reads);
                CHECKF(memcmp(w[0], w[1], (size_t)(rows * dim) * sizeof(float)) == 0,
                       "%s protect %d dim %" PRId64 ": cached weights differ", rule->name, protect, dim);
                for (int i = 0; i < rule->num_state; i++)
                    CHECKF(memcmp(s[0][i], s[1][i], (size_t)(rows * widths[i]) * sizeof(float)) == 0,
                           "%s protect %d: cached %s differs", rule->name, protect, rule->state_names[i]);
                CHECKF(st.hits > 0 && st.evictions > 0 && st.bypassed > 0 && st.batches == steps,
                       "the run must hit, evict and bypass: %" PRId64 " %" PRId64 " %" PRId64, st.hits, st.evictions,
                       st.bypassed);
                he_cache_free(cache);
                he_cache_plan_free(&plan[0]);
                he_cache_plan_free(&plan[1]);
                for (int c = 0; c < 2; c++) {
                    free(w[c]);
                    free(s[c][0]);
                    free(s[c][1]);
                    free(ids[c]);
                    he_dedup_free(d[c]);
                    free(split_values[c]);
                    free(split_index[c]);
                }
                free(records);
                free(grad);
                free(values);
                free(indices);
            }
        }
    }
    group_end("cache_trains");
}

/* he_pool_bags over several float32 tables at once against a plain loop
 * doing torch's float operations in position order (sum from zero, a
 * weighted row by one fmaf without padding_idx, a mean divided once), for
 * every thread count; bad ids and bad offsets fail before any output is
 * written; he_bag_positions' bags and factors. */
static void test_pool_bags(void)
{
    group_begin();
    /* Widths of the general loop (37), of the register sums (16 with
     * padding and a mean, 64 weighted), and zero. */
    enum { T = 4 };
    const int64_t rows[T] = {400, 90, 7, 300}, dim[T] = {37, 16, 0, 64}, count[T] = {900, 300, 20, 700};
    float *table[T], *out[T], *want[T], *weights[T];
    int64_t *ids[T], *offsets[T], num_bags[T];
    he_bag_batch b[T];
    for (int t = 0; t < T; t++) {
        table[t] = xmalloc((size_t)(rows[t] * dim[t] + 1) * sizeof(float));
        fill_uniform(table[t], rows[t] * dim[t], -2.0, 2.0);
        ids[t] = xmalloc((size_t)count[t] * sizeof(int64_t));
        weights[t] = xmalloc((size_t)count[t] * sizeof(float));
        offsets[t] = xmalloc((size_t)(count[t] + 1) * sizeof(int64_t));
        for (int64_t i = 0; i < count[t]; i++) {
            ids[t][i] = (int64_t)rng_below((uint64_t)rows[t]);
            weights[t][i] = (float)((double)rng_below(1000) / 250.0 - 2.0);
        }
        /* Bags of 0-9 ids, some empty, the last ending before the ids do
         * (positions past it are in no bag). */
        int64_t n = 0, at = 0;
        while (at < count[t] - 15) {
            offsets[t][n++] = at;
            at += (int64_t)rng_below(10);
        }
        num_bags[t] = n;
        out[t] = xmalloc((size_t)(n * dim[t] + 1) * sizeof(float));
        want[t] = xmalloc((size_t)(n * dim[t] + 1) * sizeof(float));
        b[t] = (he_bag_batch){he_table_contiguous(table[t], (size_t)(rows[t] * dim[t]) * sizeof(float), rows[t],
                                                  dim[t]),
                              {ids[t], count[t], 1}, offsets[t], n, at, t == 0 || t == 3 ? weights[t] : NULL,
                              t == 1 ? ids[t][3] : -1, t == 1, out[t]};
    }
    for (int t = 0; t < T; t++)
        for (int64_t bag = 0; bag < num_bags[t]; bag++) {
            int64_t first = offsets[t][bag], last = bag + 1 < num_bags[t] ? offsets[t][bag + 1] : b[t].end;
            int64_t counted = 0;
            for (int64_t j = 0; j < dim[t]; j++) {
                float acc = 0.0f;
                counted = 0;
                for (int64_t p = first; p < last; p++) {
                    if (ids[t][p] == b[t].padding_idx)
                        continue;
                    counted++;
                    float x = table[t][ids[t][p] * dim[t] + j];
                    acc = b[t].weights ? fmaf(weights[t][p], x, acc) : acc + x;
                }
                want[t][bag * dim[t] + j] = b[t].mean && counted ? acc / (float)counted : acc;
            }
        }
    static const int threads[] = {1, 3, 8};
    for (size_t k = 0; k < sizeof threads / sizeof *threads; k++) {
        set_threads(threads[k]);
        for (int t = 0; t < T; t++)
            memset(out[t], 0xFF, (size_t)(num_bags[t] * dim[t]) * sizeof(float));
        int64_t bad = 7;
        CHECK_ST(he_pool_bags(b, T, &bad), HE_OK);
        CHECK(bad == -1);
        for (int t = 0; t < T; t++)
            CHECK(memcmp(out[t], want[t], (size_t)(num_bags[t] * dim[t]) * sizeof(float)) == 0);
    }
    /* A bad id in the second table: IndexError naming it, no output written. */
    int64_t saved = ids[1][5];
    ids[1][5] = rows[1];
    for (int t = 0; t < T; t++)
        memset(out[t], 0xAB, (size_t)(num_bags[t] * dim[t]) * sizeof(float));
    int64_t bad = -1;
    CHECK_ST(he_pool_bags(b, T, &bad), HE_ERR_INDEX);
    CHECK(bad == 1);
    CHECK_MSG("table 1 of 4");
    CHECK_MSG("position 5");
    for (int t = 0; t < T; t++)
        for (size_t i = 0; i < (size_t)(num_bags[t] * dim[t]) * sizeof(float); i++)
            CHECK(((unsigned char *)out[t])[i] == 0xAB);
    ids[1][5] = saved;
    /* An id past the last bag is in no bag: never read, never checked. */
    ids[1][count[1] - 1] = -5;
    CHECK_ST(he_pool_bags(&b[1], 1, NULL), HE_OK);
    /* Offsets that decrease, or pass the end. */
    int64_t keep = offsets[0][2];
    offsets[0][2] = offsets[0][1] - 1;
    CHECK_ST(he_pool_bags(b, T, NULL), HE_ERR_VALUE);
    CHECK_MSG("never decrease");
    offsets[0][2] = b[0].end + 1;
    CHECK_ST(he_pool_bags(b, T, NULL), HE_ERR_VALUE);
    offsets[0][2] = keep;
    /* Backward's view: each position's bag, and its factor. */
    int64_t *bag_of = xmalloc((size_t)count[1] * sizeof(int64_t));
    float *factor = xmalloc((size_t)count[1] * sizeof(float));
    int wrote = 0;
    CHECK_ST(he_bag_positions(&b[1], bag_of, factor, &wrote), HE_OK);
    CHECK(wrote == 1);
    for (int64_t bag = 0; bag < num_bags[1]; bag++) {
        int64_t first = offsets[1][bag], last = bag + 1 < num_bags[1] ? offsets[1][bag + 1] : b[1].end, counted = 0;
        for (int64_t p = first; p < last; p++)
            counted += ids[1][p] != b[1].padding_idx;
        for (int64_t p = first; p < last; p++) {
            CHECK(bag_of[p] == bag);
            CHECK(factor[p] == (ids[1][p] == b[1].padding_idx ? 0.0f : 1.0f / (float)counted));
        }
    }
    for (int64_t p = b[1].end; p < count[1]; p++)
        CHECK(bag_of[p] == 0 && factor[p] == 0.0f);
    he_bag_batch plain = b[2];
    plain.end = count[2];
    CHECK_ST(he_bag_positions(&plain, bag_of, factor, &wrote), HE_OK);
    CHECK(wrote == 0);
    /* he_bag_grad_reduce: the positions made by the core, bitwise the
     * reduce given he_bag_positions' (mean bags with padding and ids past
     * the last bag; weighted bags), any thread count; a sort of other ids,
     * a gradient of fewer rows than bags, a sort for another table's rows:
     * refused, nothing written. */
    ids[1][count[1] - 1] = 2;
    for (int t = 1; t <= 3; t += 2) {
        he_ids view = {ids[t], count[t], 1};
        he_dedup *d = NULL;
        CHECK_ST(he_dedup_build(&view, rows[t], &d), HE_OK);
        int64_t grad_rows = num_bags[t] + 2, n = d->num_unique;
        float *grad = xmalloc((size_t)(grad_rows * dim[t]) * sizeof(float));
        fill_uniform(grad, grad_rows * dim[t], -1.0, 1.0);
        int64_t *t_bag_of = xmalloc((size_t)count[t] * sizeof(int64_t));
        float *t_factor = xmalloc((size_t)count[t] * sizeof(float));
        CHECK_ST(he_bag_positions(&b[t], t_bag_of, t_factor, &wrote), HE_OK);
        CHECK(wrote == 1);
        he_reduce_opts given = {b[t].padding_idx, t == 1, t_bag_of, t_factor, grad_rows, HE_F32, 0};
        he_reduce_opts made = {b[t].padding_idx, t == 1, NULL, NULL, 0, HE_F32, 0};
        float *want = xmalloc((size_t)(n * dim[t]) * sizeof(float)), *got = xmalloc((size_t)(n * dim[t]) * sizeof(float));
        int64_t *want_idx = xmalloc((size_t)n * sizeof(int64_t)), *got_idx = xmalloc((size_t)n * sizeof(int64_t));
        int64_t want_n = -1, got_n = -1;
        CHECK_ST(he_grad_reduce(d, grad, dim[t], &given, want, want_idx, &want_n), HE_OK);
        for (int threads_n = 1; threads_n <= 3; threads_n += 2) {
            set_threads(threads_n);
            memset(got, 0xCD, (size_t)(n * dim[t]) * sizeof(float));
            CHECK_ST(he_bag_grad_reduce(d, &b[t], grad, grad_rows, &made, got, got_idx, &got_n), HE_OK);
            CHECKF(got_n == want_n && memcmp(got_idx, want_idx, (size_t)want_n * sizeof(int64_t)) == 0 &&
                       memcmp(got, want, (size_t)(want_n * dim[t]) * sizeof(float)) == 0,
                   "table %d, %d threads: the core's bag positions reduce otherwise", t, threads_n);
        }
        memset(got, 0xCD, (size_t)(n * dim[t]) * sizeof(float));
        he_bag_batch shorter = b[t];
        shorter.ids.count--;
        CHECK_ST(he_bag_grad_reduce(d, &shorter, grad, grad_rows, &made, got, got_idx, &got_n), HE_ERR_VALUE);
        CHECK_MSG("a sort of");
        CHECK_ST(he_bag_grad_reduce(d, &b[t], grad, num_bags[t] - 1, &made, got, got_idx, &got_n), HE_ERR_VALUE);
        CHECK_MSG("rows for");
        he_bag_batch other = b[t];
        other.table.num_rows++;
        CHECK_ST(he_bag_grad_reduce(d, &other, grad, grad_rows, &made, got, got_idx, &got_n), HE_ERR_VALUE);
        CHECK_MSG("-row table");
        for (size_t i = 0; i < (size_t)(n * dim[t]) * sizeof(float); i++)
            CHECK(((unsigned char *)got)[i] == 0xCD);
        free(grad);
        free(t_bag_of);
        free(t_factor);
        free(want);
        free(got);
        free(want_idx);
        free(got_idx);
        he_dedup_free(d);
    }
    free(bag_of);
    free(factor);
    for (int t = 0; t < T; t++) {
        free(table[t]);
        free(out[t]);
        free(want[t]);
        free(weights[t]);
        free(ids[t]);
        free(offsets[t]);
    }
    set_threads(2);
    group_end("pool_bags");
}

/* he_sparse_update_fused_many: Adagrad on three tables at once, side by
 * side on the threads (small tables) and one after another (a big one),
 * bitwise what one he_sparse_update_fused a table gives, whether a table
 * comes with its sort (table 0), with ids the core sorts (table 1) or as a
 * batch of bags whose positions the core finds too (table 2, mean bags);
 * an update that fails its checks (a sort of another table, an id out of
 * range, a gradient with fewer rows than bags) changes no table and names
 * its table. */
static void test_sparse_update_fused_many(void)
{
    group_begin();
    enum { T = 3 };
    for (int big = 0; big <= 1; big++) {
        const int64_t rows[T] = {300, 50, big ? 20000 : 9}, dim[T] = {16, 64, big ? 96 : 5};
        const int64_t count[T] = {400, 200, big ? 20000 : 30};
        float *w[T], *st[T], *w_ref[T], *st_ref[T], *grad[T];
        int64_t *ids[T];
        he_dedup *d[T];
        he_fused_update u[T];
        /* Table 2's bags: 3 ids each (the last one shorter), mean. */
        int64_t num_bags = (count[2] + 2) / 3;
        int64_t *offsets = xmalloc((size_t)num_bags * sizeof *offsets);
        for (int64_t b = 0; b < num_bags; b++)
            offsets[b] = 3 * b;
        int64_t *bag_of = xmalloc((size_t)count[2] * sizeof *bag_of);
        float *factor = xmalloc((size_t)count[2] * sizeof *factor);
        he_bag_batch bags;
        for (int t = 0; t < T; t++) {
            size_t n = (size_t)(rows[t] * dim[t]);
            w[t] = xmalloc(n * sizeof(float));
            st[t] = xmalloc(n * sizeof(float));
            fill_uniform(w[t], rows[t] * dim[t], -1.0, 1.0);
            fill_uniform(st[t], rows[t] * dim[t], 0.0, 1.0);
            w_ref[t] = xdup(w[t], n * sizeof(float));
            st_ref[t] = xdup(st[t], n * sizeof(float));
            ids[t] = xmalloc((size_t)count[t] * sizeof(int64_t));
            grad[t] = xmalloc((size_t)(count[t] * dim[t]) * sizeof(float));
            for (int64_t i = 0; i < count[t]; i++)
                ids[t][i] = (int64_t)rng_below((uint64_t)rows[t]);
            fill_uniform(grad[t], count[t] * dim[t], -1.0, 1.0);
            he_ids view = {ids[t], count[t], 1};
            CHECK_ST(he_dedup_build(&view, rows[t], &d[t]), HE_OK);
            he_optim_params hp = {HE_OPTIM_ADAGRAD, 0.1, 0, 0, 1e-10, 0.01, 3, 0, 0.0, 0, 0};
            u[t] = (he_fused_update){.d = d[t], .grad = grad[t], .opts = {-1, 0}, .hp = hp,
                                     .weight = he_table_contiguous(w[t], n * sizeof(float), rows[t], dim[t]),
                                     .state = {he_table_contiguous(st[t], n * sizeof(float), rows[t], dim[t])},
                                     .num_state = 1};
            u[t].opts.dtype = HE_F32;
        }
        /* The reference's view of table 2: one gradient row a bag. */
        bags = (he_bag_batch){.table = u[2].weight, .ids = {ids[2], count[2], 1}, .offsets = offsets,
                              .num_bags = num_bags, .end = count[2], .padding_idx = -1, .mean = 1};
        int wrote = 0;
        CHECK_ST(he_bag_positions(&bags, bag_of, factor, &wrote), HE_OK);
        CHECK(wrote == 1);
        he_reduce_opts pooled = u[2].opts;
        pooled.bag_of = bag_of;
        pooled.row_weights = factor;
        pooled.num_bags = num_bags;
        /* What the core makes itself: table 1's sort, table 2's sort and positions. */
        u[1].d = NULL;
        u[1].ids = (he_ids){ids[1], count[1], 1};
        u[2].d = NULL;
        u[2].bags = &bags;
        u[2].grad_rows = num_bags;
        set_threads(3);
        /* A dedup of another row count in the first table: nothing written. */
        he_fused_update bad[T] = {u[0], u[1], u[2]};
        bad[0].weight.num_rows -= 1;
        bad[0].state[0].num_rows -= 1;
        CHECK_ST(he_sparse_update_fused_many(bad, T), HE_ERR_VALUE);
        CHECK_MSG("table 0 of 3");
        /* An id out of range in the ids the core sorts. */
        int64_t kept = ids[1][count[1] - 1];
        ids[1][count[1] - 1] = rows[1];
        memcpy(bad, u, sizeof bad);
        CHECK_ST(he_sparse_update_fused_many(bad, T), HE_ERR_INDEX);
        CHECK_MSG("table 1 of 3");
        ids[1][count[1] - 1] = kept;
        /* A gradient of fewer rows than bags. */
        bad[2].grad_rows = num_bags - 1;
        CHECK_ST(he_sparse_update_fused_many(bad, T), HE_ERR_VALUE);
        CHECK_MSG("table 2 of 3");
        for (int t = 0; t < T; t++)
            CHECK(memcmp(w[t], w_ref[t], (size_t)(rows[t] * dim[t]) * sizeof(float)) == 0);
        CHECK_ST(he_sparse_update_fused_many(u, T), HE_OK);
        for (int t = 0; t < T; t++) {
            size_t n = (size_t)(rows[t] * dim[t]);
            he_table wr = he_table_contiguous(w_ref[t], n * sizeof(float), rows[t], dim[t]);
            he_table sr = he_table_contiguous(st_ref[t], n * sizeof(float), rows[t], dim[t]);
            CHECK_ST(he_sparse_update_fused(d[t], grad[t], t == 2 ? &pooled : &u[t].opts, &u[t].hp, &wr, &sr, 1),
                     HE_OK);
            CHECKF(memcmp(w[t], w_ref[t], n * sizeof(float)) == 0 && memcmp(st[t], st_ref[t], n * sizeof(float)) == 0,
                   "table %d (big %d): the update of many differs from its own", t, big);
            he_dedup_free(d[t]);
            free(w[t]);
            free(st[t]);
            free(w_ref[t]);
            free(st_ref[t]);
            free(ids[t]);
            free(grad[t]);
        }
        free(offsets);
        free(bag_of);
        free(factor);
    }
    set_threads(2);
    group_end("sparse_update_fused_many");
}

/* he_sparse_update_many: SGD, Adagrad and row-wise Adagrad on three tables
 * at once (side by side when small, one after another when big, indices
 * repeated and unsorted in one), bitwise what one he_sparse_update a table
 * gives; a table whose update fails its checks (an index out of range, a
 * state of another shape) leaves every table as it was, and is named. */
/* Compact state (quantize.h): for SparseAdam, row-wise Adam and Adagrad
 * with bfloat16 or 8-bit state, rounded to nearest or stochastically, the
 * fused backward gives unfused bits (codes and scales too) on rows of one
 * scale block and of two (the second partial); a scale buffer too small, or
 * the non-negative form for a signed state, is refused before any write. */
typedef struct compact_twin {
    float *w;
    void *s[2];
    float *scale[2];
} compact_twin;

static void test_sparse_update_compact_state(void)
{
    group_begin();
    const int64_t rows = 90, count = 300;
    const int kinds[] = {HE_OPTIM_ADAM, HE_OPTIM_ROWWISE_ADAM, HE_OPTIM_ADAGRAD};
    const int forms[] = {HE_BF16, HE_Q8};
    const int64_t dims[] = {40, 300};
    for (size_t ki = 0; ki < sizeof kinds / sizeof *kinds; ki++)
        for (size_t fi = 0; fi < sizeof forms / sizeof *forms; fi++)
            for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
                for (int stochastic = 0; stochastic < 2; stochastic++) {
                    const he_optim_rule *rule = he_optim_rule_of(kinds[ki]);
                    int64_t dim = dims[di], blocks = he_q8_blocks(dim), *ids;
                    float *grad;
                    skewed_batch(7 + (uint64_t)dim, count, rows, 8, dim, &ids, &grad);
                    compact_twin c[2];
                    he_table t[2][3];
                    for (int k = 0; k < 2; k++) {
                        c[k].w = xmalloc((size_t)(rows * dim) * sizeof(float));
                        g_rng = 3;
                        fill_uniform(c[k].w, rows * dim, -1.0, 1.0);
                        t[k][0] = he_table_contiguous(c[k].w, (size_t)(rows * dim) * sizeof(float), rows, dim);
                        for (int i = 0; i < rule->num_state; i++) {
                            int per_row = rule->per_row[i];
                            int dtype = per_row ? HE_F32 : forms[fi] == HE_Q8 && rule->nonnegative[i] ? HE_Q8_NONNEG
                                                                                                       : forms[fi];
                            int64_t width = per_row ? 1 : dim;
                            size_t bytes = (size_t)(rows * width) * he_dtype_size(dtype);
                            c[k].s[i] = xmalloc(bytes);
                            memset(c[k].s[i], 0, bytes);
                            t[k][1 + i] = he_table_typed(c[k].s[i], bytes, rows, width, dtype);
                            c[k].scale[i] = NULL;
                            if (he_dtype_quantized(dtype)) {
                                c[k].scale[i] = xmalloc((size_t)(rows * blocks) * sizeof(float));
                                memset(c[k].scale[i], 0, (size_t)(rows * blocks) * sizeof(float));
                                t[k][1 + i].scale = c[k].scale[i];
                                t[k][1 + i].scale_nbytes = (size_t)(rows * blocks) * sizeof(float);
                                t[k][1 + i].scale_stride = blocks;
                            }
                        }
                    }
                    he_optim_params hp = {.kind = kinds[ki], .lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6,
                                          .step = 3, .state_stochastic_rounding = stochastic, .seed = 11};
                    he_reduce_opts opts = {-1, 0};
                    he_ids view = {ids, count, 1};
                    he_dedup *d = NULL;
                    CHECK_ST(he_dedup_build(&view, rows, &d), HE_OK);
                    CHECK_ST(he_sparse_update_fused(d, grad, &opts, &hp, &t[0][0], &t[0][1], rule->num_state),
                             HE_OK);
                    float *values = xmalloc((size_t)(d->num_unique * dim) * sizeof *values);
                    int64_t *indices = xmalloc((size_t)d->num_unique * sizeof *indices), nnz = 0;
                    CHECK_ST(he_grad_reduce(d, grad, dim, &opts, values, indices, &nnz), HE_OK);
                    CHECK_ST(he_sparse_update(&hp, &t[1][0], &t[1][1], rule->num_state, indices, values, HE_F32,
                                              nnz), HE_OK);
                    CHECKF(memcmp(c[0].w, c[1].w, t[0][0].nbytes) == 0, "%s, dim %" PRId64 ": weights differ",
                           rule->name, dim);
                    int moved = 0;
                    for (int i = 0; i < rule->num_state; i++) {
                        CHECKF(memcmp(c[0].s[i], c[1].s[i], t[0][1 + i].nbytes) == 0,
                               "%s, dim %" PRId64 ": state %d differs", rule->name, dim, i);
                        if (c[0].scale[i])
                            CHECK(memcmp(c[0].scale[i], c[1].scale[i], (size_t)(rows * blocks) * sizeof(float)) == 0);
                        for (size_t b = 0; b < t[0][1 + i].nbytes; b++)
                            moved |= ((unsigned char *)c[0].s[i])[b] != 0;
                    }
                    CHECKF(moved, "%s: the state did not change", rule->name);
                    /* Refused, nothing written: scales that do not fit, and
                     * the non-negative form for a signed state. */
                    float *before = xmalloc(t[1][0].nbytes);
                    memcpy(before, c[1].w, t[1][0].nbytes);
                    for (int i = 0; i < rule->num_state; i++) {
                        if (!c[1].scale[i])
                            continue;
                        he_table bad[2] = {t[1][1], t[1][2]};
                        bad[i].scale_nbytes -= sizeof(float);
                        CHECK_ST(he_sparse_update(&hp, &t[1][0], bad, rule->num_state, indices, values, HE_F32, nnz),
                                 HE_ERR_VALUE);
                        CHECK_MSG("scales");
                        if (!rule->nonnegative[i]) {
                            bad[i] = t[1][1 + i];
                            bad[i].dtype = HE_Q8_NONNEG;
                            CHECK_ST(he_sparse_update(&hp, &t[1][0], bad, rule->num_state, indices, values, HE_F32,
                                                      nnz), HE_ERR_VALUE);
                            CHECK_MSG("takes negative values");
                        }
                    }
                    CHECK(memcmp(before, c[1].w, t[1][0].nbytes) == 0);
                    free(before);
                    for (int k = 0; k < 2; k++) {
                        free(c[k].w);
                        for (int i = 0; i < rule->num_state; i++) {
                            free(c[k].s[i]);
                            free(c[k].scale[i]);
                        }
                    }
                    free(values);
                    free(indices);
                    free(ids);
                    free(grad);
                    he_dedup_free(d);
                }
    group_end("sparse_update_compact_state");
}

static void test_sparse_update_many(void)
{
    group_begin();
    enum { T = 3 };
    const int kinds[T] = {HE_OPTIM_SGD, HE_OPTIM_ADAGRAD, HE_OPTIM_ROWWISE_ADAGRAD};
    for (int big = 0; big <= 1; big++) {
        const int64_t rows[T] = {300, 50, big ? 20000 : 9}, dim[T] = {16, 64, big ? 96 : 5};
        const int64_t nnz[T] = {40, 30, big ? 20000 : 12};
        float *w[T], *st[T], *w_ref[T], *st_ref[T], *grad[T];
        int64_t *idx[T];
        he_sparse_update_job jobs[T];
        for (int t = 0; t < T; t++) {
            size_t n = (size_t)(rows[t] * dim[t]);
            size_t ns = kinds[t] == HE_OPTIM_ROWWISE_ADAGRAD ? (size_t)rows[t] : n;
            w[t] = xmalloc(n * sizeof(float));
            st[t] = xmalloc(ns * sizeof(float));
            fill_uniform(w[t], (int64_t)n, -1.0, 1.0);
            fill_uniform(st[t], (int64_t)ns, 0.0, 1.0);
            w_ref[t] = xdup(w[t], n * sizeof(float));
            st_ref[t] = xdup(st[t], ns * sizeof(float));
            idx[t] = xmalloc((size_t)nnz[t] * sizeof(int64_t));
            grad[t] = xmalloc((size_t)(nnz[t] * dim[t]) * sizeof(float));
            for (int64_t i = 0; i < nnz[t]; i++) /* table 1: repeats, unsorted; others ascending */
                idx[t][i] = t == 1 ? (int64_t)rng_below((uint64_t)rows[t]) : i * rows[t] / nnz[t];
            fill_uniform(grad[t], nnz[t] * dim[t], -1.0, 1.0);
            he_optim_params hp = {kinds[t], 0.1, 0, 0, 1e-10, 0.01, 3, 0, 0.0, 0, 0};
            int64_t sdim = kinds[t] == HE_OPTIM_ROWWISE_ADAGRAD ? 1 : dim[t];
            jobs[t] = (he_sparse_update_job){
                .hp = hp, .weight = he_table_contiguous(w[t], n * sizeof(float), rows[t], dim[t]),
                .state = {he_table_contiguous(st[t], ns * sizeof(float), rows[t], sdim)},
                .num_state = kinds[t] == HE_OPTIM_SGD ? 0 : 1, .indices = idx[t], .values = grad[t],
                .values_dtype = HE_F32, .nnz = nnz[t]};
        }
        set_threads(3);
        he_sparse_update_job bad[T];
        memcpy(bad, jobs, sizeof bad);
        int64_t kept = idx[2][nnz[2] - 1];
        idx[2][nnz[2] - 1] = rows[2];
        CHECK_ST(he_sparse_update_many(bad, T), HE_ERR_INDEX);
        CHECK_MSG("table 2 of 3");
        idx[2][nnz[2] - 1] = kept;
        bad[1].state[0].num_rows -= 1;
        CHECK_ST(he_sparse_update_many(bad, T), HE_ERR_VALUE);
        CHECK_MSG("table 1 of 3");
        for (int t = 0; t < T; t++)
            CHECK(memcmp(w[t], w_ref[t], (size_t)(rows[t] * dim[t]) * sizeof(float)) == 0);
        CHECK_ST(he_sparse_update_many(jobs, T), HE_OK);
        for (int t = 0; t < T; t++) {
            size_t n = (size_t)(rows[t] * dim[t]);
            size_t ns = kinds[t] == HE_OPTIM_ROWWISE_ADAGRAD ? (size_t)rows[t] : n;
            he_table wr = he_table_contiguous(w_ref[t], n * sizeof(float), rows[t], dim[t]);
            he_table sr = he_table_contiguous(st_ref[t], ns * sizeof(float), rows[t], jobs[t].state[0].dim);
            CHECK_ST(he_sparse_update(&jobs[t].hp, &wr, &sr, jobs[t].num_state, idx[t], grad[t], HE_F32, nnz[t]),
                     HE_OK);
            CHECKF(memcmp(w[t], w_ref[t], n * sizeof(float)) == 0 && memcmp(st[t], st_ref[t], ns * sizeof(float)) == 0,
                   "table %d (big %d): the update of many differs from its own", t, big);
            free(w[t]);
            free(st[t]);
            free(w_ref[t]);
            free(st_ref[t]);
            free(idx[t]);
            free(grad[t]);
        }
    }
    set_threads(2);
    group_end("sparse_update_many");
}

/* A table file's rows: written and read back by many threads, in runs of
 * consecutive rows and alone; bad arguments, a short file, a removed file
 * and a failing request refused with the row named. */
static void test_row_file(void)
{
    group_begin();
    char path[] = "/tmp/he_test_rows_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    enum { ROWS = 1000, N = 300 };
    const size_t row_bytes = 40;
    CHECK(ftruncate(fd, (off_t)(ROWS * row_bytes)) == 0);
    he_row_file f = {fd, -1, 0, row_bytes, ROWS, 0, path};
    int64_t rows[N];
    for (int k = 0, r = 0; k < N; k++) {
        r += (k % 7 == 0) ? 5 : 1; /* runs of consecutive rows, and gaps */
        rows[k] = r;
    }
    unsigned char *out = malloc(N * row_bytes), *back = malloc(N * row_bytes);
    CHECK(out && back);
    if (!out || !back)
        return;
    for (size_t i = 0; i < N * row_bytes; i++)
        out[i] = (unsigned char)(i * 31 + 7);
    for (int threads = 1; threads <= 8; threads *= 8) {
        CHECK_ST(he_row_file_write(&f, rows, N, out, threads), HE_OK);
        memset(back, 0, N * row_bytes);
        CHECK_ST(he_row_file_read(&f, rows, N, back, threads), HE_OK);
        CHECK(memcmp(out, back, N * row_bytes) == 0);
    }
    unsigned char row0[40];
    CHECK(pread(fd, row0, row_bytes, (off_t)(rows[3] * row_bytes)) == (ssize_t)row_bytes);
    CHECK(memcmp(row0, out + 3 * row_bytes, row_bytes) == 0);

    int64_t unsorted[2] = {5, 4}, outside[1] = {ROWS};
    CHECK_ST(he_row_file_read(&f, unsorted, 2, back, 4), HE_ERR_VALUE);
    CHECK_MSG("ascending and distinct");
    CHECK_ST(he_row_file_read(&f, outside, 1, back, 4), HE_ERR_INDEX);
    CHECK_MSG("row 1000 is outside");
    he_row_file direct = f;
    direct.direct_fd = fd;
    direct.align = 384;
    CHECK_ST(he_row_file_read(&direct, rows, 1, back, 4), HE_ERR_VALUE);
    CHECK_MSG("power of two");

    he_row_file_inject_error(2, 5 /* EIO */);
    CHECK_ST(he_row_file_write(&f, rows, N, out, 4), HE_ERR_SYSTEM);
    CHECK_MSG("Input/output error");
    CHECK_ST(he_row_file_read(&f, rows, N, back, 4), HE_OK); /* it fired once */

    CHECK(ftruncate(fd, (off_t)(ROWS * row_bytes / 2)) == 0);
    CHECK_ST(he_row_file_write(&f, rows, N, out, 4), HE_ERR_SYSTEM);
    CHECK_MSG("truncated");
    struct stat sb;
    CHECK(fstat(fd, &sb) == 0 && sb.st_size == (off_t)(ROWS * row_bytes / 2)); /* not extended again */
    CHECK(ftruncate(fd, (off_t)(ROWS * row_bytes)) == 0);
    unlink(path);
    CHECK_ST(he_row_file_read(&f, rows, N, back, 4), HE_ERR_SYSTEM);
    CHECK_MSG("removed");
    CHECK_ST(he_row_file_write(&f, rows, N, out, 4), HE_OK); /* its rows can still be written back */
    close(fd);
    free(out);
    free(back);
    group_end("row_file");
}

/* Direct I/O of rows of any size, at any offset: after writing some rows
 * (sharing sectors with rows not written, in chains, at the file's end),
 * the whole file holds exactly what a byte-wise model says, and reading
 * rows gives them back. Skipped where the file system has no O_DIRECT. */
static void test_row_file_direct(void)
{
    group_begin();
    char path[] = "/var/tmp/he_test_direct_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    int direct_fd = open(path, O_RDWR | O_DIRECT);
    if (direct_fd < 0) {
        printf("  (row_file_direct: no O_DIRECT here, skipped)\n");
        close(fd);
        unlink(path);
        group_end("row_file_direct");
        return;
    }
    enum { ROWS = 777 };
    const size_t sizes[] = {40, 256, 512, 700, 1536};
    const uint64_t offsets[] = {0, 100};
    uint64_t seed = 12345;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        for (size_t oi = 0; oi < 2; oi++) {
            size_t rb = sizes[si];
            uint64_t offset = offsets[oi];
            size_t file_bytes = (size_t)offset + ROWS * rb;
            unsigned char *model = malloc(file_bytes), *disk = malloc(file_bytes);
            unsigned char *out = malloc(ROWS * rb), *back = malloc(ROWS * rb);
            int64_t *rows = malloc(ROWS * sizeof *rows);
            CHECK(model && disk && out && back && rows);
            if (!model || !disk || !out || !back || !rows)
                return;
            for (size_t i = 0; i < file_bytes; i++)
                model[i] = (unsigned char)(i * 13 + rb);
            CHECK(ftruncate(fd, 0) == 0 && pwrite(fd, model, file_bytes, 0) == (ssize_t)file_bytes);
            he_row_file f = {fd, direct_fd, 512, rb, ROWS, offset, path};
            for (int round = 0; round < 4; round++) {
                size_t n = 0;
                for (int64_t r = 0; r < ROWS; r++) {
                    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                    /* sparse, dense and whole rounds; the last rows always */
                    int keep = round == 3 || r >= ROWS - 2 || (int)((seed >> 33) % 4) < round + 1;
                    if (keep)
                        rows[n++] = r;
                }
                for (size_t k = 0; k < n * rb; k++)
                    out[k] = (unsigned char)(k * 7 + round * 31 + si);
                CHECK_ST(he_row_file_write(&f, rows, n, out, round % 2 ? 8 : 1), HE_OK);
                for (size_t k = 0; k < n; k++)
                    memcpy(model + offset + (size_t)rows[k] * rb, out + k * rb, rb);
                CHECK(pread(fd, disk, file_bytes, 0) == (ssize_t)file_bytes);
                CHECK(memcmp(disk, model, file_bytes) == 0);
                memset(back, 0, n * rb);
                CHECK_ST(he_row_file_read(&f, rows, n, back, round % 2 ? 1 : 8), HE_OK);
                CHECK(memcmp(back, out, n * rb) == 0);
            }
            struct stat sb;
            CHECK(fstat(fd, &sb) == 0 && sb.st_size == (off_t)file_bytes); /* never extended by a sector */
            free(model);
            free(disk);
            free(out);
            free(back);
            free(rows);
        }
    }
    close(direct_fd);
    close(fd);
    unlink(path);
    group_end("row_file_direct");
}

int main(void)
{
    test_status();
    test_host_memory();
    test_thread_pool();
    test_dedup();
    test_gather();
    test_grad_reduce();
    test_renorm();
    test_sparse_adam();
    test_sparse_adam_fused();
    test_sparse_update_every_optimizer();
    test_grad_reduce_pooled();
    test_pool_bags();
    test_sparse_update_fused_many();
    test_sparse_update_many();
    test_sparse_update_compact_state();
    test_scratch();
    test_negative_shapes();
    test_table_bounds();
    test_renorm_extremes();
    test_concurrent_callers();
    test_convert();
    test_gather_dtypes();
    test_sparse_update_dtypes();
    test_cache_plan();
    test_cache_window();
    test_cache_trains_bit_identically();
    test_row_file();
    test_row_file_direct();
    /* Joins the workers so that a leak check at exit sees a quiet process. */
    he_set_num_threads(1);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
