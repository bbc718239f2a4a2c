/* The CPU ops: keyword-only bindings of the core's dedup, gather,
 * grad_reduce, renorm, the sparse optimizers' update and Adam over a whole
 * table. A table (and its optimizer state)
 * comes as its HostBuffer object, and its shape is checked against the
 * buffer's size before any work; ids, gradients and outputs (allocated by
 * the Python layer for the call) come as addresses. */
#include "binding.h"

#include "dedup.h"
#include "dense_adam.h"
#include "gather.h"
#include "grad_reduce.h"
#include "ids.h"
#include "renorm.h"
#include "optimizers.h"
#include "pool_bags.h"
#include "quantize.h"
#include "sparse_update.h"

static he_ids heb_make_ids(const void *data, long long count, int is_int64)
{
    he_ids ids = {data, count, is_int64};
    return ids;
}

/* ---- Dedup: the sorted unique ids of one batch, kept between the calls
 * that size the outputs (Python allocates them) and fill them. */

typedef struct {
    PyObject_HEAD
    he_dedup *d; /* d->num_rows: the range the ids were checked against */
} heb_dedup;

/* The keyword arguments ids, count, ids_int64 and num_rows (a batch of ids
 * and the table size it is checked against) that Dedup and check_ids take;
 * format names the caller ("$O&LpL:Dedup"). 0 with an exception set. */
static int heb_parse_batch(PyObject *args, PyObject *kwds, const char *format, he_ids *view, long long *num_rows)
{
    static char *kwlist[] = {"ids", "count", "ids_int64", "num_rows", NULL};
    HEB_ADDRESS(ids);
    long long count;
    int ids_int64;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, heb_address_converter, &ids, &count, &ids_int64,
                                     num_rows))
        return 0;
    *view = heb_make_ids(ids.ptr, count, ids_int64);
    return 1;
}

static PyObject *heb_dedup_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    he_ids view;
    long long num_rows;
    if (!heb_parse_batch(args, kwds, "$O&LpL:Dedup", &view, &num_rows))
        return NULL;
    heb_dedup *self = (heb_dedup *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_dedup_build(&view, num_rows, &self->d);
    Py_END_ALLOW_THREADS
    if (st != HE_OK) {
        Py_DECREF(self);
        return heb_raise_status(st);
    }
    return (PyObject *)self;
}

static void heb_dedup_dealloc(heb_dedup *self)
{
    he_dedup_free(self->d);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *heb_dedup_num_unique(heb_dedup *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->d->num_unique);
}

