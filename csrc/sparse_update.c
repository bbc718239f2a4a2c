#include "sparse_update.h"

#include <stdio.h>

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "quantize.h"
#include "host_memory.h"
#include "ids.h"
#include "optimizers.h"
#include "simd.h"
#include "thread_pool.h"

/* One step of one optimizer on one table: what every row update needs. */
typedef struct update_ctx {
    const he_optim_rule *rule;
    he_optim_consts c;
    he_table w;
    he_table s[HE_OPTIM_MAX_STATE];
    int stochastic;
    uint64_t seed; /* this step's: the same step redone draws the same */
    int compact;   /* some per-element state is not in the compute type */
    int state_stochastic;
    uint64_t state_seed[HE_OPTIM_MAX_STATE];
} update_ctx;

static inline int half_table(const he_table *t)
{
    return t->dtype == HE_F16 || t->dtype == HE_BF16;
}

/* Columns [col, col + n) of row r, blocks of at most HE_REDUCE_BLOCK
 * columns at a time, for a half-precision weight or compact state: each
 * block widened into floats (the 8-bit state with its block's scale),
 * updated, and rounded back (requantized whole: an 8-bit state's blocks
 * start at multiples of HE_Q8_BLOCK, as every caller's column blocks do). */
static void update_blocks(const update_ctx *u, int64_t r, int64_t col, const float *g, int64_t n, float scalar)
{
    _Alignas(64) float wb[HE_REDUCE_BLOCK];
    _Alignas(64) float sb[HE_OPTIM_MAX_STATE][HE_REDUCE_BLOCK];
    size_t elem = he_table_elem(&u->w);
    char *w = (char *)he_table_row(&u->w, r) + (size_t)col * elem;
    for (int64_t b = 0; b < n; b += HE_REDUCE_BLOCK) {
        int64_t m = n - b < HE_REDUCE_BLOCK ? n - b : HE_REDUCE_BLOCK, at = col + b;
        float *wp = wb;
        if (u->w.dtype == HE_F32)
            wp = (float *)w + b;
        else
            he_row_to_f32(u->w.dtype, w + (size_t)b * elem, wb, m);
        float *sp[HE_OPTIM_MAX_STATE] = {NULL, NULL};
        for (int i = 0; i < u->rule->num_state; i++) {
            const he_table *t = &u->s[i];
            char *row = he_table_row(t, r);
            if (u->rule->per_row[i] || t->dtype == HE_F32) {
                sp[i] = (float *)row + (u->rule->per_row[i] ? 0 : at);
                continue;
            }
            sp[i] = sb[i];
            if (he_dtype_quantized(t->dtype))
                he_q8_to_f32(t->dtype, row + at, t->scale[r * t->scale_stride + at / HE_Q8_BLOCK], sb[i], m);
            else
                he_row_to_f32(t->dtype, row + (size_t)at * 2, sb[i], m);
        }
        u->rule->row_f32(&u->c, wp, sp, g + b, m, scalar);
        if (wp == wb)
            he_row_from_f32(u->w.dtype, wb, w + (size_t)b * elem, m, u->stochastic, u->seed, r, at);
        for (int i = 0; i < u->rule->num_state; i++) {
            const he_table *t = &u->s[i];
            if (sp[i] != sb[i])
                continue;
            char *row = he_table_row(t, r);
            if (he_dtype_quantized(t->dtype))
                he_q8_from_f32(t->dtype, sb[i], row + at, &t->scale[r * t->scale_stride + at / HE_Q8_BLOCK], m,
                               u->state_stochastic, u->state_seed[i], r, at);
            else
                he_row_from_f32(t->dtype, sb[i], row + (size_t)at * 2, m, u->state_stochastic, u->state_seed[i], r,
                                at);
        }
    }
}

/* Columns [col, col + n) of row r, from that row's gradient g (in the
 * table's compute type), given the prelude's row scalar. */
