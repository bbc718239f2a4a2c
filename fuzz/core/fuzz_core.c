/* libFuzzer harness for hostembed's C core (csrc/), no Python.
 *
 * Each input is decoded into one call of an entry point -- dedup, gather,
 * grad_reduce, renorm, SparseAdam or the fused backward + SparseAdam, or a
 * run of the cache planner -- on small random shapes (num_rows
 * < 64, dim < 18, row strides up to dim + 3, buffers exactly as large as
 * the shape needs or a little short), random ids (int32 or int64, in and
 * out of range, repeated, unsorted), random floats (NaN, inf, subnormals,
 * huge and tiny values) and a random thread count (1 to 4). One input in
 * two asks for "big" shapes instead (up to 2048 rows, 3000 ids, ids and
 * floats drawn from a generator the input seeds), big enough for the
 * core's parallel loops to split the work between threads; the result
 * must not depend on that. The result is checked against a naive
 * reference here:
 *   dedup        unique ids ascending and distinct, exactly the batch's
 *                set; offsets/order a permutation grouping every position
 *                under its id in ascending position order;
 *   gather       bit for bit the rows asked for;
 *   grad_reduce  bit for bit the same float sums in the same order
 *                (first row copied, the others added in ascending position
 *                order, each scaled first with scale_grad_by_freq), also
 *                from a float16/bfloat16 gradient (its widening's sums,
 *                rounded with round_sums);
 *   renorm       unreferenced rows untouched, rows under max_norm
 *                untouched, rows over it scaled by one factor to max_norm
 *                (the norm from a long double reference);
 *   SparseAdam   bit for bit the documented float32 update after
 *                coalescing repeated rows; fused: the same update of
 *                grad_reduce's sums (padding_idx, scale_grad_by_freq);
 *   cache plan   a run of batches planned for a small cache, each plan
 *                applied to a model of the slots: every row where the plan
 *                says, no eviction of a row in use (this batch, or the
 *                last one when planned a step ahead), exactly the fetches
 *                of rows the last batch bypassed flagged, the counts
 *                adding up; a batch not ascending, out of range or too big
 *                refused with the planner unchanged;
 * and every refusal is the documented one with nothing written: a table
 * that does not fit its buffer or a bad argument -> HE_ERR_VALUE, an id out
 * of range -> HE_ERR_INDEX naming the first bad position (gather may have
 * written its output, never the table). Buffers are malloc'ed to exactly
 * the size the core is told, so ASan catches any access past them.
 *
 * Build and run: fuzz/core/run.sh SECONDS (clang -fsanitize=fuzzer,address,
 * undefined -ffp-contract=off, linking every csrc/ source). A failed check
 * prints what differed and aborts, so libFuzzer saves the input. */
#define _POSIX_C_SOURCE 200809L

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache_plan.h"
#include "he_cache_policy.h"
#include "convert.h"
#include "dedup.h"
#include "gather.h"
#include "grad_reduce.h"
#include "he_status.h"
#include "ids.h"
#include "renorm.h"
#include "sparse_adam.h"
#include "table.h"
#include "thread_pool.h"

/* ------------------------------------------------------------------------ */
/* Input decoding: reads past the end give zeros.                           */

typedef struct reader {
    const uint8_t *data;
    size_t size, at;
} reader;

static uint8_t u8(reader *r)
{
    return r->at < r->size ? r->data[r->at++] : 0;
}

static uint32_t u32(reader *r)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)u8(r) << (8 * i);
    return v;
}

/* Big mode: shapes still come from the input, the bulk data (ids, floats)
 * from a splitmix64 generator it seeds, so a short input makes a big case. */
static int g_big;
static uint64_t g_state;
static unsigned g_bad_ids; /* big mode: out-of-range ids per 4096 */

