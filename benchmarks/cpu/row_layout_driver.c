/* The core's SparseAdam update of one table, its weight and state laid out
 * two ways in host memory, timed in alternating rounds in one process:
 *   separate: the weight and each state tensor an array of its own (and an
 *             8-bit state's scales one more), as host tables keep them;
 *   records:  one array of records, a row's weight, moments and scales side
 *             by side, each field a strided table (he_table.row_stride).
 * Built and run by row_layout.py (which prints the table and writes JSON);
 * prints one JSON object: each layout's seconds a round.
 *
 * usage: row_layout_driver ROWS DIM NNZ ROUNDS FORM   (FORM: float32 | int8) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "host_memory.h"
#include "quantize.h"
#include "sparse_update.h"
#include "thread_pool.h"

typedef struct layout {
    he_table w, s[2];
} layout;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t draw_state = 0x9E3779B97F4A7C15ull;

static uint64_t draw(void)
{
    draw_state ^= draw_state << 13;
    draw_state ^= draw_state >> 7;
    draw_state ^= draw_state << 17;
    return draw_state;
}

static void *alloc_or_die(size_t bytes)
{
    void *p = NULL;
    if (he_host_alloc(bytes, &p) != HE_OK) {
        fprintf(stderr, "allocating %zu bytes: %s\n", bytes, he_last_error());
        exit(2);
    }
    return p;
}

/* Moment k (0: Adam's exp_avg, 1: exp_avg_sq): codes from `codes`, a row
 * every `stride` bytes; an 8-bit moment's scale of row r at scales[r *
 * scale_stride] (floats). */
static he_table moment(int k, int q8, char *codes, size_t nbytes, int64_t rows, int64_t dim, size_t stride,
                       float *scales, size_t scale_nbytes, int64_t scale_stride)
{
    he_table t = he_table_typed(codes, nbytes, rows, dim, q8 ? (k ? HE_Q8_NONNEG : HE_Q8) : HE_F32);
    t.row_stride = (int64_t)(stride / (q8 ? 1 : 4));
    if (q8) {
        t.scale = scales;
        t.scale_nbytes = scale_nbytes;
        t.scale_stride = scale_stride;
    }
    return t;
}