static void update_cols(const update_ctx *u, int64_t r, int64_t col, const void *g, int64_t n, double scalar)
{
    if (u->w.dtype == HE_F64) {
        void *s[HE_OPTIM_MAX_STATE] = {NULL, NULL};
        for (int i = 0; i < u->rule->num_state; i++)
            s[i] = (char *)he_table_row(&u->s[i], r) + (u->rule->per_row[i] ? 0 : (size_t)col * sizeof(double));
        u->rule->row_f64(&u->c, (double *)he_table_row(&u->w, r) + col, (double *const *)s, g, n, scalar);
        return;
    }
    if (u->w.dtype == HE_F32 && !u->compact) {
        float *s[HE_OPTIM_MAX_STATE] = {NULL, NULL};
        for (int i = 0; i < u->rule->num_state; i++)
            s[i] = (float *)he_table_row(&u->s[i], r) + (u->rule->per_row[i] ? 0 : col);
        u->rule->row_f32(&u->c, (float *)he_table_row(&u->w, r) + col, s, g, n, (float)scalar);
        return;
    }
    update_blocks(u, r, col, g, n, (float)scalar);
}

/* Row r's update from its gradient: the rule's prelude on the whole row
 * (n == dim when the rule has one: see he_sparse_update_fused), then its
 * columns. */
static inline void update_row(const update_ctx *u, int64_t r, int64_t col, const void *g, int64_t n)
{
    double scalar = 0.0;
    if (u->rule->prelude_f32) {
        void *s[HE_OPTIM_MAX_STATE] = {NULL, NULL};
        for (int i = 0; i < u->rule->num_state; i++)
            s[i] = he_table_row(&u->s[i], r);
        scalar = u->w.dtype == HE_F64 ? u->rule->prelude_f64(&u->c, (double *const *)s, g, n)
                                      : u->rule->prelude_f32(&u->c, (float *const *)s, g, n);
    }
    update_cols(u, r, col, g, n, scalar);
}

/* The row and its state wait on DRAM: asked for a few rows ahead. */
static inline void prefetch_row(const update_ctx *u, int64_t r)
{
    he_prefetch_row(he_table_row(&u->w, r), (size_t)u->w.dim * he_table_elem(&u->w), 1);
    for (int i = 0; i < u->rule->num_state; i++) {
        const he_table *s = &u->s[i];
        he_prefetch_row(he_table_row(s, r), (size_t)s->dim * he_table_elem(s), 1);
        if (s->scale)
            he_prefetch_row(s->scale + r * s->scale_stride, sizeof(float), 1);
    }
}

typedef struct rows_job {
    const update_ctx *u;
    const int64_t *indices;
    const void *values;
    int values_dtype;
} rows_job;

static void rows_range(void *ctx, int64_t begin, int64_t end)
{
    const rows_job *job = ctx;
    const update_ctx *u = job->u;
    int64_t dim = u->w.dim;
    size_t elem = he_dtype_size(job->values_dtype);
    int widen = job->values_dtype != he_compute_dtype(u->w.dtype);
    _Alignas(64) float wide[HE_REDUCE_BLOCK];
    for (int64_t k = begin; k < end; k++) {
        if (k + HE_PREFETCH_AHEAD < end)
            prefetch_row(u, job->indices[k + HE_PREFETCH_AHEAD]);
        const char *g = (const char *)job->values + (size_t)(k * dim) * elem;
        if (!widen) {
            update_row(u, job->indices[k], 0, g, dim);
            continue;
        }
        /* A half table's gradient in its own dtype (weight.grad) widens
         * exactly, a block of columns at a time, as the fused sums come
         * (a rule with a prelude only sees dim <= HE_REDUCE_BLOCK here). */
        for (int64_t col = 0; col < dim; col += HE_REDUCE_BLOCK) {
            int64_t n = dim - col < HE_REDUCE_BLOCK ? dim - col : HE_REDUCE_BLOCK;
            he_row_to_f32(job->values_dtype, g + (size_t)col * elem, wide, n);
            update_row(u, job->indices[k], col, wide, n);
        }
    }
}

/* Rows indices[0..nnz), distinct and in range, gradient rows values of
 * values_dtype (the compute type, or a half table's own dtype). */