static PyObject *heb_dedup_export(heb_dedup *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"unique", "inverse", NULL};
    HEB_ADDRESS(unique);
    HEB_ADDRESS(inverse);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&O&:export", kwlist, heb_address_converter, &unique,
                                     heb_address_converter, &inverse))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    he_dedup_export(self->d, unique.ptr, inverse.ptr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef heb_dedup_methods[] = {
    {"export", (PyCFunction)(void (*)(void))heb_dedup_export, METH_VARARGS | METH_KEYWORDS,
     "export(*, unique, inverse)\n--\n\nWrites the unique ids (num_unique int64) and each id's index among them "
     "(count int64) at the two addresses"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef heb_dedup_getset[] = {
    {"num_unique", (getter)heb_dedup_num_unique, NULL, "number of distinct ids", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject heb_dedup_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hostembed._core._C.Dedup",
    .tp_doc = "Dedup(*, ids, count, ids_int64, num_rows)\n--\n\n"
              "Sorted unique ids of a batch (ids: address of count int64 or int32 ids); "
              "IndexError for an id outside [0, num_rows)",
    .tp_basicsize = sizeof(heb_dedup),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = heb_dedup_new,
    .tp_dealloc = (destructor)heb_dedup_dealloc,
    .tp_getset = heb_dedup_getset,
    .tp_methods = heb_dedup_methods,
};

/* ---- functions */

static PyObject *heb_gather(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"table", "num_rows", "dim", "dtype", "ids", "count", "ids_int64", "out", NULL};
    HEB_BUFFER(table);
    HEB_ADDRESS(ids);
    HEB_ADDRESS(out);
    long long num_rows, dim, count;
    int ids_int64, dtype;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LLiO&LpO&:gather", kwlist, heb_buffer_converter, &table,
                                     &num_rows, &dim, &dtype, heb_address_converter, &ids, &count, &ids_int64,
                                     heb_address_converter, &out))
        return NULL;
    he_table rows;
    if (heb_buffer_table(&table, num_rows, dim, dtype, &rows) < 0)
        return NULL;
    he_ids view = heb_make_ids(ids.ptr, count, ids_int64);
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_gather(&rows, &view, out.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

/* The range check of a lookup, alone: for a pooling that torch's
 * embedding_bag does straight from the table. */
static PyObject *heb_check_ids(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    he_ids view;
    long long num_rows;
    if (!heb_parse_batch(args, kwds, "$O&LpL:check_ids", &view, &num_rows))
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_check_ids(&view, num_rows);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_grad_reduce(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"dedup", "grad", "dim", "padding_idx", "scale_grad_by_freq", "values", "indices",
                             "bag_of", "row_weights", "num_bags", "dtype", "round_sums", "bags", NULL};
    heb_dedup *dedup;
    PyObject *bag_batch = Py_None;
    HEB_ADDRESS(grad);
    HEB_ADDRESS(values);
    HEB_ADDRESS(indices);
    HEB_ADDRESS(bag_of);
    HEB_ADDRESS(row_weights);
    long long dim, padding_idx, num_bags;
    int scale, dtype, round_sums;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!O&LLpO&O&O&O&LipO:grad_reduce", kwlist, &heb_dedup_type,
                                     &dedup, heb_address_converter, &grad, &dim, &padding_idx, &scale,
                                     heb_address_converter, &values, heb_address_converter, &indices,
                                     heb_address_converter, &bag_of, heb_address_converter, &row_weights, &num_bags,
                                     &dtype, &round_sums, &bag_batch))
        return NULL;
    he_reduce_opts opts = {padding_idx, scale, bag_of.ptr, row_weights.ptr, num_bags, dtype, round_sums};
    he_bag_batch bags;
    if (bag_batch != Py_None) {
        if (heb_parse_bag_batch(bag_batch, &bags) < 0)
            return NULL;
        if (bag_of.ptr || row_weights.ptr || dim != bags.table.dim || dtype != bags.table.dtype) {
            PyErr_Format(PyExc_ValueError, "grad_reduce with bags makes bag_of and row_weights itself (got them "
                         "too) and takes the bags' table's dim %lld and dtype %d (got %lld, %d)",
                         (long long)bags.table.dim, bags.table.dtype, dim, dtype);
            return NULL;
        }
    }
    int64_t written = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    if (bag_batch != Py_None)
        st = he_bag_grad_reduce(dedup->d, &bags, grad.ptr, num_bags, &opts, values.ptr, (int64_t *)indices.ptr,
                                &written);
    else
        st = he_grad_reduce(dedup->d, grad.ptr, dim, &opts, values.ptr, (int64_t *)indices.ptr, &written);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyLong_FromLongLong(written);
}

/* Takes the batch's Dedup rather than its ids: a training lookup with
 * max_norm sorts its ids once, for the renorm here and for the backward's
 * grad_reduce. The core refuses a Dedup built for another row count. */
static PyObject *heb_renorm(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"table", "num_rows", "dim", "dtype", "dedup", "max_norm", "norm_type", NULL};
    HEB_BUFFER(table);
    heb_dedup *dedup;
    long long num_rows, dim;
    int dtype;
    double max_norm, norm_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LLiO!dd:renorm", kwlist, heb_buffer_converter, &table,
                                     &num_rows, &dim, &dtype, &heb_dedup_type, &dedup, &max_norm, &norm_type))
        return NULL;
    he_table rows;
    if (heb_buffer_table(&table, num_rows, dim, dtype, &rows) < 0)
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_renorm(&rows, dedup->d, max_norm, norm_type);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

