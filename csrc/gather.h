/* Forward lookup: out[i, :] = table[ids[i], :]. */
#ifndef HE_GATHER_H
#define HE_GATHER_H

#include <stdint.h>

#include "ids.h"

/* Fails with HE_ERR_INDEX naming the first (lowest position) bad id; only
 * `out` may have been written then, never the table. */
he_status he_gather(const float *table, int64_t num_rows, int64_t dim, const he_ids *ids, float *out);

#endif