static he_status update_rows(const update_ctx *u, const int64_t *indices, const void *values, int values_dtype,
                             int64_t nnz)
{
    int64_t dim = u->w.dim;
    if (dim == 0)
        return HE_OK; /* nothing to update (the indices were checked) */
    rows_job job = {u, indices, values, values_dtype};
    /* Each row: its gradient read, the weight and every state read and written. */
    int64_t bytes = nnz * dim * (int64_t)(he_dtype_size(values_dtype) + 2 * (1 + u->rule->num_state) * 4);
    return he_parallel_for_bytes(nnz, 4096 / dim + 1, bytes, rows_range, &job);
}

/* The fused backward's sink: the rule's row function on the sum's column
 * block (the element-wise rules give the same bits block by block; a rule
 * with a prelude gets whole rows, see he_sparse_update_fused). A
 * half-precision table's unfused gradient (weight.grad) is in the table's
 * dtype, so the sum is rounded to it first: the same bits either way. */
static void fused_apply(const void *ctx, int64_t row, int64_t col, const void *sum, int64_t n)
{
    const update_ctx *u = ctx;
    if (half_table(&u->w)) {
        _Alignas(64) float rounded[HE_REDUCE_BLOCK];
        he_round_row_f32(u->w.dtype, sum, rounded, n);
        update_row(u, row, col, rounded, n);
        return;
    }
    update_row(u, row, col, sum, n);
}

static void fused_prefetch(const void *ctx, int64_t row)
{
    prefetch_row(ctx, row);
}

/* State i of a rule in dtype `state` for a weight of dtype `weight`: the
 * compute type (float64 tables keep only that), or for the per-element
 * state of a float32 or half table, float16, bfloat16 or 8 bits (the
 * fourth-root form for a state that is never negative). */
static he_status check_state_dtype(const he_optim_rule *rule, int i, int weight, int state)
{
    int compute = he_compute_dtype(weight);
    if (state == compute)
        return HE_OK;
    const char *what = rule->state_names[i];
    if (weight == HE_F64)
        return he_fail(HE_ERR_VALUE, "%s's %s of a float64 table must be float64, got %s", rule->name, what,
                       he_dtype_name(state));
    if (rule->per_row[i])
        return he_fail(HE_ERR_VALUE, "%s's %s (one value a row) must be %s, got %s", rule->name, what,
                       he_dtype_name(compute), he_dtype_name(state));
    if (state == HE_Q8_NONNEG && !rule->nonnegative[i])
        return he_fail(HE_ERR_VALUE, "%s's %s takes negative values: it may be int8, not %s", rule->name, what,
                       he_dtype_name(state));
    if (state == HE_F16 || state == HE_BF16 || he_dtype_quantized(state))
        return HE_OK;
    return he_fail(HE_ERR_VALUE, "%s's %s of a %s table must be float32, float16, bfloat16, int8 or uint8 (fourth root), "
                   "got %s", rule->name, what, he_dtype_name(weight), he_dtype_name(state));
}

/* Checks the tables against the rule and each other, and makes the step's
 * scalars. State tables must have memory of their own: the row update
 * reads and writes them through restrict pointers. */
