#include "dedup.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "host_memory.h"

/* 11-bit digits: 2048 counters fit in L1, and a 2M-row table (21 bits)
 * needs two passes. */
#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)

static int bit_width(uint64_t x)
{
    int bits = 0;
    while (x) {
        bits++;
        x >>= 1;
    }
    return bits;
}

/* The sort's arrays are he_temps: every step sorts a batch of the same
 * size, and malloc would map them afresh (host_memory.h). */
struct he_dedup_memory {
    he_temp arrays; /* unique, offsets, then order */
};

void he_dedup_free(he_dedup *d)
{
    if (!d)
        return;
    if (d->memory) {
        he_temp_free(&d->memory->arrays);
        free(d->memory);
    }
    free(d);
}

/* LSD radix sort of (key, position) pairs. Stable, and positions start in
 * ascending order, so equal keys keep their positions ascending. The sorted
 * result ends in (*keys, *pos); the other two arrays are scratch. */
static void radix_sort(uint64_t **keys, uint32_t **pos, uint64_t **keys_tmp, uint32_t **pos_tmp,
                       int64_t n, int key_bits)
{
    int64_t counts[RADIX_SIZE];
    for (int shift = 0; shift < key_bits; shift += RADIX_BITS) {
        uint64_t *src_k = *keys, *dst_k = *keys_tmp;
        uint32_t *src_p = *pos, *dst_p = *pos_tmp;
        memset(counts, 0, sizeof counts);
        for (int64_t i = 0; i < n; i++)
            counts[(src_k[i] >> shift) & (RADIX_SIZE - 1)]++;
        int64_t sum = 0;
        for (int b = 0; b < RADIX_SIZE; b++) {
            int64_t c = counts[b];
            counts[b] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t at = counts[(src_k[i] >> shift) & (RADIX_SIZE - 1)]++;
            dst_k[at] = src_k[i];
            dst_p[at] = src_p[i];
        }
        *keys = dst_k;
        *keys_tmp = src_k;
        *pos = dst_p;
        *pos_tmp = src_p;
    }
}

he_status he_dedup_build(const he_ids *ids, int64_t num_rows, he_dedup **out)
{
    he_status st = HE_OK;
    int64_t n = ids->count;
    he_temp sort = {NULL, 0};
    he_dedup *d = NULL;
    *out = NULL;

    st = he_check_table_shape(num_rows, 0);
    if (st != HE_OK)
        goto done;
    if (n < 0 || (uint64_t)n > UINT32_MAX) {
        st = he_fail(HE_ERR_VALUE, "a batch may hold at most %" PRIu32 " ids, got %" PRId64,
                     UINT32_MAX, n);
        goto done;
    }
    int64_t bad = he_first_out_of_range(ids, 0, n, num_rows);
    if (bad >= 0) {
        st = he_fail_out_of_range(bad, he_id_at(ids, bad), num_rows);
        goto done;
    }
    size_t alloc_n = n > 0 ? (size_t)n : 1;
    d = calloc(1, sizeof *d);
    if (d)
        d->memory = calloc(1, sizeof *d->memory);
    if (!d || !d->memory) {
        st = he_fail(HE_ERR_NOMEM, "could not allocate a sort of %" PRId64 " ids", n);
        goto done;
    }
    /* The sort's scratch: keys and their copy, positions' copy. The
     * result: unique and offsets (at most n and n + 1), then order: the
     * int64 arrays first, so every array stays aligned. */
    if ((st = he_temp_alloc(&sort, alloc_n * (2 * sizeof(uint64_t) + sizeof(uint32_t)))) != HE_OK ||
        (st = he_temp_alloc(&d->memory->arrays, (2 * alloc_n + 1) * sizeof(int64_t) + alloc_n * sizeof(uint32_t))) !=
            HE_OK)
        goto done;
    uint64_t *keys = sort.ptr, *keys_tmp = keys + alloc_n;
    uint32_t *pos_tmp = (uint32_t *)(keys_tmp + alloc_n);
    d->unique = d->memory->arrays.ptr;
    d->offsets = d->unique + alloc_n;
    d->order = (uint32_t *)(d->offsets + alloc_n + 1);
    uint32_t *pos = d->order;
    for (int64_t i = 0; i < n; i++) {
        keys[i] = (uint64_t)he_id_at(ids, i);
        pos[i] = (uint32_t)i;
    }
    radix_sort(&keys, &pos, &keys_tmp, &pos_tmp, n, bit_width(num_rows > 0 ? (uint64_t)(num_rows - 1) : 0));
    /* The sorted positions may have ended in the scratch array. */
    if (pos != d->order)
        memcpy(d->order, pos, (size_t)n * sizeof *pos);

    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || keys[i] != keys[i - 1]) {
            d->unique[u] = (int64_t)keys[i];
            d->offsets[u] = i;
            u++;
        }
    }
    d->offsets[u] = n;
    d->num_rows = num_rows;
    d->count = n;
    d->num_unique = u;

done:
    he_temp_free(&sort);
    if (st == HE_OK)
        *out = d;
    else
        he_dedup_free(d);
    return st;
}

void he_dedup_export(const he_dedup *d, int64_t *unique, int64_t *inverse)
{
    for (int64_t k = 0; k < d->num_unique; k++) {
        unique[k] = d->unique[k];
        for (int64_t p = d->offsets[k]; p < d->offsets[k + 1]; p++)
            inverse[d->order[p]] = k;
    }
}