/* State item i of an optimizer: a HostBuffer (the state in the table's
 * compute type), or a compact state as a tuple (HostBuffer, he_dtype,
 * scales: a HostBuffer for an 8-bit dtype, else None, stochastic
 * rounding). 0, or -1 with an exception set. */
static int heb_state_table(PyObject *item, const char *name, long long num_rows, long long dim, int compute,
                           he_optim_params *hp, he_table *out)
{
    heb_buffer b = {name, NULL, 0, NULL, -1}, scales = {name, NULL, 0, NULL, -1};
    if (!PyTuple_Check(item))
        return heb_buffer_converter(item, &b) ? heb_buffer_table(&b, num_rows, dim, compute, out) : -1;
    PyObject *buffer, *scale_obj;
    int dtype, stochastic;
    if (!PyArg_ParseTuple(item, "OiOp:optimizer state", &buffer, &dtype, &scale_obj, &stochastic) ||
        !heb_buffer_converter(buffer, &b))
        return -1;
    if (scale_obj != Py_None && !heb_buffer_converter(scale_obj, &scales))
        return -1;
    *out = he_table_typed(b.ptr, b.nbytes, (int64_t)num_rows, (int64_t)dim, dtype);
    out->scale = scales.ptr;
    out->scale_nbytes = scales.nbytes;
    out->scale_stride = he_q8_blocks((int64_t)dim);
    hp->state_stochastic_rounding |= stochastic;
    he_status st = he_state_table_check(out, name);
    if (st != HE_OK) {
        heb_raise_status(st);
        return -1;
    }
    return 0;
}

/* An optimizer's tables: the weight and each state of the tuple (as many
 * as the optimizer keeps, per element or per row; see heb_state_table),
 * each checked against its own buffer; the rule of hp->kind. -1 with an
 * exception set. */
static int heb_optim_tables(const heb_buffer *weight, PyObject *state, long long num_rows, long long dim, int dtype,
                            he_optim_params *hp, he_table *w, he_table *s, int *num_state)
{
    const he_optim_rule *rule = he_optim_rule_of(hp->kind);
    if (!rule) {
        PyErr_Format(PyExc_ValueError, "unknown optimizer kind %d", hp->kind);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(state);
    if (n != rule->num_state) {
        PyErr_Format(PyExc_ValueError, "%s keeps %d state buffers, got a tuple of %zd", rule->name,
                     rule->num_state, n);
        return -1;
    }
    if (heb_buffer_table(weight, num_rows, dim, dtype, w) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (heb_state_table(PyTuple_GET_ITEM(state, i), rule->state_names[i], num_rows, rule->per_row[i] ? 1 : dim,
                            he_compute_dtype(dtype), hp, &s[i]) < 0)
            return -1;
    *num_state = (int)n;
    return 0;
}

/* Parses each dict of `list` (one table's keywords each) with
 * parse(args, kwds, i, ctx), args an empty tuple; 0 with an exception set. */
typedef int (*heb_dict_parser)(PyObject *args, PyObject *kwds, Py_ssize_t i, void *ctx);

static int heb_parse_dicts(PyObject *list, const char *what, heb_dict_parser parse, void *ctx)
{
    PyObject *empty = PyTuple_New(0);
    if (!empty)
        return 0;
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyDict_Check(item)) {
            PyErr_Format(PyExc_TypeError, "updates[%zd] must be a dict of %s's keywords, got %.100s", i, what,
                         Py_TYPE(item)->tp_name);
            ok = 0;
        } else {
            ok = parse(empty, item, i, ctx);
        }
    }
    Py_DECREF(empty);
    return ok;
}