static he_status prepare(const he_optim_params *hp, const he_table *weight, const he_table *state, int num_state,
                         update_ctx *u)
{
    const he_optim_rule *rule = he_optim_rule_of(hp->kind);
    if (!rule)
        return he_fail(HE_ERR_VALUE, "unknown optimizer kind %d", hp->kind);
    if (num_state != rule->num_state)
        return he_fail(HE_ERR_VALUE, "%s keeps %d state tables, got %d", rule->name, rule->num_state, num_state);
    he_status st = he_table_check(weight, "weight");
    if (st != HE_OK)
        return st;
    int compute = he_compute_dtype(weight->dtype);
    u->compact = 0;
    for (int i = 0; i < num_state; i++) {
        const he_table *s = &state[i];
        const char *what = rule->state_names[i];
        if ((st = he_state_table_check(s, what)) != HE_OK)
            return st;
        if ((st = check_state_dtype(rule, i, weight->dtype, s->dtype)) != HE_OK)
            return st;
        u->compact |= s->dtype != compute;
        int64_t dim = rule->per_row[i] ? 1 : weight->dim;
        if (s->num_rows != weight->num_rows || s->dim != dim)
            return he_fail(HE_ERR_VALUE,
                           "%s's %s: a [%" PRId64 ", %" PRId64 "] table for a [%" PRId64 ", %" PRId64
                           "] weight (expected [%" PRId64 ", %" PRId64 "])",
                           rule->name, what, s->num_rows, s->dim, weight->num_rows, weight->dim, weight->num_rows,
                           dim);
        if (he_table_overlap(s, weight))
            return he_fail(HE_ERR_VALUE, "%s's %s overlaps the weight's memory", rule->name, what);
        for (int j = 0; j < i; j++)
            if (he_table_overlap(s, &state[j]))
                return he_fail(HE_ERR_VALUE, "%s's %s and %s overlap", rule->name, rule->state_names[j], what);
        u->s[i] = *s;
    }
    u->rule = rule;
    u->w = *weight;
    if ((st = rule->make_consts(hp, &u->c)) != HE_OK)
        return st;
    u->c.dim = (double)weight->dim;
    u->stochastic = hp->stochastic_rounding && half_table(weight);
    u->seed = hp->seed ^ ((uint64_t)hp->step * 0x9E3779B97F4A7C15ull);
    u->state_stochastic = hp->state_stochastic_rounding;
    for (int i = 0; i < HE_OPTIM_MAX_STATE; i++) /* each state its own draws, none the weight's */
        u->state_seed[i] = he_mix64(u->seed + 0xD1B54A32D192ED03ull * (uint64_t)(i + 1));
    return HE_OK;
}

/* A gradient comes in the table's compute type or, for a half table, in
 * its own dtype (weight.grad and the output gradient are). */
static he_status check_gradient_dtype(const he_table *weight, int dtype)
{
    int compute = he_compute_dtype(weight->dtype);
    if (dtype == compute || dtype == weight->dtype)
        return HE_OK;
    if (weight->dtype == compute)
        return he_fail(HE_ERR_VALUE, "the gradient of a %s table must be %s, got %s", he_dtype_name(weight->dtype),
                       he_dtype_name(compute), he_dtype_name(dtype));
    return he_fail(HE_ERR_VALUE, "the gradient of a %s table must be %s or %s, got %s", he_dtype_name(weight->dtype),
                   he_dtype_name(weight->dtype), he_dtype_name(compute), he_dtype_name(dtype));
}

/* The coalesced gradient of ids with grad rows: ascending unique ids and
 * their sums (each in position order), in new buffers the caller frees. */
static he_status coalesce(const he_dedup *d, const void *grad, int64_t dim, const he_reduce_opts *opts,
                          int64_t **unique_rows, void **sums, int64_t *count)
{
    he_reduce_opts in_compute_type = *opts; /* the sums stay in the compute type here */
    in_compute_type.round_sums = 0;
    opts = &in_compute_type;
    size_t u = (size_t)(d->num_unique > 0 ? d->num_unique : 1), elem = he_dtype_size(he_compute_dtype(opts->dtype));
    *unique_rows = malloc(u * sizeof **unique_rows);
    *sums = malloc(u * (size_t)(dim > 0 ? dim : 1) * elem);
    if (!*unique_rows || !*sums)
        return he_fail(HE_ERR_NOMEM, "could not allocate %zu bytes to coalesce a gradient of %" PRId64 " rows",
                       u * ((size_t)dim * elem + sizeof **unique_rows), d->count);
    return he_grad_reduce(d, grad, dim, opts, *sums, *unique_rows, count);
}

/* he_sparse_update's checks, everything before a row is written: u
 * prepared, *ascending whether the indices are strictly ascending. */
static he_status check_update(const he_optim_params *hp, const he_table *weight, const he_table *state,
                              int num_state, const int64_t *indices, int values_dtype, int64_t nnz, update_ctx *u,
                              int *ascending)
{
    he_status st = prepare(hp, weight, state, num_state, u);
    if (st != HE_OK)
        return st;
    if ((st = check_gradient_dtype(weight, values_dtype)) != HE_OK)
        return st;
    int64_t num_rows = weight->num_rows;
    if (nnz < 0)
        return he_fail(HE_ERR_VALUE, "a gradient needs nnz >= 0, got %" PRId64, nnz);
    *ascending = 1;
    for (int64_t k = 0; k < nnz; k++) {
        if ((uint64_t)indices[k] >= (uint64_t)num_rows)
            return he_fail_out_of_range(k, indices[k], num_rows);
        if (k > 0 && indices[k] <= indices[k - 1])
            *ascending = 0;
    }
    return HE_OK;
}

