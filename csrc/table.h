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

#include "he_dtype.h"
#include "he_status.h"

typedef struct he_table {
    void *data;         /* row 0 */
    size_t nbytes;      /* bytes readable and writable from data on */
    int64_t num_rows;
    int64_t dim;        /* elements per row */
    int64_t row_stride; /* elements from one row's start to the next's; >= dim */
    int dtype;          /* he_dtype (an optimizer state: any he_state_dtype) */
    /* 8-bit state (HE_Q8, HE_Q8_NONNEG) only: row r's scale of block b
     * (quantize.h) at scale[r * scale_stride + b]. */
    float *scale;
    size_t scale_nbytes;
    int64_t scale_stride;
} he_table;

/* A row-major (row_stride = dim) table of `dtype` over nbytes bytes at data. */
static inline he_table he_table_typed(void *data, size_t nbytes, int64_t num_rows, int64_t dim, int dtype)
{
    he_table t = {data, nbytes, num_rows, dim, dim, dtype};
    return t;
}

/* A row-major float32 table over nbytes bytes at data. */
static inline he_table he_table_contiguous(float *data, size_t nbytes, int64_t num_rows, int64_t dim)
{
    return he_table_typed(data, nbytes, num_rows, dim, HE_F32);
}

/* HE_OK when the dtype is known, num_rows >= 0, dim >= 0, row_stride >=
 * dim, data is aligned to the element size and the last row ends within
 * nbytes (((num_rows - 1) * row_stride + dim) elements, computed without
 * overflow); else HE_ERR_VALUE naming `what` (the argument: "table",
 * "exp_avg", ...), the shape and the size. */
he_status he_table_check(const he_table *t, const char *what);

/* he_table_check of an optimizer state, whose dtype may also be an 8-bit
 * form: its scales then must fit their buffer ([num_rows, scale_stride]
 * floats, scale_stride >= he_q8_blocks(dim)), aligned. */
he_status he_state_table_check(const he_table *t, const char *what);

/* 1 when the two (checked) tables may share an element: their spans (from
 * data to the end of the last row) overlap, unless they interleave, each
 * in its own columns of records of one size (a cache record's row and
 * optimizer state). Empty tables overlap nothing. */
int he_table_overlap(const he_table *a, const he_table *b);

static inline size_t he_table_elem(const he_table *t)
{
    return he_dtype_size(t->dtype);
}

/* Row r (no check: r must be in [0, num_rows)). */
static inline void *he_table_row(const he_table *t, int64_t r)
{
    return (char *)t->data + (size_t)r * (size_t)t->row_stride * he_table_elem(t);
}

#endif