static uint64_t prng(void)
{
    uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A byte of bulk data. */
static uint8_t bulk8(reader *r)
{
    return g_big ? (uint8_t)prng() : u8(r);
}

static uint32_t bulk32(reader *r)
{
    return g_big ? (uint32_t)prng() : u32(r);
}

/* A row count: < 64, or < 2048 in big mode; at least `min`. */
static int64_t rows_of(reader *r, int64_t min)
{
    int64_t span = g_big ? 2048 : 64;
    int64_t v = g_big ? (int64_t)(u8(r) | (unsigned)u8(r) << 8) : (int64_t)u8(r);
    return min + v % (span - min);
}

/* A float worth testing: small integers and halves most of the time (so
 * sums are exact and comparisons meaningful), else raw bits (NaN, inf,
 * subnormals), huge or tiny magnitudes. Big mode draws specials rarely. */
static float any_float(reader *r)
{
    uint8_t kind = bulk8(r);
    if (g_big && kind % 64 >= 8)
        kind = 4;
    switch (kind % 8) {
    case 0: {
        uint32_t bits = bulk32(r);
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    case 1: return (float)((int8_t)bulk8(r)) * 1e30f;
    case 2: return (float)((int8_t)bulk8(r)) * 1e-30f;
    case 3: return (float)((int8_t)bulk8(r)) * FLT_TRUE_MIN;
    default: return (float)((int8_t)bulk8(r)) * 0.5f;
    }
}

/* ------------------------------------------------------------------------ */
/* Failures                                                                 */

#define REQUIRE(cond, ...)                                                                   \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "fuzz_core: %s:%d: check failed: %s\n    ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fprintf(stderr, "\n    core's last error: \"%s\"\n", he_last_error());          \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        abort();
    return p;
}

/* Equal bits, or both NaN (a NaN's payload may depend on operand order,
 * which the compiler is free to choose for a commutative operation). */
static int same_float(float a, float b)
{
    uint32_t x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    return x == y || (isnan(a) && isnan(b));
}

static int64_t first_mismatch(const float *a, const float *b, int64_t n)
{
    if (n <= 0 || memcmp(a, b, (size_t)n * sizeof *a) == 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (!same_float(a[i], b[i]))
            return i;
    return -1;
}

/* ------------------------------------------------------------------------ */
/* Shapes, tables, ids                                                      */

typedef struct fz_table {
    he_table t;       /* what the core is told */
    float *mem;       /* malloc'ed to exactly t.nbytes */
    size_t floats;    /* t.nbytes / 4 */
    int fits;         /* the shape fits t.nbytes, as the reference sees it */
} fz_table;

/* Floats from row 0 to the end of the last row. */
static size_t extent(int64_t rows, int64_t dim, int64_t stride)
{
    return rows > 0 && dim > 0 ? (size_t)((rows - 1) * stride + dim) : 0;
}

/* A [rows, dim] table with a stride of dim + 0..3, in a buffer usually of
 * exactly its extent, sometimes a float or a row short, or longer. */
static fz_table make_table(reader *r, int64_t rows, int64_t dim)
{
    fz_table f;
    uint8_t shape = u8(r);
    int64_t stride = dim + (shape & 3);
    size_t need = extent(rows, dim, stride);
    size_t have = need;
    switch ((shape >> 2) & 7) {
    case 0: have = need > 0 ? need - 1 : 0; break;
    case 1: have = need > (size_t)stride ? need - (size_t)stride : 0; break;
    case 2: have = need + 5; break;
    default: break;
    }
    f.floats = have;
    f.mem = xmalloc(have * sizeof(float));
    for (size_t i = 0; i < have; i++)
        f.mem[i] = any_float(r);
    f.t = (he_table){f.mem, have * sizeof(float), rows, dim, stride};
    f.fits = need <= have;
    return f;
}

typedef struct fz_ids {
    he_ids view;
    int64_t *as64; /* the same ids widened */
    int64_t first_bad; /* position of the first id outside [0, num_rows), or -1 */
} fz_ids;

static fz_ids make_ids(reader *r, int64_t num_rows, int64_t max_count)
{
    fz_ids f;
    int64_t count = g_big ? (int64_t)(u8(r) | (unsigned)u8(r) << 8) % (30 * max_count + 1) : u8(r) % (max_count + 1);
    int is_int64 = u8(r) & 1;
    f.as64 = xmalloc((size_t)count * sizeof(int64_t));
    void *data = xmalloc((size_t)count * (is_int64 ? sizeof(int64_t) : sizeof(int32_t)));
    f.first_bad = -1;
    for (int64_t i = 0; i < count; i++) {
        uint8_t kind = bulk8(r);
        if (g_big) /* mostly in range, skewed (hot rows repeat) */
            kind = prng() % 4096 < g_bad_ids ? kind % 7 : 7;
        int64_t id;
        switch (kind % 16) {
        case 0: id = -1; break;
        case 1: id = num_rows; break;
        case 2: id = is_int64 ? INT64_MIN : INT32_MIN; break;
        case 3: id = is_int64 ? INT64_MAX : INT32_MAX; break;
        case 4: id = -(int64_t)bulk8(r); break;
        case 5: id = num_rows + bulk8(r); break;
        case 6: {
            uint64_t hi = bulk32(r), lo = bulk32(r);
            id = is_int64 ? (int64_t)(hi << 32 | lo) : (int64_t)(int32_t)lo;
            break;
        }
        default:
            if (num_rows <= 0)
                id = 0;
            else if (g_big) {
                double u = (double)(prng() >> 11) * 0x1.0p-53;
                id = (int64_t)(u * u * (double)num_rows);
            } else
                id = (int64_t)(u8(r) % (uint64_t)num_rows);
            break;
        }
        if (is_int64)
            ((int64_t *)data)[i] = id;
        else
            ((int32_t *)data)[i] = (int32_t)id;
        f.as64[i] = id;
        if (f.first_bad < 0 && (id < 0 || id >= num_rows))
            f.first_bad = i;
    }
    f.view = (he_ids){data, count, is_int64};
    return f;
}

static void free_ids(fz_ids *f)
{
    free((void *)f->view.data);
    free(f->as64);
}

/* The positions of each id, ascending: pos[start[id] .. start[id + 1])
 * (a counting sort; every id must be in [0, num_rows)). */
static void group_positions(const int64_t *ids, int64_t n, int64_t num_rows, int64_t **start, int64_t **pos)
{
    int64_t *s = calloc((size_t)num_rows + 1, sizeof *s), *p = xmalloc((size_t)n * sizeof *p);
    if (!s)
        abort();
    for (int64_t i = 0; i < n; i++)
        s[ids[i] + 1]++;
    for (int64_t id = 0; id < num_rows; id++)
        s[id + 1] += s[id];
    int64_t *fill = xmalloc(((size_t)num_rows + 1) * sizeof *fill);
    memcpy(fill, s, ((size_t)num_rows + 1) * sizeof *fill);
    for (int64_t i = 0; i < n; i++)
        p[fill[ids[i]]++] = i;
    free(fill);
    *start = s;
    *pos = p;
}

static void require_index_error(he_status st, const fz_ids *ids, int64_t num_rows)
{
    REQUIRE(st == HE_ERR_INDEX, "status %d, want HE_ERR_INDEX for id %" PRId64 " at %" PRId64, (int)st,
            ids->as64[ids->first_bad], ids->first_bad);
    char want[160];
    snprintf(want, sizeof want, "id %" PRId64 " at position %" PRId64 " is not in [0, %" PRId64 ")",
             ids->as64[ids->first_bad], ids->first_bad, num_rows);
    REQUIRE(strstr(he_last_error(), want) != NULL, "message lacks \"%s\"", want);
}

/* ------------------------------------------------------------------------ */
/* dedup                                                                    */

static void check_dedup(const he_dedup *d, const fz_ids *ids, int64_t num_rows)
{
    int64_t n = ids->view.count;
    REQUIRE(d->count == n && d->num_rows == num_rows, "count %" PRId64 " num_rows %" PRId64, d->count, d->num_rows);
    REQUIRE(d->num_unique >= (n > 0) && d->num_unique <= n, "num_unique %" PRId64 " of %" PRId64, d->num_unique, n);
    REQUIRE(d->offsets[0] == 0 && d->offsets[d->num_unique] == n, "offsets span");
    for (int64_t k = 0; k < d->num_unique; k++) {
        REQUIRE(d->unique[k] >= 0 && d->unique[k] < num_rows, "unique[%" PRId64 "] = %" PRId64, k, d->unique[k]);
        REQUIRE(k == 0 || d->unique[k] > d->unique[k - 1], "unique not strictly ascending at %" PRId64, k);
        REQUIRE(d->offsets[k + 1] > d->offsets[k], "empty group %" PRId64, k);
        for (int64_t i = d->offsets[k]; i < d->offsets[k + 1]; i++) {
            uint32_t pos = d->order[i];
            REQUIRE(pos < (uint64_t)n && ids->as64[pos] == d->unique[k], "order[%" PRId64 "] = %u", i, pos);
            REQUIRE(i == d->offsets[k] || pos > d->order[i - 1], "positions of id %" PRId64 " not ascending",
                    d->unique[k]);
        }
    }
    /* Every position once (a permutation): each is in its id's group, the
     * groups are disjoint and their sizes add up to n, so it suffices that
     * every position's id is among the unique ids. */
    for (int64_t i = 0; i < n; i++) {
        int64_t lo = 0, hi = d->num_unique;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (d->unique[mid] < ids->as64[i])
                lo = mid + 1;
            else
                hi = mid;
        }
        REQUIRE(lo < d->num_unique && d->unique[lo] == ids->as64[i], "id %" PRId64 " at %" PRId64 " missing",
                ids->as64[i], i);
    }
}

static void fuzz_dedup(reader *r)
{
    int64_t num_rows = g_big ? rows_of(r, 0) : (int8_t)u8(r); /* negative too */
    fz_ids ids = make_ids(r, num_rows < 0 ? 0 : num_rows, 200);
    he_dedup *d = (he_dedup *)&d; /* must be reset to NULL on failure */
    he_status st = he_dedup_build(&ids.view, num_rows, &d);
    if (num_rows < 0) {
        REQUIRE(st == HE_ERR_VALUE && d == NULL, "negative num_rows: status %d", (int)st);
    } else if (ids.first_bad >= 0) {
        require_index_error(st, &ids, num_rows);
        REQUIRE(d == NULL, "a refused dedup returned a result");
    } else {
        REQUIRE(st == HE_OK && d != NULL, "status %d", (int)st);
        check_dedup(d, &ids, num_rows);
    }
    he_dedup_free(st == HE_OK ? d : NULL);
    free_ids(&ids);
}

/* ------------------------------------------------------------------------ */
/* gather                                                                   */

static void fuzz_gather(reader *r)
{
    int64_t num_rows = rows_of(r, 0), dim = u8(r) % 18;
    fz_table tab = make_table(r, num_rows, dim);
    fz_ids ids = make_ids(r, num_rows, 96);
    int64_t n = ids.view.count;
    float *before = xmalloc(tab.floats * sizeof(float));
    memcpy(before, tab.mem, tab.floats * sizeof(float));
    const float sentinel = -1234.5f;
    float *out = xmalloc((size_t)(n * dim) * sizeof(float));
    for (int64_t i = 0; i < n * dim; i++)
        out[i] = sentinel;

    he_status st = he_gather(&tab.t, &ids.view, out);
    REQUIRE(memcmp(before, tab.mem, tab.floats * sizeof(float)) == 0, "gather wrote the table");
    if (!tab.fits) {
        REQUIRE(st == HE_ERR_VALUE, "a [%" PRId64 ", %" PRId64 "] stride %" PRId64 " table in %zu bytes: status %d",
                num_rows, dim, tab.t.row_stride, tab.t.nbytes, (int)st);
        for (int64_t i = 0; i < n * dim; i++)
            REQUIRE(memcmp(&out[i], &sentinel, sizeof sentinel) == 0, "refused gather wrote out[%" PRId64 "]", i);
    } else if (ids.first_bad >= 0) {
        require_index_error(st, &ids, num_rows);
    } else {
        REQUIRE(st == HE_OK, "status %d", (int)st);
        for (int64_t i = 0; i < n; i++)
            REQUIRE(memcmp(out + i * dim, tab.mem + ids.as64[i] * tab.t.row_stride, (size_t)dim * sizeof(float)) == 0,
                    "row %" PRId64 " (id %" PRId64 ") differs", i, ids.as64[i]);
    }
    free(out);
    free(before);
    free(tab.mem);
    free_ids(&ids);
}

/* ------------------------------------------------------------------------ */
/* grad_reduce                                                              */

static void fuzz_grad_reduce(reader *r)
{
    int64_t num_rows = rows_of(r, 1), dim = u8(r) % 18;
    fz_ids ids = make_ids(r, num_rows, 96);
    for (int64_t i = 0; i < ids.view.count; i++) /* only valid ids reach grad_reduce */
        if (ids.as64[i] < 0 || ids.as64[i] >= num_rows) {
            ids.as64[i] = ((ids.as64[i] % num_rows) + num_rows) % num_rows;
            if (ids.view.is_int64)
                ((int64_t *)ids.view.data)[i] = ids.as64[i];
            else
                ((int32_t *)ids.view.data)[i] = (int32_t)ids.as64[i];
        }
    int64_t n = ids.view.count;
    uint8_t opt = u8(r);
    int64_t padding = (opt & 3) == 0 ? -1 : (opt & 3) == 1 ? (int64_t)(u8(r) % num_rows) : n > 0 ? ids.as64[0] : 0;
    int scale = (opt >> 2) & 1;
    /* Pooled (EmbeddingBag): a gradient row per bag, each position pointing
     * at its bag, with or without a weight; one bag index in range or not. */
    int pooled = (opt >> 3) & 1, weighted = (opt >> 4) & 1, bad_bag = pooled && ((opt >> 5) & 3) == 0 && n > 0;
    int64_t num_bags = pooled ? 1 + u8(r) % 9 : 0;
    int64_t *bag_of = pooled ? xmalloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)) : NULL;
    float *row_weights = weighted ? xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float)) : NULL;
    for (int64_t i = 0; i < n; i++) {
        if (bag_of)
            bag_of[i] = u8(r) % num_bags;
        if (row_weights)
            row_weights[i] = any_float(r);
    }
    if (bad_bag)
        bag_of[u8(r) % n] = (u8(r) & 1) ? num_bags + u8(r) : -1 - (int64_t)u8(r);
    int64_t grad_rows = pooled ? num_bags : n;
    float *grad = xmalloc((size_t)(grad_rows * dim) * sizeof(float));
    for (int64_t i = 0; i < grad_rows * dim; i++)
        grad[i] = any_float(r);
    /* One input in two passes a float16 or bfloat16 gradient (a half
     * table's), rounded from the floats, which then hold its widening: the
     * sums must be the same bits; with round_sums, those sums rounded. */
    int half_dtype = (opt >> 7) ? ((u8(r) & 1) ? HE_F16 : HE_BF16) : HE_F32;
    int round_sums = half_dtype != HE_F32 && (u8(r) & 1);
    uint16_t *grad16 = NULL;
    if (half_dtype != HE_F32) {
        grad16 = xmalloc((size_t)(grad_rows * dim) * sizeof(uint16_t));
        he_row_from_f32(half_dtype, grad, grad16, grad_rows * dim, 0, 0, 0, 0);
        he_row_to_f32(half_dtype, grad16, grad, grad_rows * dim);
    }
    he_dedup *d = NULL;
    REQUIRE(he_dedup_build(&ids.view, num_rows, &d) == HE_OK, "dedup of valid ids");

    /* The reference, from the batch directly. */
    int64_t want_count = 0;
    int64_t *want_idx = xmalloc((size_t)n * sizeof(int64_t));
    float *want_val = xmalloc((size_t)(n * dim) * sizeof(float));
    int64_t *start, *pos;
    group_positions(ids.as64, n, num_rows, &start, &pos);
    for (int64_t id = 0; id < num_rows; id++) {
        int64_t freq = start[id + 1] - start[id];
        if (!freq || id == padding)
            continue;
        float s = (float)(1.0 / (double)freq);
        float *acc = want_val + want_count * dim;
        for (int64_t k = start[id]; k < start[id + 1]; k++) {
            int64_t i = pos[k], src = bag_of ? bag_of[i] : i;
            if (src < 0 || src >= grad_rows)
                src = 0; /* a bad bag: the call must refuse, this reference is not compared */
            for (int64_t j = 0; j < dim; j++) {
                float term = grad[src * dim + j];
                term = row_weights ? term * row_weights[i] : term;
                term = scale ? term * s : term;
                acc[j] = k == start[id] ? term : acc[j] + term;
            }
        }
        want_idx[want_count++] = id;
    }
    free(start);
    free(pos);

    float *values = xmalloc((size_t)(want_count * dim) * sizeof(float));
    int64_t *indices = xmalloc((size_t)want_count * sizeof(int64_t));
    int64_t count = -7;
    he_reduce_opts opts = {padding, scale, bag_of, row_weights, num_bags, half_dtype, round_sums};
    const void *grad_in = grad16 ? (const void *)grad16 : (const void *)grad;
    if (bad_bag) {
        for (int64_t i = 0; i < want_count * dim; i++)
            values[i] = 7.0f;
        REQUIRE(he_grad_reduce(d, grad_in, dim, &opts, values, indices, &count) == HE_ERR_INDEX,
                "a bag index out of range must be refused");
        REQUIRE(count == -7, "a refused reduce set the count");
        for (int64_t i = 0; i < want_count * dim; i++)
            REQUIRE(values[i] == 7.0f, "a refused reduce wrote value %" PRId64, i);
        want_count = count = 0;
    } else {
        REQUIRE(he_grad_reduce(d, grad_in, dim, &opts, values, indices, &count) == HE_OK, "grad_reduce");
        if (round_sums) { /* half sums: widen them, and round the reference */
            uint16_t *sums16 = (uint16_t *)values;
            float *wide = xmalloc((size_t)(count * dim) * sizeof(float));
            he_row_to_f32(half_dtype, sums16, wide, count * dim);
            memcpy(values, wide, (size_t)(count * dim) * sizeof(float));
            free(wide);
            he_round_row_f32(half_dtype, want_val, want_val, want_count * dim);
        }
    }
    REQUIRE(count == want_count, "count %" PRId64 ", want %" PRId64, count, want_count);
    REQUIRE(memcmp(indices, want_idx, (size_t)count * sizeof(int64_t)) == 0, "indices differ");
    int64_t bad = first_mismatch(values, want_val, count * dim);
    REQUIRE(bad < 0, "value %" PRId64 ": %a, want %a", bad, bad >= 0 ? values[bad] : 0.0f,
            bad >= 0 ? want_val[bad] : 0.0f);
    he_dedup_free(d);
    free(values);
    free(indices);
    free(want_idx);
    free(want_val);
    free(grad);
    free(grad16);
    free(bag_of);
    free(row_weights);
    free_ids(&ids);
}