he_status he_sparse_update(const he_optim_params *hp, const he_table *weight, const he_table *state,
                           int num_state, const int64_t *indices, const void *values, int values_dtype, int64_t nnz)
{
    update_ctx u;
    int ascending = 0;
    he_status st = check_update(hp, weight, state, num_state, indices, values_dtype, nnz, &u, &ascending);
    if (st != HE_OK)
        return st;
    int compute = he_compute_dtype(weight->dtype);
    int64_t num_rows = weight->num_rows;
    /* rows_range widens a half gradient in blocks, too short for a rule
     * that needs a long row whole: that one goes through coalesce, which
     * writes it out widened. */
    int whole_rows = values_dtype != compute && u.rule->prelude_f32 && weight->dim > HE_REDUCE_BLOCK;
    if (ascending && !whole_rows)
        return update_rows(&u, indices, values, values_dtype, nnz);

    he_dedup *d = NULL;
    int64_t *unique_rows = NULL, count = 0;
    void *sums = NULL;
    he_ids ids = {indices, nnz, 1};
    he_reduce_opts no_opts = {-1, 0};
    no_opts.dtype = values_dtype;
    st = he_dedup_build(&ids, num_rows, &d);
    /* A row a position (torch's backward, and hostembed's for float
     * tables): each sum goes straight into its row's update, as a fused
     * backward's does, never to memory. A half table's sums are not
     * rounded here (fused_apply would round them), and a rule with a
     * prelude needs a long row whole: those are written out first. */
    if (st == HE_OK && !half_table(weight) && !(u.rule->prelude_f32 && weight->dim > HE_REDUCE_BLOCK)) {
        he_row_update update = {fused_apply, fused_prefetch, &u};
        st = he_grad_reduce_apply(d, values, weight->dim, &no_opts, &update);
        he_dedup_free(d);
        return st;
    }
    if (st == HE_OK)
        st = coalesce(d, values, weight->dim, &no_opts, &unique_rows, &sums, &count);
    if (st == HE_OK)
        st = update_rows(&u, unique_rows, sums, compute, count);
    he_dedup_free(d);
    free(unique_rows);
    free(sums);
    return st;
}

/* The checks of he_sparse_update_fused, u prepared for its update. */
static he_status prepare_fused(const he_dedup *d, const he_reduce_opts *opts, const he_optim_params *hp,
                               const he_table *weight, const he_table *state, int num_state, update_ctx *u)
{
    he_status st = prepare(hp, weight, state, num_state, u);
    if (st != HE_OK)
        return st;
    /* The ids were range-checked against d->num_rows when it was built. */
    if (d->num_rows != weight->num_rows)
        return he_fail(HE_ERR_VALUE, "the ids were checked against %" PRId64 " rows, the table has %" PRId64,
                       d->num_rows, weight->num_rows);
    return check_gradient_dtype(weight, opts->dtype);
}

he_status he_sparse_update_fused(const he_dedup *d, const void *grad, const he_reduce_opts *opts,
                                 const he_optim_params *hp, const he_table *weight, const he_table *state,
                                 int num_state)
{
    update_ctx u;
    he_status st = prepare_fused(d, opts, hp, weight, state, num_state, &u);
    if (st != HE_OK)
        return st;
    int compute = he_compute_dtype(weight->dtype);
    if (u.rule->prelude_f32 && weight->dim > HE_REDUCE_BLOCK) {
        /* The sums of a long row come in blocks, and this rule needs the
         * whole row first: they go through memory, rounded to a half
         * table's dtype as fused_apply rounds them. */
        int64_t *unique_rows = NULL, count = 0;
        void *sums = NULL;
        st = coalesce(d, grad, weight->dim, opts, &unique_rows, &sums, &count);
        if (st == HE_OK && half_table(weight))
            he_round_row_f32(weight->dtype, sums, sums, count * weight->dim);
        if (st == HE_OK)
            st = update_rows(&u, unique_rows, sums, compute, count);
        free(unique_rows);
        free(sums);
        return st;
    }
    he_row_update update = {fused_apply, fused_prefetch, &u};
    return he_grad_reduce_apply(d, grad, weight->dim, opts, &update);
}

