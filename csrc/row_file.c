#define _GNU_SOURCE
#include "row_file.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A request moves at most this many bytes: big enough that a run of
 * consecutive rows is one request, small enough that one thread's aligned
 * bounce buffer is no burden and the runs spread over the threads. */
#define RUN_MAX_BYTES ((size_t)1 << 20)

static atomic_llong inject_countdown = -1;
static atomic_int inject_errno = 0;

void he_row_file_inject_error(long long after, int error)
{
    atomic_store(&inject_errno, 0);
    atomic_store(&inject_countdown, error ? after : -1);
    atomic_store(&inject_errno, error);
}

static int injected(void)
{
    int error = atomic_load(&inject_errno);
    if (!error)
        return 0;
    if (atomic_fetch_sub(&inject_countdown, 1) != 0)
        return 0;
    atomic_store(&inject_errno, 0);
    return error;
}

/* What one request moves: rows[first .. first + count), whose bytes lie in
 * [lo, hi) of the file. Direct: [lo, hi) is whole sectors, moved through
 * an aligned buffer, and holds every byte of any sector a row of it
 * touches; otherwise the rows are consecutive and [lo, hi) is theirs. */
typedef struct span {
    size_t first, count;
    uint64_t lo, hi;
    int direct;
} span;

typedef struct job {
    const he_row_file *f;
    const int64_t *rows;
    unsigned char *buf; /* the caller's rows, k at buf + k * row_bytes */
    int write;
    const span *spans;
    size_t num_spans;
    atomic_size_t next;
    atomic_int failed;
    pthread_mutex_t lock;
    /* The first failure: what the caller's message names. */
    int error;        /* errno, or 0 for a short transfer */
    int64_t row;      /* the span's first row, or -1: no memory */
    uint64_t offset;  /* where the request started */
    size_t want, got; /* its bytes, and how many moved before it stopped */
} job;

static void record_failure(job *j, int error, int64_t row, uint64_t offset, size_t want, size_t got)
{
    pthread_mutex_lock(&j->lock);
    if (!atomic_load(&j->failed)) {
        j->error = error;
        j->row = row;
        j->offset = offset;
        j->want = want;
        j->got = got;
        atomic_store(&j->failed, 1);
    }
    pthread_mutex_unlock(&j->lock);
}

/* One request: the whole span, retried where the system moved part of it
 * or was interrupted. Returns 0, or -1 with the failure recorded. */
static int transfer(job *j, int fd, int write, unsigned char *mem, size_t bytes, uint64_t offset, int64_t row)
{
    size_t done = 0;
    while (done < bytes) {
        int error = injected();
        ssize_t moved;
        if (error) {
            moved = -1;
            errno = error;
        } else if (write) {
            moved = pwrite(fd, mem + done, bytes - done, (off_t)(offset + done));
        } else {
            moved = pread(fd, mem + done, bytes - done, (off_t)(offset + done));
        }
        if (moved < 0 && errno == EINTR)
            continue;
        if (moved <= 0) {
            record_failure(j, moved < 0 ? errno : 0, row, offset, bytes, done);
            return -1;
        }
        done += (size_t)moved;
    }
    return 0;
}

/* A direct span through the thread's aligned buffer (grown as spans need:
 * rows that share sectors make one span, however long their chain). */
static int move_direct(job *j, const span *s, unsigned char **bounce, size_t *capacity)
{
    const he_row_file *f = j->f;
    size_t bytes = (size_t)(s->hi - s->lo);
    int64_t row = j->rows[s->first];
    if (bytes > *capacity) {
        free(*bounce);
        *bounce = NULL;
        *capacity = 0;
        size_t alignment = f->align > 4096 ? f->align : 4096;
        if (posix_memalign((void **)bounce, alignment, bytes) != 0) {
            *bounce = NULL;
            record_failure(j, ENOMEM, -1, 0, bytes, 0);
            return -1;
        }
        *capacity = bytes;
    }
    /* A write whose rows leave bytes of the span to other rows reads the
     * span first, so those bytes go back as they were. */
    if ((!j->write || s->count * f->row_bytes != bytes) &&
        transfer(j, f->direct_fd, 0, *bounce, bytes, s->lo, row) < 0)
        return -1;
    for (size_t k = s->first; k < s->first + s->count; k++) {
        unsigned char *record = *bounce + (f->offset + (uint64_t)j->rows[k] * f->row_bytes - s->lo);
        unsigned char *mem = j->buf + k * f->row_bytes;
        if (j->write)
            memcpy(record, mem, f->row_bytes);
        else
            memcpy(mem, record, f->row_bytes);
    }
    return j->write ? transfer(j, f->direct_fd, 1, *bounce, bytes, s->lo, row) : 0;
}

