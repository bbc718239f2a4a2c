#include "sort_keys.h"

#include <string.h>

/* Least significant byte first, a counting pass a byte; a byte that all
 * keys share moves nothing and is skipped (the planner's keys leave most
 * of their high bits equal). */
void he_sort_keys(uint64_t *keys, uint64_t *tmp, int64_t n)
{
    if (n < 2)
        return;
    uint64_t any = 0, all = ~(uint64_t)0;
    for (int64_t i = 0; i < n; i++) {
        any |= keys[i];
        all &= keys[i];
    }
    uint64_t *from = keys, *to = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        if ((((any ^ all) >> shift) & 0xff) == 0)
            continue;
        int64_t count[257];
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < n; i++)
            count[((from[i] >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++)
            to[count[(from[i] >> shift) & 0xff]++] = from[i];
        uint64_t *t = from;
        from = to;
        to = t;
    }
    if (from != keys)
        memcpy(keys, from, (size_t)n * sizeof *keys);
}

static void swap_keys(uint64_t *a, uint64_t *b)
{
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Quickselect: the pivot is the median of three, so sorted or reversed
 * runs (slots in order) stay linear. */
void he_smallest_keys(uint64_t *keys, uint64_t *tmp, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (k > 0 && k < n && lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < keys[lo])
            swap_keys(&keys[mid], &keys[lo]);
        if (keys[hi] < keys[lo])
            swap_keys(&keys[hi], &keys[lo]);
        if (keys[hi] < keys[mid])
            swap_keys(&keys[hi], &keys[mid]);
        uint64_t pivot = keys[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] < pivot)
                i++;
            while (keys[j] > pivot)
                j--;
            if (i <= j) {
                swap_keys(&keys[i], &keys[j]);
                i++;
                j--;
            }
        }
        /* [lo, j] <= pivot <= [i, hi]; what lies between equals it. */
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
    he_sort_keys(keys, tmp, k < n ? k : n);
}