typedef struct many_job {
    const he_fused_update *updates;
    he_status *status;
    char (*why)[256]; /* a failed update's message, from the thread that ran it */
} many_job;

static void run_updates(void *ctx, int64_t begin, int64_t end)
{
    const many_job *job = ctx;
    for (int64_t i = begin; i < end; i++) {
        const he_fused_update *f = &job->updates[i];
        job->status[i] = he_sparse_update_fused(f->d, f->grad, &f->opts, &f->hp, &f->weight, f->state, f->num_state);
        if (job->status[i] != HE_OK)
            snprintf(job->why[i], sizeof job->why[i], "%s", he_last_error());
    }
}

/* A failure of table i of count, its message prefixed with which. */
static he_status name_table(he_status st, int64_t i, int64_t count, const char *message)
{
    char why[512];
    snprintf(why, sizeof why, "%s", message);
    return he_fail(st, "table %" PRId64 " of %" PRId64 ": %s", i, count, why);
}

/* What he_sparse_update_fused_many makes for an update: the sort, when
 * not given, and a bag batch's positions and factors. */
typedef struct made_inputs {
    he_fused_update *work; /* the updates, completed in place */
    he_dedup **dedups;
    he_temp *positions;
    he_status *status;
    char (*why)[256];
} made_inputs;

static he_status make_inputs_of(he_fused_update *f, he_dedup **dedup, he_temp *positions)
{
    const he_bag_batch *b = f->bags;
    he_ids ids = b ? b->ids : f->ids;
    he_status st;
    if (!f->d) {
        if ((st = he_dedup_build(&ids, f->weight.num_rows, dedup)) != HE_OK)
            return st;
        f->d = *dedup;
    }
    if (!b)
        return HE_OK;
    if (b->table.num_rows != f->weight.num_rows || b->table.dim != f->weight.dim || b->table.dtype != f->weight.dtype)
        return he_fail(HE_ERR_VALUE, "a bag batch of a [%" PRId64 ", %" PRId64 "] table for a [%" PRId64 ", %" PRId64
                       "] one", b->table.num_rows, b->table.dim, f->weight.num_rows, f->weight.dim);
    return he_bag_reduce_inputs(b, f->d->count, f->grad_rows, positions, &f->opts);
}

static void make_inputs(void *ctx, int64_t begin, int64_t end)
{
    const made_inputs *job = ctx;
    for (int64_t i = begin; i < end; i++) {
        if (job->work[i].d && !job->work[i].bags)
            continue;
        job->status[i] = make_inputs_of(&job->work[i], &job->dedups[i], &job->positions[i]);
        if (job->status[i] != HE_OK)
            snprintf(job->why[i], sizeof job->why[i], "%s", he_last_error());
    }
}

static he_status first_failure(const he_status *status, char (*why)[256], int64_t count)
{
    for (int64_t i = 0; i < count; i++)
        if (status[i] != HE_OK)
            return count > 1 ? name_table(status[i], i, count, why[i]) : he_fail(status[i], "%s", why[i]);
    return HE_OK;
}

/* Runs fn over tables [0, count): side by side on the threads when every
 * table is small (each then runs on one thread), else one after another,
 * each table's own loop using every thread; then the first table that
 * failed (status, why), named. */
static he_status run_tables(int64_t count, int small, he_range_fn fn, void *job, const he_status *status,
                            char (*why)[256])
{
    he_status st = small ? he_parallel_for(count, 1, fn, job) : HE_OK;
    if (st == HE_OK && !small)
        fn(job, 0, count);
    return st == HE_OK ? first_failure(status, why, count) : st;
}