/* ------------------------------------------------------------------------ */
/* renorm                                                                   */

/* ||row||_p in long double, scaled by max|x| so no p over- or underflows;
 * p = 0 counts non-zeros. NaN for a row with a NaN (p not inf, not 0). */
static long double ref_norm(const float *row, int64_t dim, double p)
{
    long double m = 0.0L, acc = 0.0L;
    int has_nan = 0;
    for (int64_t j = 0; j < dim; j++) {
        long double a = fabsl((long double)row[j]);
        has_nan |= isnan(a);
        if (a > m)
            m = a;
        acc += row[j] != 0.0f;
    }
    if (p == 0.0)
        return acc;
    if (isinf(p))
        return m; /* fmax skips NaN, as the core does */
    if (has_nan)
        return NAN;
    if (m == 0.0L || isinf(m))
        return m;
    acc = 0.0L;
    for (int64_t j = 0; j < dim; j++)
        acc += powl(fabsl((long double)row[j]) / m, (long double)p);
    return m * powl(acc, 1.0L / (long double)p);
}

static void fuzz_renorm(reader *r)
{
    static const double ps[] = {0.0, 0.5, 1.0, 2.0, 3.0, 7.0, 300.0, 1e9, INFINITY, 1.5, 0.01, 40.0};
    int64_t num_rows = rows_of(r, 0), dim = u8(r) % 18;
    fz_table tab = make_table(r, num_rows, dim);
    fz_ids ids = make_ids(r, num_rows, 96);
    uint8_t pk = u8(r);
    double p = (pk & 0x80) ? -1.0 : ps[pk % (sizeof ps / sizeof *ps)];
    if (pk == 0x81)
        p = NAN;
    double max_norm;
    uint8_t mk = u8(r);
    switch (mk % 8) {
    case 0: max_norm = 0.0; break;
    case 1: max_norm = 1e-38; break;
    case 2: max_norm = 1e30; break;
    case 3: max_norm = (mk & 0x80) ? NAN : -1.0; break;
    default: max_norm = (double)(u8(r) % 64) * 0.25; break;
    }
    /* Built for this table's size, or (sometimes) for another one. */
    int64_t dedup_rows = (u8(r) % 8 == 0) ? num_rows + 1 : num_rows;
    float *before = xmalloc(tab.floats * sizeof(float));
    memcpy(before, tab.mem, tab.floats * sizeof(float));
    he_dedup *d = NULL;
    if (he_dedup_build(&ids.view, dedup_rows, &d) != HE_OK) {
        REQUIRE(ids.first_bad >= 0 || dedup_rows > num_rows, "dedup refused valid ids");
        goto done;
    }
    he_status st = he_renorm(&tab.t, d, max_norm, p);
    if (!tab.fits || dedup_rows != num_rows || !(p >= 0.0) || !(max_norm >= 0.0)) {
        REQUIRE(st == HE_ERR_VALUE, "status %d for fits %d dedup rows %" PRId64 "/%" PRId64 " p %g max_norm %g",
                (int)st, tab.fits, dedup_rows, num_rows, p, max_norm);
        REQUIRE(memcmp(before, tab.mem, tab.floats * sizeof(float)) == 0, "a refused renorm wrote the table");
        goto done;
    }
    REQUIRE(st == HE_OK, "status %d", (int)st);
    /* Bytes outside the rows (gaps of the stride, the slack at the end)
     * are never written: rows referenced by the batch are checked below,
     * everything else must be as it was. */
    char *referenced = calloc((size_t)(num_rows > 0 ? num_rows : 1), 1);
    for (int64_t k = 0; k < d->num_unique; k++)
        referenced[d->unique[k]] = 1;
    for (size_t i = 0; i < tab.floats; i++) {
        int64_t row = tab.t.row_stride ? (int64_t)i / tab.t.row_stride : 0;
        int in_row = dim > 0 && row < num_rows && (int64_t)i - row * tab.t.row_stride < dim;
        uint32_t was, is;
        memcpy(&was, &before[i], sizeof was);
        memcpy(&is, &tab.mem[i], sizeof is);
        if (!in_row || !referenced[row])
            REQUIRE(was == is, "float %zu (row %" PRId64 ") changed", i, row);
    }
    for (int64_t k = 0; k < d->num_unique; k++) {
        const float *old = before + d->unique[k] * tab.t.row_stride, *now = tab.mem + d->unique[k] * tab.t.row_stride;
        long double norm = ref_norm(old, dim, p);
        float fnorm = (float)norm; /* the core rounds its norm to float */
        /* Decide only away from the boundary: the core's norm may differ
         * from ours by a few units of its last place. */
        long double margin = 1e-5L * (long double)max_norm;
        int over = (long double)fnorm > (long double)max_norm + margin;
        int under = isnan(fnorm) || (long double)fnorm < (long double)max_norm - margin ||
                    (margin == 0.0L && (double)fnorm <= max_norm);
        if (under && !over) {
            for (int64_t j = 0; j < dim; j++)
                REQUIRE(same_float(old[j], now[j]), "row %" PRId64 " (norm %Lg <= max_norm %g, p %g) changed at %" PRId64,
                        d->unique[k], norm, max_norm, p, j);
        } else if (over) {
            /* Every element times one float scale, (float)(max_norm /
             * (norm + 1e-7)) as torch rounds it (a scale below float's
             * range is 0, and a subnormal one has an absolute error of
             * FLT_TRUE_MIN / 2; the core's norm may differ from ours by an
             * ulp, which moves the scale by about as much). */
            float scale = isinf(fnorm) ? 0.0f : (float)(max_norm / ((double)fnorm + 1e-7));
            for (int64_t j = 0; j < dim; j++) {
                double want = (double)old[j] * scale;
                double tol = 1e-5 * fabs(want) + fabs((double)old[j]) * 2.0 * FLT_TRUE_MIN + 2.0 * FLT_TRUE_MIN;
                if (isnan(old[j]) || (isinf(old[j]) && scale == 0.0f)) {
                    REQUIRE(isnan(now[j]), "row %" PRId64 "[%" PRId64 "]: %a * scale is not NaN", d->unique[k], j,
                            old[j]);
                    continue;
                }
                REQUIRE(fabs((double)now[j] - want) <= tol || (isinf(want) && now[j] == (float)want),
                        "row %" PRId64 "[%" PRId64 "] (p %g, norm %Lg, max_norm %g): %a -> %a, want %a",
                        d->unique[k], j, p, norm, max_norm, old[j], now[j], want);
            }
        }
    }
    free(referenced);
done:
    he_dedup_free(d);
    free(before);
    free(tab.mem);
    free_ids(&ids);
}