/* Whether every row's weight, codes and scales are equal in both layouts. */
static int same_bits(const layout *a, const layout *b)
{
    for (int64_t r = 0; r < a->w.num_rows; r++) {
        if (memcmp(he_table_row(&a->w, r), he_table_row(&b->w, r), (size_t)a->w.dim * 4))
            return 0;
        for (int k = 0; k < 2; k++) {
            const he_table *x = &a->s[k], *y = &b->s[k];
            if (memcmp(he_table_row(x, r), he_table_row(y, r), (size_t)x->dim * he_table_elem(x)))
                return 0;
            if (x->scale && memcmp(&x->scale[r * x->scale_stride], &y->scale[r * y->scale_stride], sizeof(float)))
                return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s ROWS DIM NNZ ROUNDS float32|int8\n", argv[0]);
        return 2;
    }
    int64_t rows = atoll(argv[1]), dim = atoll(argv[2]), nnz = atoll(argv[3]);
    int rounds = atoi(argv[4]), q8 = strcmp(argv[5], "int8") == 0;
    if (dim > HE_Q8_BLOCK && q8) {
        fprintf(stderr, "the driver lays out one 8-bit block a row (dim <= %d)\n", HE_Q8_BLOCK);
        return 2;
    }
    size_t wbytes = (size_t)dim * 4, cbytes = (size_t)dim * (q8 ? 1 : 4);
    /* A record: weight, both moments' codes, both scales; fields 8-byte aligned. */
    size_t record = wbytes + 2 * ((cbytes + 7) / 8 * 8) + (q8 ? 8 : 0);

    layout sep, rec;
    size_t wn = (size_t)rows * wbytes, cn = (size_t)rows * cbytes, sn = (size_t)rows * sizeof(float);
    sep.w = he_table_typed(alloc_or_die(wn), wn, rows, dim, HE_F32);
    for (int k = 0; k < 2; k++)
        sep.s[k] = moment(k, q8, alloc_or_die(cn), cn, rows, dim, cbytes, q8 ? alloc_or_die(sn) : NULL, sn, 1);
    size_t rn = (size_t)rows * record, field = (cbytes + 7) / 8 * 8;
    char *records = alloc_or_die(rn);
    rec.w = he_table_typed(records, rn, rows, dim, HE_F32);
    rec.w.row_stride = (int64_t)(record / 4);
    for (int k = 0; k < 2; k++) {
        size_t code_at = wbytes + (size_t)k * field, scale_at = wbytes + 2 * field + (size_t)k * 4;
        rec.s[k] = moment(k, q8, records + code_at, rn - code_at, rows, dim, record, (float *)(records + scale_at),
                          rn - scale_at, (int64_t)(record / 4));
    }

    float *values = malloc((size_t)nnz * (size_t)dim * sizeof(float));
    int64_t *indices = malloc((size_t)(nnz > 1 << 16 ? nnz : 1 << 16) * sizeof(int64_t));
    if (!values || !indices)
        return 2;
    for (int64_t i = 0; i < nnz * dim; i++)
        values[i] = (float)((int64_t)(draw() % 2001) - 1000) * 1e-4f;
    he_optim_params hp = {0};
    hp.kind = HE_OPTIM_ADAM;
    hp.lr = 1e-3;
    hp.beta1 = 0.9;
    hp.beta2 = 0.999;
    hp.eps = 1e-8;

    /* Every row's state written once (its pages backed), in both layouts. */
    layout *both[2] = {&sep, &rec};
    for (int l = 0; l < 2; l++)
        for (int64_t start = 0; start < rows; start += nnz) {
            int64_t n = start + nnz <= rows ? nnz : rows - start;
            for (int64_t i = 0; i < n; i++)
                indices[i] = start + i;
            hp.step = 1;
            if (he_sparse_update(&hp, &both[l]->w, both[l]->s, 2, indices, values, HE_F32, n) != HE_OK) {
                fprintf(stderr, "update: %s\n", he_last_error());
                return 1;
            }
        }
    printf("{\"form\": \"%s\", \"rows\": %lld, \"dim\": %lld, \"nnz\": %lld, \"record_bytes\": %zu, "
           "\"threads\": %d, \"separate_s\": [",
           argv[5], (long long)rows, (long long)dim, (long long)nnz, record, he_get_num_threads());
    double *times[2] = {malloc(sizeof(double) * (size_t)rounds), malloc(sizeof(double) * (size_t)rounds)};
    for (int r = 0; r < rounds; r++) {
        /* Rows at random (uniform): each a DRAM miss, as a large table's
         * are; the same for both layouts, which then hold the same bits. */
        for (int64_t i = 0; i < nnz; i++)
            indices[i] = (int64_t)(draw() % (uint64_t)rows);
        for (int l = 0; l < 2; l++) {
            hp.step = r + 2;
            double t0 = now();
            he_status st = he_sparse_update(&hp, &both[l]->w, both[l]->s, 2, indices, values, HE_F32, nnz);
            times[l][r] = now() - t0;
            if (st != HE_OK) {
                fprintf(stderr, "update: %s\n", he_last_error());
                return 1;
            }
        }
    }
    for (int l = 0; l < 2; l++) {
        for (int r = 0; r < rounds; r++)
            printf("%s%.6f", r ? ", " : "", times[l][r]);
        printf(l == 0 ? "], \"records_s\": [" : "], ");
    }
    /* Whether the tables got huge pages (a fragmented host gives fewer, and
     * random rows then miss the TLB too): the figures depend on it. */
    long long huge_kib = -1;
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lld kB", &huge_kib) == 1)
            break;
    if (f)
        fclose(f);
    printf("\"anon_huge_bytes\": %lld, \"table_bytes\": %zu, \"same_bits\": %s}\n",
           huge_kib < 0 ? -1 : huge_kib * 1024, wn + 2 * cn + (q8 ? 2 * sn : 0) + rn, same_bits(&sep, &rec) ? "true" : "false");
    return 0;
}
