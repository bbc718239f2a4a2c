/* The core's id helpers; the he_ids view itself and the checks the kernels
 * share live in include/he_ids.h. */
#ifndef HE_CORE_IDS_H
#define HE_CORE_IDS_H

#include <stdint.h>

#include "he_ids.h"

/* Position of the first id outside [0, num_rows) in [begin, end), or -1. */
int64_t he_first_out_of_range(const he_ids *ids, int64_t begin, int64_t end, int64_t num_rows);

/* HE_OK when every id is in [0, num_rows), else HE_ERR_INDEX naming the
 * first that is not (the message every lookup gives). */
he_status he_check_ids(const he_ids *ids, int64_t num_rows);

#endif