/* ------------------------------------------------------------------------ */
/* SparseAdam                                                               */

/* The documented update, element by element (-ffp-contract=off). */
static void ref_adam_row(float *w, float *m, float *v, const float *g_row, int64_t dim, const he_adam_params *hp)
{
    const float one_minus_b1 = (float)(1.0 - hp->beta1), one_minus_b2 = (float)(1.0 - hp->beta2);
    const float eps = (float)hp->eps;
    const double bias1 = 1.0 - pow(hp->beta1, (double)hp->step), bias2 = 1.0 - pow(hp->beta2, (double)hp->step);
    const float neg_step = (float)-(hp->lr * sqrt(bias2) / bias1);
    const float sign = hp->maximize ? -1.0f : 1.0f;
    for (int64_t j = 0; j < dim; j++) {
        float g = g_row[j] * sign;
        float m1 = m[j] + (g - m[j]) * one_minus_b1;
        float v1 = v[j] + (g * g - v[j]) * one_minus_b2;
        float denom = sqrtf(v1) + eps;
        m[j] = m1;
        v[j] = v1;
        w[j] = w[j] + (m1 / denom) * neg_step;
    }
}

/* SparseAdam, or with fused the fused backward (he_sparse_adam_fused: the
 * ids' dedup and the output-gradient rows, with padding_idx and
 * scale_grad_by_freq), against the same reference. */