/* One table's update, its keyword arguments (a dict of heb_sparse_update_many's
 * list), into out; 0 with an exception set. */
static int heb_parse_update(PyObject *args, PyObject *kwds, he_sparse_update_job *out)
{
    static char *kwlist[] = {"kind", "weight", "state", "num_rows", "dim", "indices", "values", "nnz", "lr",
                             "beta1", "beta2", "eps", "lr_decay", "step", "maximize", "weight_decay", "dtype",
                             "values_dtype", "stochastic_rounding", "seed", NULL};
    HEB_BUFFER(weight);
    PyObject *state;
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    long long num_rows, dim, nnz, step;
    unsigned long long seed;
    he_optim_params hp = {0};
    int maximize, dtype, values_dtype, stochastic;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$iO&O!LLO&O&LdddddLpdiipK:sparse_update_many", kwlist, &hp.kind,
                                     heb_buffer_converter, &weight, &PyTuple_Type, &state, &num_rows, &dim,
                                     heb_address_converter, &indices, heb_address_converter, &values, &nnz, &hp.lr,
                                     &hp.beta1, &hp.beta2, &hp.eps, &hp.lr_decay, &step, &maximize,
                                     &hp.weight_decay, &dtype, &values_dtype, &stochastic, &seed))
        return 0;
    hp.step = step;
    hp.maximize = maximize;
    hp.stochastic_rounding = stochastic;
    hp.seed = seed;
    if (heb_optim_tables(&weight, state, num_rows, dim, dtype, &hp, &out->weight, out->state, &out->num_state) < 0)
        return 0;
    out->hp = hp;
    out->indices = (const int64_t *)indices.ptr;
    out->values = values.ptr;
    out->values_dtype = values_dtype;
    out->nnz = nnz;
    return 1;
}

static int heb_parse_update_item(PyObject *args, PyObject *kwds, Py_ssize_t i, void *ctx)
{
    return heb_parse_update(args, kwds, &((he_sparse_update_job *)ctx)[i]);
}

/* The updates of one or several tables in one call (a list of dicts, each
 * one table's keywords: heb_parse_update), he_sparse_update_many. */
static PyObject *heb_sparse_update_many(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"updates", NULL};
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!:sparse_update_many", kwlist, &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    he_sparse_update_job *jobs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *jobs);
    if (!jobs)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    if (heb_parse_dicts(list, "an update", heb_parse_update_item, jobs)) {
        he_status st;
        /* The list (and the buffers its dicts hold) stays alive: our caller holds it. */
        Py_BEGIN_ALLOW_THREADS
        st = he_sparse_update_many(jobs, n);
        Py_END_ALLOW_THREADS
        result = st != HE_OK ? heb_raise_status(st) : Py_NewRef(Py_None);
    }
    PyMem_Free(jobs);
    return result;
}

/* One table's fused update, its keyword arguments, into out; 0 with an
 * exception set. dedup None: the core sorts the ids itself, those of bags
 * (a bag batch tuple, parsed into *bags: its positions stand for bag_of,
 * row_weights and num_bags) or else ids/count/ids_int64. The objects they
 * name stay alive with args and kwds (the caller's). */