static void *worker(void *arg)
{
    job *j = arg;
    const he_row_file *f = j->f;
    unsigned char *bounce = NULL;
    size_t capacity = 0;
    for (;;) {
        if (atomic_load(&j->failed))
            break;
        size_t r = atomic_fetch_add(&j->next, 1);
        if (r >= j->num_spans)
            break;
        const span *s = &j->spans[r];
        int64_t row = j->rows[s->first];
        if (s->direct ? move_direct(j, s, &bounce, &capacity) < 0
                      : transfer(j, f->fd, j->write, j->buf + s->first * f->row_bytes, s->count * f->row_bytes,
                                 s->lo, row) < 0)
            break;
    }
    free(bounce);
    return NULL;
}

/* Spans of rows[from .. to): a row joins the span before it where it
 * shares a sector with it (it must: one request per sector) or starts the
 * sector after its end while the span stays under RUN_MAX_BYTES. With
 * align 1 that is a run of consecutive rows. */
static size_t plan(const he_row_file *f, const int64_t *rows, size_t from, size_t to, uint64_t align, int direct,
                   span *out)
{
    size_t m = 0;
    for (size_t k = from; k < to; k++) {
        uint64_t b0 = f->offset + (uint64_t)rows[k] * f->row_bytes, b1 = b0 + f->row_bytes;
        uint64_t s0 = b0 / align * align, s1 = (b1 + align - 1) / align * align;
        span *last = m ? &out[m - 1] : NULL;
        if (last && (s0 < last->hi || (s0 == last->hi && s1 - last->lo <= RUN_MAX_BYTES))) {
            last->count++;
            if (s1 > last->hi)
                last->hi = s1;
        } else {
            out[m++] = (span){k, 1, s0, s1, direct};
        }
    }
    return m;
}

static he_status check_args(const he_row_file *f, const int64_t *rows, size_t n, const void *buf, const char *what)
{
    if (!f || f->fd < 0 || f->row_bytes == 0 || f->num_rows < 0)
        return he_fail(HE_ERR_VALUE, "%s: needs an open file and rows of at least one byte", what);
    if (n && (!rows || !buf))
        return he_fail(HE_ERR_VALUE, "%s: %zu rows need their ids and a buffer", what, n);
    if (f->direct_fd >= 0 && (f->align == 0 || (f->align & (f->align - 1))))
        return he_fail(HE_ERR_VALUE, "%s: direct I/O needs an alignment that is a power of two, got %zu", what,
                       f->align);
    if (f->row_bytes > RUN_MAX_BYTES)
        return he_fail(HE_ERR_VALUE, "%s: rows of %zu bytes are over the %zu a request moves", what, f->row_bytes,
                       RUN_MAX_BYTES);
    for (size_t k = 0; k < n; k++) {
        if (rows[k] < 0 || rows[k] >= f->num_rows)
            return he_fail(HE_ERR_INDEX, "%s: row %lld is outside the file's %lld rows", what, (long long)rows[k],
                           (long long)f->num_rows);
        if (k && rows[k] <= rows[k - 1])
            return he_fail(HE_ERR_VALUE, "%s: rows must be ascending and distinct, got %lld after %lld", what,
                           (long long)rows[k], (long long)rows[k - 1]);
    }
    return HE_OK;
}

/* A file cut short under an open table is an error before any request: a
 * write would extend it again with holes (rows of zeros). A removed file is
 * one for reads, so training stops, not for writes: its rows live while it
 * is open, and the cache's last rows can still be written there and saved
 * from it; nor for the reads that move them there (read_removed: a records
 * file written back to the tensors' files). */
