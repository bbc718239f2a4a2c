/* max_norm: rescale, in place, every referenced row whose norm exceeds
 * max_norm, as torch.embedding_renorm_ does. */
#ifndef HE_RENORM_H
#define HE_RENORM_H

#include <stdint.h>

#include "dedup.h"

/* Each unique row of d once: if ||row||_p > max_norm then
 * row *= (float)(max_norm / (norm + 1e-7)). norm_type may be any p > 0,
 * 0 (count of non-zeros) or INFINITY (max |x|). */
he_status he_renorm(float *table, int64_t num_rows, int64_t dim, const he_dedup *d, double max_norm,
                    double norm_type);

#endif