static void fuzz_sparse_adam(reader *r, int fused)
{
    static const double lrs[] = {1e-3, 0.5, 0.0, 10.0};
    static const double betas[][2] = {{0.9, 0.999}, {0.0, 0.0}, {0.5, 0.99}, {0.999999, 0.9}};
    int64_t num_rows = rows_of(r, 0), dim = u8(r) % 18;
    /* Rows wider than the fused pass's column block, now and then. */
    if (fused && dim == 17)
        dim = 250 + u8(r) % 20;
    fz_table w = make_table(r, num_rows, dim), m = make_table(r, num_rows, dim), v = make_table(r, num_rows, dim);
    for (size_t i = 0; i < v.floats; i++) /* a second moment is >= 0 (NaN allowed) */
        v.mem[i] = fabsf(v.mem[i]);
    uint8_t shape = u8(r);
    /* The state's shape unlike the weight's, or the state aliasing it. */
    int wrong_state = shape % 16 == 0 && num_rows > 0, alias = shape % 16 == 1;
    he_table mt = m.t;
    if (wrong_state)
        mt.num_rows--;
    if (alias)
        mt = w.t;
    fz_ids ids = make_ids(r, num_rows, 48);
    int64_t nnz = ids.view.count;
    int64_t *indices = ids.as64;
    float *values = xmalloc((size_t)(nnz * dim) * sizeof(float));
    for (int64_t i = 0; i < nnz * dim; i++)
        values[i] = any_float(r);
    uint8_t hk = u8(r);
    he_adam_params hp = {lrs[hk % 4], betas[(hk >> 2) % 4][0], betas[(hk >> 2) % 4][1], (hk & 16) ? 1e-8 : 0.5,
                         (int64_t)(u8(r) % 5), (hk >> 5) & 1};
    if (hk & 64)
        hp.step = 1 + (int64_t)u32(r); /* far steps */

    float *w0 = xmalloc(w.floats * sizeof(float)), *m0 = xmalloc(m.floats * sizeof(float)),
          *v0 = xmalloc(v.floats * sizeof(float));
    memcpy(w0, w.mem, w.floats * sizeof(float));
    memcpy(m0, m.mem, m.floats * sizeof(float));
    memcpy(v0, v.mem, v.floats * sizeof(float));

    uint8_t fk = fused ? u8(r) : 0;
    int64_t padding = -1;
    int scale = 0, other_rows = 0;
    he_status st;
    he_dedup *d = NULL;
    if (!fused) {
        st = he_sparse_adam(&w.t, &mt, &v.t, indices, values, nnz, &hp);
    } else {
        padding = (fk & 3) == 0 ? -1 : (fk & 3) == 1 && num_rows > 0 ? (int64_t)(u8(r) % num_rows)
                  : nnz > 0 ? indices[0] : -1;
        scale = (fk >> 2) & 1;
        /* A dedup built for another row count (of valid ids: one more row
         * would make an id equal to num_rows valid). */
        other_rows = (fk >> 3) % 8 == 0 && ids.first_bad < 0;
        /* Bad ids never reach the fused pass: the dedup refuses them. */
        st = he_dedup_build(&ids.view, num_rows + other_rows, &d);
        if (st == HE_OK) {
            he_reduce_opts opts = {padding, scale};
            st = he_sparse_adam_fused(d, values, &opts, &w.t, &mt, &v.t, &hp);
        }
    }
    int refused = 1;
    /* The core's order: the three tables, then step, then the indices. */
    int m_fits = alias ? w.fits : m.fits;
    if (fused && ids.first_bad >= 0) {
        require_index_error(st, &ids, num_rows);
    } else if (!w.fits || !m_fits || !v.fits || wrong_state || (alias && num_rows > 0 && dim > 0)) {
        REQUIRE(st == HE_ERR_VALUE, "status %d for fits %d/%d/%d wrong_state %d alias %d", (int)st, w.fits, m_fits,
                v.fits, wrong_state, alias);
    } else if (hp.step < 1) {
        REQUIRE(st == HE_ERR_VALUE, "step %" PRId64 ": status %d", hp.step, (int)st);
    } else if (fused && other_rows) {
        REQUIRE(st == HE_ERR_VALUE, "a dedup of %" PRId64 " rows for a table of %" PRId64 ": status %d",
                num_rows + 1, num_rows, (int)st);
    } else if (ids.first_bad >= 0) {
        require_index_error(st, &ids, num_rows);
    } else {
        REQUIRE(st == HE_OK, "status %d", (int)st);
        refused = 0;
    }
    he_dedup_free(d);
    if (refused) {
        REQUIRE(memcmp(w0, w.mem, w.floats * sizeof(float)) == 0, "a refused step wrote the weight");
        REQUIRE(memcmp(m0, m.mem, m.floats * sizeof(float)) == 0, "a refused step wrote exp_avg");
        REQUIRE(memcmp(v0, v.mem, v.floats * sizeof(float)) == 0, "a refused step wrote exp_avg_sq");
    } else {
        /* The reference on the copies: repeated rows summed first (the
         * first row copied, the others added in position order), unless the
         * indices are strictly ascending (then each row as it is). */
        float *sum = xmalloc((size_t)dim * sizeof(float));
        int64_t *start, *pos;
        group_positions(indices, nnz, num_rows, &start, &pos);
        for (int64_t id = 0; id < num_rows; id++) {
            if (start[id] == start[id + 1] || id == padding)
                continue;
            float s = (float)(1.0 / (double)(start[id + 1] - start[id]));
            for (int64_t k = start[id]; k < start[id + 1]; k++)
                for (int64_t j = 0; j < dim; j++) {
                    float term = scale ? values[pos[k] * dim + j] * s : values[pos[k] * dim + j];
                    sum[j] = k == start[id] ? term : sum[j] + term;
                }
            ref_adam_row(w0 + id * w.t.row_stride, m0 + id * m.t.row_stride, v0 + id * v.t.row_stride, sum, dim, &hp);
        }
        free(start);
        free(pos);
        free(sum);
        int64_t bw = first_mismatch(w.mem, w0, (int64_t)w.floats), bm = first_mismatch(m.mem, m0, (int64_t)m.floats),
                bv = first_mismatch(v.mem, v0, (int64_t)v.floats);
        REQUIRE(bw < 0 && bm < 0 && bv < 0, "w/m/v first differ at %" PRId64 "/%" PRId64 "/%" PRId64 " (dim %" PRId64
                ", strides %" PRId64 "/%" PRId64 "/%" PRId64 ")", bw, bm, bv, dim, w.t.row_stride, m.t.row_stride,
                v.t.row_stride);
    }
    free(w0);
    free(m0);
    free(v0);
    free(values);
    free(w.mem);
    free(m.mem);
    free(v.mem);
    free_ids(&ids);
}

