#include "table.h"

#include <inttypes.h>

#include "ids.h"

/* Bytes from data to the end of the last row of a checked table. */
static size_t span_bytes(const he_table *t)
{
    if (t->num_rows <= 0 || t->dim <= 0)
        return 0;
    return ((size_t)(t->num_rows - 1) * (size_t)t->row_stride + (size_t)t->dim) * sizeof(float);
}

int he_table_overlap(const he_table *a, const he_table *b)
{
    size_t la = span_bytes(a), lb = span_bytes(b);
    if (la == 0 || lb == 0)
        return 0;
    uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
    return a0 < b0 + lb && b0 < a0 + la;
}

he_status he_table_check(const he_table *t, const char *what)
{
    he_status st = he_check_table_shape(t->num_rows, t->dim);
    if (st != HE_OK)
        return st;
    if (t->row_stride < t->dim)
        return he_fail(HE_ERR_VALUE, "%s: a row stride of %" PRId64 " floats is shorter than a row of %" PRId64,
                       what, t->row_stride, t->dim);
    /* Floats from data to the end of the last row; 0 for an empty table. */
    uint64_t floats = 0;
    if (t->num_rows > 0 && t->dim > 0) {
        uint64_t rows_before_last = (uint64_t)(t->num_rows - 1), stride = (uint64_t)t->row_stride;
        if (stride && rows_before_last > (UINT64_MAX - (uint64_t)t->dim) / stride)
            floats = UINT64_MAX;
        else
            floats = rows_before_last * stride + (uint64_t)t->dim;
    }
    if (floats > (uint64_t)SIZE_MAX / sizeof(float) || floats * sizeof(float) > t->nbytes)
        return he_fail(HE_ERR_VALUE,
                       "%s: a [%" PRId64 ", %" PRId64 "] float32 table (row stride %" PRId64 ") needs %s%" PRIu64
                       " bytes, but its buffer has %zu",
                       what, t->num_rows, t->dim, t->row_stride,
                       floats > (uint64_t)SIZE_MAX / sizeof(float) ? "more than " : "",
                       floats > (uint64_t)SIZE_MAX / sizeof(float) ? (uint64_t)SIZE_MAX
                                                                    : floats * (uint64_t)sizeof(float),
                       t->nbytes);
    if (floats > 0 && (t->data == NULL || (uintptr_t)t->data % sizeof(float) != 0))
        return he_fail(HE_ERR_VALUE, "%s: the rows of a float32 table must start at a 4-byte aligned address, got %p",
                       what, (void *)t->data);
    return HE_OK;
}