static int heb_parse_fused(PyObject *args, PyObject *kwds, he_fused_update *out, he_bag_batch *bags)
{
    static char *kwlist[] = {"dedup", "grad", "padding_idx", "scale_grad_by_freq", "kind", "weight", "state",
                             "num_rows", "dim", "lr", "beta1", "beta2", "eps", "lr_decay", "step", "maximize",
                             "weight_decay", "bag_of", "row_weights", "num_bags", "dtype", "grad_dtype",
                             "stochastic_rounding", "seed", "ids", "count", "ids_int64", "bags", NULL};
    PyObject *dedup, *bag_batch = Py_None;
    HEB_ADDRESS(grad);
    HEB_BUFFER(weight);
    HEB_ADDRESS(bag_of);
    HEB_ADDRESS(row_weights);
    HEB_ADDRESS(ids);
    PyObject *state;
    long long padding_idx, num_rows, dim, step, num_bags, count = 0;
    unsigned long long seed;
    int scale, maximize, dtype, grad_dtype, stochastic, ids_int64 = 1;
    he_optim_params hp = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO&LpiO&O!LLdddddLpdO&O&LiipK|O&LpO:sparse_update_fused_many",
                                     kwlist, &dedup, heb_address_converter, &grad, &padding_idx, &scale, &hp.kind,
                                     heb_buffer_converter, &weight, &PyTuple_Type, &state, &num_rows, &dim, &hp.lr,
                                     &hp.beta1, &hp.beta2, &hp.eps, &hp.lr_decay, &step, &maximize, &hp.weight_decay,
                                     heb_address_converter, &bag_of, heb_address_converter, &row_weights, &num_bags,
                                     &dtype, &grad_dtype, &stochastic, &seed, heb_address_converter, &ids, &count,
                                     &ids_int64, &bag_batch))
        return 0;
    if (dedup != Py_None && !PyObject_TypeCheck(dedup, &heb_dedup_type)) {
        PyErr_Format(PyExc_TypeError, "dedup must be a Dedup or None, got %.100s", Py_TYPE(dedup)->tp_name);
        return 0;
    }
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "count must be >= 0, got %lld", count);
        return 0;
    }
    hp.step = step;
    hp.maximize = maximize;
    hp.stochastic_rounding = stochastic;
    hp.seed = seed;
    if (heb_optim_tables(&weight, state, num_rows, dim, dtype, &hp, &out->weight, out->state, &out->num_state) < 0)
        return 0;
    he_reduce_opts opts = {padding_idx, scale, bag_of.ptr, row_weights.ptr, num_bags, grad_dtype};
    out->d = dedup == Py_None ? NULL : ((heb_dedup *)dedup)->d;
    out->ids = (he_ids){ids.ptr, count, ids_int64};
    out->bags = NULL;
    if (bag_batch != Py_None) {
        if (heb_parse_bag_batch(bag_batch, bags) < 0)
            return 0;
        out->bags = bags;
    }
    out->grad_rows = num_bags;
    out->grad = grad.ptr;
    out->opts = opts;
    out->hp = hp;
    return 1;
}

typedef struct heb_fused_items {
    he_fused_update *updates;
    he_bag_batch *bags;
} heb_fused_items;

static int heb_parse_fused_item(PyObject *args, PyObject *kwds, Py_ssize_t i, void *ctx)
{
    const heb_fused_items *items = ctx;
    he_fused_update *u = &items->updates[i];
    if (!heb_parse_fused(args, kwds, u, &items->bags[i]))
        return 0;
    if (!u->d && !u->bags && u->ids.count && !u->ids.data) {
        PyErr_Format(PyExc_ValueError, "updates[%zd]: no dedup, bags or ids", i);
        return 0;
    }
    return 1;
}

/* The fused backward of one or several tables in one call (a list of
 * dicts, each one table's keywords: heb_parse_fused): grad_reduce of each
 * batch's sort straight into the optimizer's row update,
 * he_sparse_update_fused_many. */
static PyObject *heb_sparse_update_fused_many(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"updates", NULL};
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!:sparse_update_fused_many", kwlist, &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    heb_fused_items items = {PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(he_fused_update)),
                             PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(he_bag_batch))};
    PyObject *result = NULL;
    if (!items.updates || !items.bags) {
        PyErr_NoMemory();
    } else if (heb_parse_dicts(list, "a fused update", heb_parse_fused_item, &items)) {
        he_status st;
        /* The list (and the Dedups and buffers its dicts hold) stays alive:
         * our caller holds it. */
        Py_BEGIN_ALLOW_THREADS
        st = he_sparse_update_fused_many(items.updates, n);
        Py_END_ALLOW_THREADS
        result = st != HE_OK ? heb_raise_status(st) : Py_NewRef(Py_None);
    }
    PyMem_Free(items.updates);
    PyMem_Free(items.bags);
    return result;
}