/* ------------------------------------------------------------------------ */
/* The cache planner                                                        */

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void fuzz_cache_plan(reader *r)
{
    /* Big: batches of thousands of distinct rows, for the threaded pass. */
    int64_t num_rows = g_big ? 1 + (int64_t)(u32(r) % 20000u) : rows_of(r, 1);
    int64_t capacity = 1 + (int64_t)(u8(r) % (g_big ? 255 : 16)) * (g_big ? 16 : 1);
    uint8_t flags = u8(r);
    int protect = 1 + (flags & 1);
    int policy = flags & 2 ? HE_CACHE_FREQUENCY : HE_CACHE_CLOCK;
    int batches = 1 + u8(r) % 12;
    he_cache *c = NULL;
    REQUIRE(he_cache_new(num_rows, capacity, protect, policy, &c) == HE_OK, "he_cache_new");
    int64_t *held = xmalloc((size_t)capacity * sizeof *held); /* the model: slot -> row, -1 */
    uint8_t *in_batch = calloc((size_t)num_rows, 1), *in_last = calloc((size_t)num_rows, 1);
    uint8_t *bypassed_last = calloc((size_t)num_rows, 1), *cached = calloc((size_t)num_rows, 1);
    REQUIRE(in_batch && in_last && bypassed_last && cached, "calloc");
    for (int64_t s = 0; s < capacity; s++)
        held[s] = -1;
    int64_t max_count = g_big ? 9000 : 40; /* big: past the threaded pass's grain (4096 rows) */
    int64_t *unique = xmalloc((size_t)max_count * sizeof *unique);
    for (int b = 0; b < batches; b++) {
        int64_t count = (int64_t)((g_big ? bulk32(r) : bulk8(r)) % (uint32_t)(max_count + 1));
        for (int64_t i = 0; i < count; i++)
            unique[i] = (int64_t)(bulk32(r) % (uint32_t)num_rows);
        qsort(unique, (size_t)count, sizeof *unique, cmp_i64);
        int64_t n = 0;
        for (int64_t i = 0; i < count; i++)
            if (n == 0 || unique[i] != unique[n - 1])
                unique[n++] = unique[i];
        /* One batch in eight is spoiled: the planner must refuse it. */
        uint8_t spoil = u8(r) % 32;
        int64_t room = n;
        he_status want = HE_OK;
        if (spoil == 0 && n >= 2) {
            unique[1] = unique[0];
            want = HE_ERR_VALUE;
        } else if (spoil == 1 && n >= 1) {
            unique[n - 1] = num_rows + (int64_t)u8(r);
            want = HE_ERR_INDEX;
        } else if (spoil == 2 && n >= 1) {
            room = n - 1;
            want = HE_ERR_VALUE;
        } else if (spoil == 3 && n >= 1) {
            unique[0] = -1 - (int64_t)u8(r);
            want = HE_ERR_INDEX;
        }
        he_cache_plan plan;
        REQUIRE(he_cache_plan_init(&plan, room) == HE_OK, "plan init");
        he_cache_stats before = he_cache_get_stats(c);
        he_status st = he_cache_plan_batch(c, unique, n, &plan);
        REQUIRE(st == want, "batch %d: status %d, want %d", b, (int)st, (int)want);
        if (st != HE_OK) {
            he_cache_stats after = he_cache_get_stats(c);
            REQUIRE(memcmp(&before, &after, sizeof before) == 0, "a refused batch changed the counts");
            for (int64_t s = 0; s < capacity; s++)
                REQUIRE(he_cache_row_of(c, (int32_t)s) == held[s], "a refused batch changed slot %" PRId64, s);
            he_cache_plan_free(&plan);
            continue;
        }
        for (int64_t k = 0; k < n; k++)
            in_batch[unique[k]] = 1;
        for (int64_t e = 0; e < plan.num_evict; e++) {
            int64_t slot = plan.evict_slot[e], row = plan.evict_row[e];
            REQUIRE(slot >= 0 && slot < capacity && held[slot] == row && row >= 0, "eviction %" PRId64, e);
            REQUIRE(!in_batch[row] && !(protect == 2 && in_last[row]), "evicted row %" PRId64 " is in use", row);
            held[slot] = -1;
            cached[row] = 0;
        }
        for (int64_t f = 0; f < plan.num_fetch; f++) {
            int64_t slot = plan.fetch_slot[f], row = plan.fetch_row[f];
            REQUIRE(slot >= 0 && slot < capacity && held[slot] == -1 && !cached[row] && in_batch[row],
                    "fetch %" PRId64 ": row %" PRId64 " into slot %" PRId64, f, row, slot);
            REQUIRE(f == 0 || plan.fetch_row[f - 1] < row, "fetches not ascending");
            REQUIRE(plan.fetch_after_update[f] == bypassed_last[row], "fetch of row %" PRId64 " flagged %d", row,
                    plan.fetch_after_update[f]);
            held[slot] = row;
            cached[row] = 1;
        }
        int64_t hits = 0, bypassed = 0;
        memset(bypassed_last, 0, (size_t)num_rows);
        for (int64_t k = 0; k < n; k++) {
            int32_t slot = plan.slot[k];
            if (slot < 0) {
                REQUIRE(!cached[unique[k]], "row %" PRId64 " bypassed while cached", unique[k]);
                bypassed_last[unique[k]] = 1;
                bypassed++;
            } else {
                REQUIRE(slot < capacity && held[slot] == unique[k], "row %" PRId64 " not in its slot", unique[k]);
            }
        }
        he_cache_stats after = he_cache_get_stats(c);
        hits = after.hits - before.hits;
        REQUIRE(hits + (after.fetches - before.fetches) + bypassed == n && after.bypassed - before.bypassed == bypassed,
                "counts: %" PRId64 " hits, %" PRId64 " bypassed of %" PRId64, hits, bypassed, n);
        for (int64_t s = 0; s < capacity; s++)
            REQUIRE(he_cache_row_of(c, (int32_t)s) == held[s], "slot %" PRId64 " holds another row", s);
        memset(in_last, 0, (size_t)num_rows);
        for (int64_t k = 0; k < n; k++) {
            in_last[unique[k]] = 1;
            in_batch[unique[k]] = 0;
        }
        he_cache_plan_free(&plan);
    }
    for (int64_t row = 0; row < num_rows; row++) {
        int32_t slot = he_cache_slot_of(c, row);
        REQUIRE(cached[row] ? slot >= 0 && held[slot] == row : slot == -1, "row %" PRId64 "'s slot", row);
    }
    he_cache_free(c);
    free(held);
    free(in_batch);
    free(in_last);
    free(bypassed_last);
    free(cached);
    free(unique);
}

