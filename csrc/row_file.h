/* Rows of a table kept in a file on disk: whole rows read and written with
 * explicit pread/pwrite from many threads at once.
 *
 * Why not the kernel's page cache over a mapping: measured on this
 * project's VM (8M x 64 SparseAdam, fused steps of 65,536 Zipf ids), a
 * shared mapping cost 9x the in-memory step even with every page cached,
 * and 430x under a memory limit: rows of a few hundred bytes dirty whole
 * 4 KiB pages, and reclaim writes them back and faults them in again one by
 * one. A disk needs many requests in flight to reach its random-read rate
 * (here 9.8K reads/s at one, 58K at 16), which a page fault never gives.
 *
 * A file opened with O_DIRECT bypasses the page cache (what is read costs
 * only the records' sectors, not memory the budget counts); its offsets,
 * lengths and memory must then be multiples of its alignment. Rows that are
 * not whole sectors move inside the sectors that hold them: a read takes
 * those sectors, a write reads them first where they hold bytes of other
 * rows (read-modify-write). Rows that share a sector are moved by one
 * thread in one request, so no two requests of a call touch one sector. */
#ifndef HE_ROW_FILE_H
#define HE_ROW_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "he_status.h"

typedef struct he_row_file {
    int fd;             /* the file, through the page cache */
    int direct_fd;      /* the same file opened with O_DIRECT, or -1 */
    size_t align;       /* direct_fd's alignment of offsets, lengths and memory: a power of two */
    size_t row_bytes;   /* bytes of one row in the file, > 0 */
    int64_t num_rows;   /* rows the file holds */
    uint64_t offset;    /* the file's byte of row 0 */
    const char *path;   /* named in error messages */
    int read_removed;   /* nonzero: reads of the file after its removal are done, not refused (see check_file) */
} he_row_file;

/* Reads rows[0..n) into dst, row k at dst + k * row_bytes. rows must be
 * ascending and distinct (runs of consecutive rows become one request) and
 * in [0, num_rows). Up to `threads` requests are in flight. A read that
 * ends early (the file was truncated) or fails fails the call with the
 * row, the offset and the system's reason; dst is then partly written. */
he_status he_row_file_read(const he_row_file *f, const int64_t *rows, size_t n, void *dst, int threads);

/* Writes rows[0..n) from src (as he_row_file_read lays them out). On
 * failure, some rows may be written and others not: the caller keeps its
 * copy of every row until the call succeeds. */
he_status he_row_file_write(const he_row_file *f, const int64_t *rows, size_t n, const void *src, int threads);

/* For tests: the `after`-th read or write request from now (0: the next)
 * fails with errno `error`, as a disk would; error 0 turns it off. */
void he_row_file_inject_error(long long after, int error);

#endif
