#include "ids.h"

#include <inttypes.h>

he_status he_fail_out_of_range(int64_t position, int64_t id, int64_t num_rows)
{
    return he_fail(HE_ERR_INDEX,
                   "index out of range: id %" PRId64 " at position %" PRId64
                   " is not in [0, %" PRId64 ") for a table of %" PRId64 " rows",
                   id, position, num_rows, num_rows);
}

he_status he_check_table_shape(int64_t num_rows, int64_t dim)
{
    if (num_rows < 0 || dim < 0)
        return he_fail(HE_ERR_VALUE, "a table needs num_rows >= 0 and dim >= 0, got %" PRId64 " and %" PRId64,
                       num_rows, dim);
    return HE_OK;
}

int64_t he_first_out_of_range(const he_ids *ids, int64_t begin, int64_t end, int64_t num_rows)
{
    /* One unsigned compare catches negatives too. */
    if (ids->is_int64) {
        const int64_t *d = ids->data;
        for (int64_t i = begin; i < end; i++)
            if ((uint64_t)d[i] >= (uint64_t)num_rows)
                return i;
    } else {
        const int32_t *d = ids->data;
        for (int64_t i = begin; i < end; i++)
            if ((uint64_t)(int64_t)d[i] >= (uint64_t)num_rows)
                return i;
    }
    return -1;
}

he_status he_check_ids(const he_ids *ids, int64_t num_rows)
{
    int64_t bad = he_first_out_of_range(ids, 0, ids->count, num_rows);
    return bad < 0 ? HE_OK : he_fail_out_of_range(bad, he_id_at(ids, bad), num_rows);
}