/* torch.optim.Adam / AdamW on every row (dense_adam.h); state is
 * (exp_avg, exp_avg_sq), and max_exp_avg_sq after them with amsgrad. */
static PyObject *heb_dense_adam(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"weight", "state", "num_rows", "dim", "dtype", "indices", "values", "nnz", "lr",
                             "beta1", "beta2", "eps", "weight_decay", "step", "decoupled", "amsgrad", "maximize",
                             "rows", NULL};
    static const char *names[3] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    HEB_BUFFER(weight);
    PyObject *state;
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    long long num_rows, dim, nnz, step, first_row, end_row;
    int dtype, decoupled, amsgrad, maximize;
    he_dense_adam_params hp = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&O!LLiO&O&LdddddLppp(LL):dense_adam", kwlist,
                                     heb_buffer_converter, &weight, &PyTuple_Type, &state, &num_rows, &dim, &dtype,
                                     heb_address_converter, &indices, heb_address_converter, &values, &nnz, &hp.lr,
                                     &hp.beta1, &hp.beta2, &hp.eps, &hp.weight_decay, &step, &decoupled, &amsgrad,
                                     &maximize, &first_row, &end_row))
        return NULL;
    hp.step = step;
    hp.decoupled = decoupled;
    hp.amsgrad = amsgrad;
    hp.maximize = maximize;
    Py_ssize_t n = PyTuple_GET_SIZE(state);
    if (n != (amsgrad ? 3 : 2)) {
        PyErr_Format(PyExc_ValueError, "Adam keeps %d state buffers with amsgrad=%s, got a tuple of %zd",
                     amsgrad ? 3 : 2, amsgrad ? "True" : "False", n);
        return NULL;
    }
    he_table w, s[3];
    if (heb_buffer_table(&weight, num_rows, dim, dtype, &w) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        heb_buffer b = {names[i], NULL, 0, NULL, -1};
        if (!heb_buffer_converter(PyTuple_GET_ITEM(state, i), &b) ||
            heb_buffer_table(&b, num_rows, dim, dtype, &s[i]) < 0)
            return NULL;
    }
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_dense_adam(&hp, &w, &s[0], &s[1], amsgrad ? &s[2] : NULL, first_row, end_row,
                       (const int64_t *)indices.ptr, values.ptr, nnz);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyMethodDef heb_cpu_methods[] = {
    {"check_ids", HEB_KW_FUNC(heb_check_ids), METH_VARARGS | METH_KEYWORDS,
     "check_ids($module, /, *, ids, count, ids_int64, num_rows)\n--\n\n"
     "IndexError naming the first of ids[:count] outside [0, num_rows), if any"},
    {"dense_adam", HEB_KW_FUNC(heb_dense_adam), METH_VARARGS | METH_KEYWORDS,
     "dense_adam($module, /, *, weight, state, num_rows, dim, dtype, indices, values, nnz, lr, beta1, beta2, eps, "
     "weight_decay, step, decoupled, amsgrad, maximize, rows)\n--\n\n"
     "torch.optim.Adam's step (AdamW's with decoupled) on rows [rows[0], rows[1]) of the [num_rows, dim] table of he_dtype "
     "`dtype` (float32 or float64) and its state (exp_avg, exp_avg_sq[, max_exp_avg_sq]: HostBuffers of the same "
     "shape and dtype), in place: rows indices[:nnz] (strictly ascending) with gradient rows values[:nnz], every "
     "other row of the range with a zero gradient (its indices all in the range)"},
    {"gather", HEB_KW_FUNC(heb_gather), METH_VARARGS | METH_KEYWORDS,
     "gather($module, /, *, table, num_rows, dim, dtype, ids, count, ids_int64, out)\n--\n\n"
     "out[i] = table[ids[i]] (table: the HostBuffer of the [num_rows, dim] rows of he_dtype `dtype`; ValueError if they do not "
     "fit it); IndexError (out may be written, the table never) for an id outside [0, num_rows)"},
    {"grad_reduce", HEB_KW_FUNC(heb_grad_reduce), METH_VARARGS | METH_KEYWORDS,
     "grad_reduce($module, /, *, dedup, grad, dim, padding_idx, scale_grad_by_freq, values, indices, bag_of, "
     "row_weights, num_bags, dtype, round_sums, bags)\n--\n\n"
     "Sums the grad rows of each unique id of dedup into values/indices (ascending ids, padding_idx "
     "left out) -> rows written. bag_of (0: none): position p's row is grad[bag_of[p]] ([num_bags, dim] "
     "grad), times row_weights[p] (0: none); grad of he_dtype `dtype`, row_weights and values of its compute "
     "type (float64 for float64, else float32), or with round_sums, values rounded to a half `dtype`. bags (a "
     "bag batch tuple, its out 0): each position's bag and factor made from it, bag_of and row_weights 0, "
     "num_bags the grad's rows"},
    {"renorm", HEB_KW_FUNC(heb_renorm), METH_VARARGS | METH_KEYWORDS,
     "renorm($module, /, *, table, num_rows, dim, dtype, dedup, max_norm, norm_type)\n--\n\n"
     "max_norm in place on the unique rows of dedup (a Dedup built for num_rows) of the table's HostBuffer"},
    {"sparse_update_fused_many", HEB_KW_FUNC(heb_sparse_update_fused_many), METH_VARARGS | METH_KEYWORDS,
     "sparse_update_fused_many(*, updates)\n--\n\nThe fused backward and update of one or several tables (a list of "
     "dicts: dedup, grad, padding_idx, scale_grad_by_freq, kind, weight, state, num_rows, dim, lr, beta1, beta2, eps, "
     "lr_decay, step, maximize, weight_decay, bag_of, row_weights, num_bags, dtype, grad_dtype, "
     "stochastic_rounding, seed, and optionally ids, count, ids_int64, bags), every one checked before any row is "
     "written; small ones side by side. dedup None: the core sorts the ids itself (those of bags, a pool_bags batch "
     "tuple whose positions then stand for bag_of and row_weights, or else ids[:count]); num_bags: grad's rows"},
    {"sparse_update_many", HEB_KW_FUNC(heb_sparse_update_many), METH_VARARGS | METH_KEYWORDS,
     "sparse_update_many($module, /, *, updates)\n--\n\n"
     "The updates of one or several tables (a list of dicts: kind, weight, state, num_rows, dim, indices, values, "
     "nnz, lr, beta1, beta2, eps, lr_decay, step, maximize, weight_decay, dtype, values_dtype, stochastic_rounding, "
     "seed), every one checked before any row is written; small ones side by side. Each: the update of optimizer "
     "`kind` (0 SparseAdam, 1 SGD, 2 Adagrad, 3 row-wise Adagrad) of rows indices[:nnz] with grad rows "
     "values[:nnz] (of he_dtype `values_dtype`: the table's he_dtype `dtype` or its compute type), in place; "
     "weight: the HostBuffer of [num_rows, dim] rows, state: a tuple of the optimizer's state HostBuffers "
     "([num_rows, dim] or [num_rows, 1] each; ValueError if they do not fit)"},
    {NULL, NULL, 0, NULL},
};

int heb_cpu_ops_add(PyObject *module)
{
    if (PyType_Ready(&heb_dedup_type) < 0)
        return -1;
    Py_INCREF(&heb_dedup_type);
    if (PyModule_AddObject(module, "Dedup", (PyObject *)&heb_dedup_type) < 0) {
        Py_DECREF(&heb_dedup_type);
        return -1;
    }
    return PyModule_AddFunctions(module, heb_cpu_methods);
}
