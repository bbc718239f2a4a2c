/* Forward lookup: out[i, :] = table[ids[i], :]. */
#ifndef HE_GATHER_H
#define HE_GATHER_H

#include <stdint.h>

#include "ids.h"
#include "table.h"

/* out: [ids->count, table->dim] elements of the table's dtype, row-major
 * (a byte copy of each row, whatever the dtype). Fails with HE_ERR_VALUE
 * for a table whose shape does not fit its buffer (he_table_check), before
 * anything is read; with HE_ERR_INDEX naming the first (lowest position)
 * bad id; only `out` may have been written then, never the table. */
he_status he_gather(const he_table *table, const he_ids *ids, void *out);

#endif
