/* The pooled bag ops: pool_bags (the forward of one or many EmbeddingBag
 * tables in one call) and bag_positions (backward's per-position bag and
 * factor). A batch comes as a tuple; its table as its HostBuffer, checked
 * against the shape before any work. */
#include "binding.h"

#include "pool_bags.h"

#define HEB_MAX_BATCHES 4096

/* (table, num_rows, dim, dtype, ids, count, ids_int64, offsets,
 * num_offsets, include_last_offset, weights or 0, padding_idx, mean, out):
 * one table's part, its offsets as torch's embedding_bag takes them
 * (int64). With include_last_offset the last offset ends the last bag;
 * without, the last bag ends at count. */
int heb_parse_bag_batch(PyObject *item, he_bag_batch *out)
{
    HEB_BUFFER(table);
    HEB_ADDRESS(ids);
    HEB_ADDRESS(offsets);
    HEB_ADDRESS(weights);
    HEB_ADDRESS(out_rows);
    long long num_rows, dim, count, num_offsets, padding_idx;
    int dtype, ids_int64, include_last, mean;
    if (!PyTuple_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a bag batch must be a tuple, got %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(item, "O&LLiO&LpO&LpO&LpO&:a bag batch", heb_buffer_converter, &table, &num_rows, &dim,
                          &dtype, heb_address_converter, &ids, &count, &ids_int64, heb_address_converter, &offsets,
                          &num_offsets, &include_last, heb_address_converter, &weights, &padding_idx, &mean,
                          heb_address_converter, &out_rows))
        return -1;
    if (heb_buffer_table(&table, num_rows, dim, dtype, &out->table) < 0)
        return -1;
    if (count < 0 || num_offsets < include_last) {
        PyErr_Format(PyExc_ValueError, "a bag batch needs count >= 0 and, with include_last_offset, an offset; got "
                     "%lld ids and %lld offsets", count, num_offsets);
        return -1;
    }
    out->ids = (he_ids){ids.ptr, count, ids_int64};
    out->offsets = offsets.ptr;
    out->num_bags = num_offsets - include_last;
    out->end = include_last ? ((const int64_t *)offsets.ptr)[num_offsets - 1] : count;
    out->weights = weights.ptr;
    out->padding_idx = padding_idx;
    out->mean = mean;
    out->out = out_rows.ptr;
    return 0;
}

static PyObject *heb_pool_bags(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"batches", NULL};
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!:pool_bags", kwlist, &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > HEB_MAX_BATCHES) {
        PyErr_Format(PyExc_ValueError, "pool_bags takes at most %d tables a call, got %zd", HEB_MAX_BATCHES, n);
        return NULL;
    }
    he_bag_batch small[16];
    he_bag_batch *batches = n <= 16 ? small : PyMem_Malloc((size_t)n * sizeof *batches);
    if (!batches)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (heb_parse_bag_batch(PyList_GET_ITEM(list, i), &batches[i]) < 0)
            goto done;
    he_status st;
    /* The list (and the HostBuffers in it) stays alive: our caller holds it. */
    Py_BEGIN_ALLOW_THREADS
    st = he_pool_bags(batches, n, NULL);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        heb_raise_status(st);
    else
        result = Py_NewRef(Py_None);
done:
    if (batches != small)
        PyMem_Free(batches);
    return result;
}

static PyObject *heb_bag_positions(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"batch", "bag_of", "weights", NULL};
    PyObject *item;
    HEB_ADDRESS(bag_of);
    HEB_ADDRESS(weights);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!O&O&:bag_positions", kwlist, &PyTuple_Type, &item,
                                     heb_address_converter, &bag_of, heb_address_converter, &weights))
        return NULL;
    he_bag_batch batch;
    if (heb_parse_bag_batch(item, &batch) < 0)
        return NULL;
    int wrote = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_bag_positions(&batch, bag_of.ptr, weights.ptr, &wrote);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyBool_FromLong(wrote);
}

/* The checks of pool_bags for bags given by offsets alone (a 1-D input:
 * the last bag ends with the ids; or none: the ids' range only), without
 * a table or an output: what a caller pooling them another way needs.
 * True when every bag holds exactly one id (DLRM's bags of one id a
 * sample), which that caller may look up as rows. */
static PyObject *heb_check_bags(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"ids", "count", "ids_int64", "offsets", "num_offsets", "num_rows", NULL};
    HEB_ADDRESS(ids);
    HEB_ADDRESS(offsets);
    long long count, num_offsets, num_rows;
    int ids_int64;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LpO&LL:check_bags", kwlist, heb_address_converter, &ids,
                                     &count, &ids_int64, heb_address_converter, &offsets, &num_offsets, &num_rows))
        return NULL;
    if (count < 0 || num_offsets < 0 || num_rows < 0 || (num_offsets > 0 && !offsets.ptr)) {
        PyErr_Format(PyExc_ValueError, "check_bags needs counts >= 0 and offsets, got %lld ids, %lld offsets, "
                     "%lld rows", count, num_offsets, num_rows);
        return NULL;
    }
    he_bag_batch batch = {0};
    batch.table.num_rows = num_rows;
    batch.ids = (he_ids){ids.ptr, count, ids_int64};
    batch.offsets = offsets.ptr;
    batch.num_bags = num_offsets;
    batch.end = count;
    batch.padding_idx = -1;
    he_status st;
    int singles = num_offsets == count && count > 0;
    Py_BEGIN_ALLOW_THREADS
    st = he_check_bag_batch(&batch);
    for (long long k = 0; st == HE_OK && singles && k < num_offsets; k++)
        singles = batch.offsets[k] == k;
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyBool_FromLong(singles);
}

static PyMethodDef heb_bag_methods[] = {
    {"pool_bags", HEB_KW_FUNC(heb_pool_bags), METH_VARARGS | METH_KEYWORDS,
     "pool_bags(*, batches)\n--\n\nPools each batch's bags from its table into its output (a list of tuples: "
     "table, num_rows, dim, dtype, ids, count, ids_int64, offsets, num_offsets, include_last_offset, weights, "
     "padding_idx, mean, out); IndexError for an id outside its table, ValueError for bad offsets, before any "
     "output is written"},
    {"check_bags", HEB_KW_FUNC(heb_check_bags), METH_VARARGS | METH_KEYWORDS,
     "check_bags(*, ids, count, ids_int64, offsets, num_offsets, num_rows)\n--\n\npool_bags' checks of bags "
     "given by int64 offsets, the last ending with the ids (none: the ids' range only), nothing pooled: "
     "ValueError for bad offsets, IndexError for an id outside [0, num_rows); True when every bag holds one id"},
    {"bag_positions", HEB_KW_FUNC(heb_bag_positions), METH_VARARGS | METH_KEYWORDS,
     "bag_positions(*, batch, bag_of, weights)\n--\n\nWrites each position's bag (int64) and, returning True, "
     "its gradient factor in the table's compute type; False when every factor is 1 (weights not written)"},
    {NULL, NULL, 0, NULL},
};

int heb_bag_ops_add(PyObject *module)
{
    return PyModule_AddFunctions(module, heb_bag_methods);
}