/* ------------------------------------------------------------------------ */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size, 0};
    uint8_t head = u8(&r), mode = u8(&r);
    g_big = (mode & 3) == 1; /* one input in four */
    g_bad_ids = g_big && (mode >> 2) % 4 == 0 ? 1u + u8(&r) : 0u; /* a few bad ids, in one big input in four */
    g_state = g_big ? u32(&r) : 0;
    /* The thread count for this input (the pool persists between inputs,
     * so this also exercises resizing it). Small inputs never reach the
     * pool (every loop is within one grain), so only big ones set it:
     * restarting the workers is the costliest thing an input can do. */
    int threads = 1 + (head >> 4) % 4;
    if (g_big && he_get_num_threads() != threads && he_set_num_threads(threads) != HE_OK)
        abort();
    /* The low nibble picks the entry point (the high one, the threads). */
    switch ((head & 0x0F) % 7) {
    case 0: fuzz_dedup(&r); break;
    case 1: fuzz_gather(&r); break;
    case 2: fuzz_grad_reduce(&r); break;
    case 3: fuzz_renorm(&r); break;
    case 4: fuzz_sparse_adam(&r, 0); break;
    case 5: fuzz_sparse_adam(&r, 1); break;
    default: fuzz_cache_plan(&r); break;
    }
    return 0;
}
