/* A table as the core's entry points take it: where its rows start, how
 * many bytes the memory they live in has from there, and its shape. The
 * entry points that read or write a table (gather, renorm, SparseAdam)
 * check the shape against those bytes before any work, so a caller that
 * got num_rows or dim wrong gets HE_ERR_VALUE, never a write past the
 * buffer. The binding fills nbytes from the HostBuffer object it is handed
 * (never from a Python-side attribute). */
#ifndef HE_TABLE_H
#define HE_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "he_status.h"

typedef struct he_table {
    float *data;        /* row 0 */
    size_t nbytes;      /* bytes readable and writable from data on */
    int64_t num_rows;
    int64_t dim;        /* floats per row */
    int64_t row_stride; /* floats from one row's start to the next's; >= dim */
} he_table;

/* A row-major table (row_stride = dim) over nbytes bytes at data. */
static inline he_table he_table_contiguous(float *data, size_t nbytes, int64_t num_rows, int64_t dim)
{
    he_table t = {data, nbytes, num_rows, dim, dim};
    return t;
}

/* HE_OK when num_rows >= 0, dim >= 0, row_stride >= dim, data is float
 * aligned and the last row ends within nbytes (((num_rows - 1) * row_stride
 * + dim) floats, computed without overflow); else HE_ERR_VALUE naming
 * `what` (the argument: "table", "exp_avg", ...), the shape and the size. */
he_status he_table_check(const he_table *t, const char *what);

/* 1 when the bytes the two (checked) tables span overlap: from data to the
 * end of the last row. Empty tables overlap nothing. */
int he_table_overlap(const he_table *a, const he_table *b);

/* Row r (no check: r must be in [0, num_rows)). */
static inline float *he_table_row(const he_table *t, int64_t r)
{
    return t->data + r * t->row_stride;
}

#endif
