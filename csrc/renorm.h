/* max_norm: rescale, in place, every referenced row whose norm exceeds
 * max_norm, as torch.embedding_renorm_ does. */
#ifndef HE_RENORM_H
#define HE_RENORM_H

#include <stdint.h>

#include "dedup.h"
#include "table.h"

/* Each unique row of d once: if ||row||_p > max_norm then
 * row *= (float)(max_norm / (norm + 1e-7)). norm_type may be any p > 0,
 * 0 (count of non-zeros) or INFINITY (max |x|); the norm is accumulated in
 * double, scaled by the row's largest |x| for p other than 0, 1, 2 and inf
 * so that no p overflows or underflows, and rounded to float. d must have
 * been built for table->num_rows rows, and the table must fit its buffer
 * (he_table_check): HE_ERR_VALUE otherwise, before anything is written. */
he_status he_renorm(const he_table *table, const he_dedup *d, double max_norm, double norm_type);

#endif