static he_status check_file(const he_row_file *f, const char *what, int write)
{
    const char *path = f->path ? f->path : "the table file";
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return he_fail(HE_ERR_SYSTEM, "%s %s: %s", what, path, strerror(errno));
    if (sb.st_nlink == 0 && !write && !f->read_removed)
        return he_fail(HE_ERR_SYSTEM, "%s %s: the file was removed while the table was open (its rows live only as "
                       "long as this process); save a checkpoint of the table now", what, path);
    uint64_t need = f->offset + (uint64_t)f->num_rows * f->row_bytes;
    if ((uint64_t)sb.st_size < need)
        return he_fail(HE_ERR_SYSTEM, "%s %s: the file is %llu bytes, the table's %lld rows need %llu: it was "
                       "truncated after the table was opened", what, path, (unsigned long long)sb.st_size,
                       (long long)f->num_rows, (unsigned long long)need);
    return HE_OK;
}

static he_status move_rows(const he_row_file *f, const int64_t *rows, size_t n, unsigned char *buf, int threads,
                           int write)
{
    const char *what = write ? "writing rows to a table file" : "reading rows from a table file";
    he_status st = check_args(f, rows, n, buf, what);
    if (st != HE_OK || n == 0)
        return st;
    st = check_file(f, what, write);
    if (st != HE_OK)
        return st;
    span *spans = malloc(n * sizeof *spans);
    if (!spans)
        return he_fail(HE_ERR_NOMEM, "%s: no memory for %zu requests", what, n);
    /* Direct requests end at the file's last whole sector; the rows past it
     * (a few at most) go through the page cache, first and from this
     * thread, so a direct request over a sector they share comes after
     * them (it writes back the page cache's copy before it reads). */
    size_t tail = 0, num_direct = 0;
    if (f->direct_fd >= 0) {
        tail = n;
        uint64_t direct_end = (f->offset + (uint64_t)f->num_rows * f->row_bytes) / f->align * f->align;
        while (tail > 0 && f->offset + (uint64_t)(rows[tail - 1] + 1) * f->row_bytes > direct_end)
            tail--;
        num_direct = plan(f, rows, 0, tail, f->align, 1, spans);
    }
    size_t num_tail = plan(f, rows, tail, n, 1, 0, spans + num_direct);
    job j = {.f = f, .rows = rows, .buf = buf, .write = write, .spans = spans + num_direct, .num_spans = num_tail};
    atomic_init(&j.next, 0);
    atomic_init(&j.failed, 0);
    pthread_mutex_init(&j.lock, NULL);
    worker(&j);
    j.spans = spans;
    j.num_spans = num_direct;
    atomic_store(&j.next, 0);
    size_t helpers = threads > 1 ? (size_t)threads - 1 : 0;
    if (helpers + 1 > num_direct)
        helpers = num_direct > 1 ? num_direct - 1 : 0;
    pthread_t *ids = helpers && !atomic_load(&j.failed) ? malloc(helpers * sizeof *ids) : NULL;
    size_t started = 0;
    /* Fewer threads than asked (none spare, or no memory for their ids)
     * only means fewer requests in flight: the caller's thread works too. */
    for (; ids && started < helpers; started++)
        if (pthread_create(&ids[started], NULL, worker, &j) != 0)
            break;
    worker(&j);
    for (size_t t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
    free(ids);
    free(spans);
    pthread_mutex_destroy(&j.lock);
    if (!atomic_load(&j.failed))
        return HE_OK;
    const char *path = f->path ? f->path : "the table file";
    if (j.row < 0)
        return he_fail(HE_ERR_NOMEM, "%s %s: no memory for an aligned buffer of %zu bytes", what, path, j.want);
    if (j.error == 0)
        return he_fail(HE_ERR_SYSTEM, "%s %s: the file ends %s row %lld (byte %llu; %zu of %zu bytes moved): it "
                       "was truncated after the table was opened", what, path, write ? "before" : "inside",
                       (long long)j.row, (unsigned long long)(j.offset + j.got), j.got, j.want);
    errno = j.error;
    return he_fail(HE_ERR_SYSTEM, "%s %s failed at row %lld (bytes %llu to %llu): %s", what, path, (long long)j.row,
                   (unsigned long long)j.offset, (unsigned long long)(j.offset + j.want), strerror(j.error));
}

he_status he_row_file_read(const he_row_file *f, const int64_t *rows, size_t n, void *dst, int threads)
{
    return move_rows(f, rows, n, dst, threads, 0);
}

he_status he_row_file_write(const he_row_file *f, const int64_t *rows, size_t n, const void *src, int threads)
{
    /* Written from, never to: the cast keeps one loop for both directions. */
    return move_rows(f, rows, n, (unsigned char *)(uintptr_t)src, threads, 1);
}
