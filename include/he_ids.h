/* A read-only view of a batch of ids as torch hands them over: contiguous
 * int64 or int32. Shared by the core (csrc/) and the kernels (cuda/): both
 * report a bad id or a bad table shape with the same messages (ids.c). */
#ifndef HE_IDS_H
#define HE_IDS_H

#include <stdint.h>

#include "he_status.h"

typedef struct he_ids {
    const void *data;
    int64_t count;
    int is_int64; /* else int32 */
} he_ids;

static inline int64_t he_id_at(const he_ids *ids, int64_t i)
{
    return ids->is_int64 ? ((const int64_t *)ids->data)[i] : (int64_t)((const int32_t *)ids->data)[i];
}

/* The IndexError every range check in the core and the kernels reports. */
he_status he_fail_out_of_range(int64_t position, int64_t id, int64_t num_rows);

/* HE_ERR_VALUE unless num_rows >= 0 and dim >= 0: every entry point checks
 * its sizes, since the unsigned range checks would accept any id for a
 * negative num_rows. */
he_status he_check_table_shape(int64_t num_rows, int64_t dim);

#endif