he_status he_sparse_update_fused_many(const he_fused_update *updates, int64_t count)
{
    if (count < 0)
        return he_fail(HE_ERR_VALUE, "a fused update of %" PRId64 " tables", count);
    size_t n = (size_t)(count > 0 ? count : 1);
    he_fused_update *work = malloc(n * sizeof *work);
    he_dedup **dedups = calloc(n, sizeof *dedups);
    he_temp *positions = calloc(n, sizeof *positions);
    he_status *status = calloc(n, sizeof *status);
    char(*why)[256] = calloc(n, sizeof *why);
    he_status st = HE_OK;
    if (!work || !dedups || !positions || !status || !why) {
        st = he_fail(HE_ERR_NOMEM, "no memory for a fused update of %" PRId64 " tables", count);
        goto done;
    }
    if (count > 0)
        memcpy(work, updates, (size_t)count * sizeof *work);
    /* The sorts first, a table a thread (each sort runs on one). */
    made_inputs made = {work, dedups, positions, status, why};
    if ((st = he_parallel_for(count, 1, make_inputs, &made)) != HE_OK ||
        (st = first_failure(status, why, count)) != HE_OK)
        goto done;
    int small = 1;
    for (int64_t i = 0; i < count; i++) {
        const he_fused_update *f = &work[i];
        update_ctx u;
        st = prepare_fused(f->d, &f->opts, &f->hp, &f->weight, f->state, f->num_state, &u);
        if (st != HE_OK) {
            st = count > 1 ? name_table(st, i, count, he_last_error()) : st;
            goto done;
        }
        /* As grad_reduce counts a job's memory traffic. */
        int64_t bytes = (f->d->count + 3 * f->d->num_unique) * f->weight.dim * (int64_t)he_dtype_size(f->opts.dtype);
        small &= bytes < HE_PARALLEL_MIN_BYTES;
    }
    many_job job = {work, status, why};
    st = run_tables(count, small, run_updates, &job, status, why);
done:
    for (int64_t i = 0; dedups && positions && i < count; i++) {
        he_dedup_free(dedups[i]);
        he_temp_free(&positions[i]);
    }
    free(work);
    free(dedups);
    free(positions);
    free(status);
    free(why);
    return st;
}

typedef struct update_many_job {
    const he_sparse_update_job *jobs;
    he_status *status;
    char (*why)[256];
} update_many_job;

static void run_sparse_updates(void *ctx, int64_t begin, int64_t end)
{
    const update_many_job *job = ctx;
    for (int64_t i = begin; i < end; i++) {
        const he_sparse_update_job *j = &job->jobs[i];
        job->status[i] = he_sparse_update(&j->hp, &j->weight, j->state, j->num_state, j->indices, j->values,
                                          j->values_dtype, j->nnz);
        if (job->status[i] != HE_OK)
            snprintf(job->why[i], sizeof job->why[i], "%s", he_last_error());
    }
}

he_status he_sparse_update_many(const he_sparse_update_job *jobs, int64_t count)
{
    if (count < 0)
        return he_fail(HE_ERR_VALUE, "an update of %" PRId64 " tables", count);
    int small = 1;
    for (int64_t i = 0; i < count; i++) {
        const he_sparse_update_job *j = &jobs[i];
        update_ctx u;
        int ascending = 0;
        he_status st = check_update(&j->hp, &j->weight, j->state, j->num_state, j->indices, j->values_dtype, j->nnz,
                                    &u, &ascending);
        if (st != HE_OK)
            return count > 1 ? name_table(st, i, count, he_last_error()) : st;
        /* Each row and its state read and written, its gradient read. */
        int64_t bytes = j->nnz * j->weight.dim * (int64_t)he_dtype_size(j->values_dtype) * (2 + 2 * j->num_state + 1);
        small &= bytes < HE_PARALLEL_MIN_BYTES;
    }
    size_t n = (size_t)(count > 0 ? count : 1);
    he_status *status = calloc(n, sizeof *status);
    char(*why)[256] = calloc(n, sizeof *why);
    he_status st = HE_OK;
    if (!status || !why) {
        st = he_fail(HE_ERR_NOMEM, "no memory for an update of %" PRId64 " tables", count);
    } else {
        update_many_job job = {jobs, status, why};
        st = run_tables(count, small, run_sparse_updates, &job, status, why);
    }
    free(status);
    free(why);
    return st;
}

