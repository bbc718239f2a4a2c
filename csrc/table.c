#include "table.h"

#include <inttypes.h>

#include "ids.h"
#include "quantize.h"

/* Bytes from data to the end of the last row of a checked table. */
static size_t span_bytes(const he_table *t)
{
    if (t->num_rows <= 0 || t->dim <= 0)
        return 0;
    return ((size_t)(t->num_rows - 1) * (size_t)t->row_stride + (size_t)t->dim) * he_table_elem(t);
}

int he_table_overlap(const he_table *a, const he_table *b)
{
    size_t la = span_bytes(a), lb = span_bytes(b);
    if (la == 0 || lb == 0)
        return 0;
    uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
    if (!(a0 < b0 + lb && b0 < a0 + la))
        return 0;
    /* Interleaved tables (a cache record holds a row and its optimizer
     * state: one stride, each table its own columns) share a span but no
     * element: with the same record size, b's columns fall in one place
     * of each of a's records, after a's row and before the next record. */
    size_t record = (size_t)a->row_stride * he_table_elem(a);
    if (record == 0 || record != (size_t)b->row_stride * he_table_elem(b))
        return 1;
    uintptr_t lo = a0 < b0 ? a0 : b0, hi = a0 < b0 ? b0 : a0;
    const he_table *first = a0 < b0 ? a : b, *second = a0 < b0 ? b : a;
    size_t offset = (size_t)(hi - lo) % record;
    return !(offset >= (size_t)first->dim * he_table_elem(first) &&
             offset + (size_t)second->dim * he_table_elem(second) <= record);
}

static he_status check_rows(const he_table *t, const char *what);

he_status he_table_check(const he_table *t, const char *what)
{
    if (!he_dtype_valid(t->dtype))
        return he_fail(HE_ERR_VALUE, "%s: unknown dtype code %d", what, t->dtype);
    return check_rows(t, what);
}

he_status he_state_table_check(const he_table *t, const char *what)
{
    if (!he_state_dtype_valid(t->dtype))
        return he_fail(HE_ERR_VALUE, "%s: unknown state dtype code %d", what, t->dtype);
    he_status st = check_rows(t, what);
    if (st != HE_OK || !he_dtype_quantized(t->dtype))
        return st;
    int64_t blocks = he_q8_blocks(t->dim);
    if (t->scale_stride < blocks)
        return he_fail(HE_ERR_VALUE, "%s: %" PRId64 " scales a row for rows of %" PRId64 " columns, expected %" PRId64,
                       what, t->scale_stride, t->dim, blocks);
    if (t->num_rows == 0 || blocks == 0)
        return HE_OK;
    uint64_t need = ((uint64_t)(t->num_rows - 1) * (uint64_t)t->scale_stride + (uint64_t)blocks) * sizeof(float);
    if (need > t->scale_nbytes)
        return he_fail(HE_ERR_VALUE, "%s: the scales of a [%" PRId64 ", %" PRId64 "] %s state need %" PRIu64
                       " bytes, but their buffer has %zu", what, t->num_rows, t->dim, he_dtype_name(t->dtype), need,
                       t->scale_nbytes);
    if (t->scale == NULL || (uintptr_t)t->scale % sizeof(float) != 0)
        return he_fail(HE_ERR_VALUE, "%s: its scales must start at a 4-byte aligned address, got %p", what,
                       (void *)t->scale);
    return HE_OK;
}

static he_status check_rows(const he_table *t, const char *what)
{
    he_status st = he_check_table_shape(t->num_rows, t->dim);
    if (st != HE_OK)
        return st;
    const char *type = he_dtype_name(t->dtype);
    size_t elem = he_table_elem(t);
    if (t->row_stride < t->dim)
        return he_fail(HE_ERR_VALUE, "%s: a row stride of %" PRId64 " elements is shorter than a row of %" PRId64,
                       what, t->row_stride, t->dim);
    /* Elements from data to the end of the last row; 0 for an empty table. */
    uint64_t elems = 0;
    if (t->num_rows > 0 && t->dim > 0) {
        uint64_t rows_before_last = (uint64_t)(t->num_rows - 1), stride = (uint64_t)t->row_stride;
        if (stride && rows_before_last > (UINT64_MAX - (uint64_t)t->dim) / stride)
            elems = UINT64_MAX;
        else
            elems = rows_before_last * stride + (uint64_t)t->dim;
    }
    if (elems > (uint64_t)SIZE_MAX / elem || elems * elem > t->nbytes)
        return he_fail(HE_ERR_VALUE,
                       "%s: a [%" PRId64 ", %" PRId64 "] %s table (row stride %" PRId64 ") needs %s%" PRIu64
                       " bytes, but its buffer has %zu",
                       what, t->num_rows, t->dim, type, t->row_stride,
                       elems > (uint64_t)SIZE_MAX / elem ? "more than " : "",
                       elems > (uint64_t)SIZE_MAX / elem ? (uint64_t)SIZE_MAX : elems * (uint64_t)elem, t->nbytes);
    if (elems > 0 && (t->data == NULL || (uintptr_t)t->data % elem != 0))
        return he_fail(HE_ERR_VALUE, "%s: the rows of a %s table must start at a %zu-byte aligned address, got %p",
                       what, type, elem, t->data);
    return HE_OK;
}
