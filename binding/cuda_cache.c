/* The GPU row cache's ops (cuda/cache.cu): its planner's state comes as one
 * tuple of device addresses and sizes (`cache`), the records as device
 * addresses and the host rows they cache as registered HostBuffers (each
 * checked against [num_rows, dim] and its registration, as the other GPU
 * ops check theirs). Built without HE_WITH_CUDA, the module has none of
 * them. */
#include "binding.h"

#ifdef HE_WITH_CUDA

#include "he_cuda.h"
#include "quantize.h"

/* cache = (entry, num_rows, row_of, used_at, referenced, capacity,
 * counters, protect, policy, count, last, turned_at, slot_count): the
 * last four 0 for the clock policy. */
static int heb_cuda_cache_converter(PyObject *obj, void *out)
{
    he_cuda_cache *c = out;
    HEB_ADDRESS(entry);
    HEB_ADDRESS(row_of);
    HEB_ADDRESS(used_at);
    HEB_ADDRESS(referenced);
    HEB_ADDRESS(counters);
    HEB_ADDRESS(count);
    HEB_ADDRESS(last);
    HEB_ADDRESS(turned_at);
    HEB_ADDRESS(slot_count);
    long long num_rows, capacity;
    int protect, policy;
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "cache must be a tuple (entry, num_rows, row_of, used_at, referenced, "
                                      "capacity, counters, protect, policy, count, last, turned_at, slot_count), "
                                      "got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    if (!PyArg_ParseTuple(obj, "O&LO&O&O&LO&iiO&O&O&O&:cache", heb_address_converter, &entry, &num_rows,
                          heb_address_converter, &row_of, heb_address_converter, &used_at, heb_address_converter,
                          &referenced, &capacity, heb_address_converter, &counters, &protect, &policy,
                          heb_address_converter, &count, heb_address_converter, &last, heb_address_converter,
                          &turned_at, heb_address_converter, &slot_count))
        return 0;
    *c = (he_cuda_cache){entry.ptr, num_rows, row_of.ptr, used_at.ptr, referenced.ptr, capacity, counters.ptr,
                         protect, policy, count.ptr, last.ptr, turned_at.ptr, slot_count.ptr};
    return 1;
}

/* One array's records (a device address) and the registered HostBuffer of
 * its host rows, checked against [num_rows, width] float32 words: their
 * device addresses in *record and *rows. 0, or -1 with an exception. */
static int heb_record_and_host(const char *record_name, const char *host_name, PyObject *record_obj,
                               PyObject *host_obj, long long num_rows, long long width, void **record, void **rows)
{
    heb_address address = {record_name, NULL};
    heb_buffer buffer = {host_name, NULL, 0, NULL, -1};
    he_table table;
    if (!heb_address_converter(record_obj, &address) || !heb_buffer_converter(host_obj, &buffer) ||
        heb_device_rows(&buffer, num_rows, width, &table, rows) < 0)
        return -1;
    *record = address.ptr;
    return 0;
}

/* records: a tuple of device addresses; host: a tuple of as many registered
 * HostBuffers of [num_rows, dim] float32 rows. 0, or -1 with an exception. */
static int heb_cache_arrays(PyObject *records, PyObject *host, long long num_rows, long long dim,
                            he_cuda_cache_arrays *a)
{
    if (!PyTuple_Check(records) || !PyTuple_Check(host) || PyTuple_GET_SIZE(records) != PyTuple_GET_SIZE(host) ||
        PyTuple_GET_SIZE(records) < 1 || PyTuple_GET_SIZE(records) > HE_CUDA_CACHE_ARRAYS) {
        PyErr_Format(PyExc_ValueError, "records and host must be tuples of 1 to %d addresses and as many HostBuffers",
                     HE_CUDA_CACHE_ARRAYS);
        return -1;
    }
    memset(a, 0, sizeof *a);
    a->count = (int)PyTuple_GET_SIZE(records);
    a->dim = dim;
    for (int i = 0; i < a->count; i++) {
        void *record, *rows;
        if (heb_record_and_host("records[i]", "host[i]", PyTuple_GET_ITEM(records, i), PyTuple_GET_ITEM(host, i),
                                num_rows, dim, &record, &rows) < 0)
            return -1;
        a->records[i] = record;
        a->host[i] = rows;
    }
    return 0;
}

static PyObject *heb_cuda_cache_plan_workspace(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"n", "capacity", "policy", "device", NULL};
    long long n, capacity;
    int policy, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$LLii:cuda_cache_plan_workspace", kwlist, &n, &capacity, &policy,
                                     &device))
        return NULL;
    size_t bytes = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_plan_workspace(n, capacity, policy, device, &bytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyLong_FromSize_t(bytes);
}

static PyObject *heb_cuda_cache_plan(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "unique", "n", "batch", "slot", "miss", "evict_row", "workspace",
                             "workspace_bytes", "device", "stream", NULL};
    he_cuda_cache c;
    HEB_ADDRESS(unique);
    HEB_ADDRESS(slot);
    HEB_ADDRESS(miss);
    HEB_ADDRESS(evict_row);
    HEB_ADDRESS(workspace);
    HEB_ADDRESS(stream);
    long long n, batch, workspace_bytes;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&O&LLO&O&O&O&LiO&:cuda_cache_plan", kwlist,
                                     heb_cuda_cache_converter, &c, heb_address_converter, &unique, &n, &batch,
                                     heb_address_converter, &slot, heb_address_converter, &miss,
                                     heb_address_converter, &evict_row, heb_address_converter, &workspace,
                                     &workspace_bytes, &device, heb_address_converter, &stream))
        return NULL;
    if (workspace_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "workspace_bytes must be >= 0, got %lld", workspace_bytes);
        return NULL;
    }
    he_cuda_cache_batch plan = {slot.ptr, miss.ptr, evict_row.ptr};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_plan(&c, unique.ptr, n, batch, &plan, workspace.ptr, (size_t)workspace_bytes, device,
                            stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_cache_move(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "records", "host", "dim", "unique", "n", "slot", "miss", "evict_row", "written",
                             "zero_fill", "device", "stream", NULL};
    he_cuda_cache c;
    PyObject *records, *host;
    HEB_ADDRESS(unique);
    HEB_ADDRESS(slot);
    HEB_ADDRESS(miss);
    HEB_ADDRESS(evict_row);
    HEB_ADDRESS(written);
    HEB_ADDRESS(stream);
    long long dim, n;
    unsigned int zero_fill;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&OOLO&LO&O&O&O&IiO&:cuda_cache_move", kwlist,
                                     heb_cuda_cache_converter, &c, &records, &host, &dim, heb_address_converter,
                                     &unique, &n, heb_address_converter, &slot, heb_address_converter, &miss,
                                     heb_address_converter, &evict_row, heb_address_converter, &written, &zero_fill,
                                     &device, heb_address_converter, &stream))
        return NULL;
    he_cuda_cache_arrays a;
    if (heb_cache_arrays(records, host, c.num_rows, dim, &a) < 0)
        return NULL;
    a.written = written.ptr;
    a.zero_fill = zero_fill;
    he_cuda_cache_batch plan = {slot.ptr, miss.ptr, evict_row.ptr};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_move(&c, &a, unique.ptr, n, &plan, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_cache_gather(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"records", "host", "num_rows", "dim", "unique", "slot", "n", "out", "device", "stream",
                             NULL};
    PyObject *records, *host;
    HEB_ADDRESS(unique);
    HEB_ADDRESS(slot);
    HEB_ADDRESS(out);
    HEB_ADDRESS(stream);
    long long num_rows, dim, n;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOLLO&O&LO&iO&:cuda_cache_gather", kwlist, &records, &host,
                                     &num_rows, &dim, heb_address_converter, &unique, heb_address_converter, &slot,
                                     &n, heb_address_converter, &out, &device, heb_address_converter, &stream))
        return NULL;
    he_cuda_cache_arrays a;
    if (heb_cache_arrays(records, host, num_rows, dim, &a) < 0)
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_gather(&a, unique.ptr, slot.ptr, n, out.ptr, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_cache_adam(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "records", "host", "dim", "indices", "values", "nnz", "lr", "beta1", "beta2",
                             "eps", "step", "maximize", "weight_decay", "device", "stream", NULL};
    he_cuda_cache c;
    PyObject *records, *host;
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    HEB_ADDRESS(stream);
    long long dim, nnz, step;
    he_adam_params hp = {0};
    int maximize, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&OOLO&O&LddddLpdiO&:cuda_cache_adam", kwlist,
                                     heb_cuda_cache_converter, &c, &records, &host, &dim, heb_address_converter,
                                     &indices, heb_address_converter, &values, &nnz, &hp.lr, &hp.beta1, &hp.beta2,
                                     &hp.eps, &step, &maximize, &hp.weight_decay, &device, heb_address_converter,
                                     &stream))
        return NULL;
    he_cuda_cache_arrays a;
    if (heb_cache_arrays(records, host, c.num_rows, dim, &a) < 0)
        return NULL;
    if (a.count != 3) {
        PyErr_Format(PyExc_ValueError, "cuda_cache_adam takes 3 arrays (weight, exp_avg, exp_avg_sq), got %d",
                     a.count);
        return NULL;
    }
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_adam(&c, &a, indices.ptr, values.ptr, nnz, &hp, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

/* records, host: the weight, then optimizer `kind`'s state if it keeps
 * one (Adagrad's sum [num_rows, dim], row-wise Adagrad's row_sum
 * [num_rows, 1]), each HostBuffer checked against its rows; whether the
 * count fits the kind is he_cuda_cache_update's to say. 0, or -1 with an
 * exception. */
static int heb_optim_arrays(PyObject *records, PyObject *host, long long num_rows, long long dim, int kind,
                            he_cuda_cache_arrays *a)
{
    static const char *const names[2][2] = {{"records[0] (weight)", "host[0] (weight)"},
                                            {"records[1] (state)", "host[1] (state)"}};
    if (!PyTuple_Check(records) || !PyTuple_Check(host)) {
        PyErr_Format(PyExc_TypeError, "records and host must be tuples, got %.100s and %.100s",
                     Py_TYPE(records)->tp_name, Py_TYPE(host)->tp_name);
        return -1;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(records);
    if (count != PyTuple_GET_SIZE(host) || count < 1 || count > 2) {
        PyErr_Format(PyExc_ValueError, "records and host must be tuples of 1 or 2 (the weight, then the optimizer's "
                     "state if it keeps one), as many of each, got %zd and %zd", count, PyTuple_GET_SIZE(host));
        return -1;
    }
    memset(a, 0, sizeof *a);
    a->count = (int)count;
    a->dim = dim;
    for (int i = 0; i < a->count; i++) {
        long long width = i > 0 && kind == HE_OPTIM_ROWWISE_ADAGRAD ? 1 : dim; /* one value a row */
        void *record, *rows;
        if (heb_record_and_host(names[i][0], names[i][1], PyTuple_GET_ITEM(records, i), PyTuple_GET_ITEM(host, i),
                                num_rows, width, &record, &rows) < 0)
            return -1;
        a->records[i] = record;
        a->host[i] = rows;
    }
    return 0;
}

static PyObject *heb_cuda_cache_update(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "records", "host", "dim", "kind", "indices", "values", "nnz", "lr", "eps",
                             "lr_decay", "step", "maximize", "weight_decay", "device", "stream", NULL};
    he_cuda_cache c;
    PyObject *records, *host;
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    HEB_ADDRESS(stream);
    long long dim, nnz, step;
    he_optim_params hp = {0};
    int maximize, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&OOLiO&O&LdddLpdiO&:cuda_cache_update", kwlist,
                                     heb_cuda_cache_converter, &c, &records, &host, &dim, &hp.kind,
                                     heb_address_converter, &indices, heb_address_converter, &values, &nnz, &hp.lr,
                                     &hp.eps, &hp.lr_decay, &step, &maximize, &hp.weight_decay, &device,
                                     heb_address_converter, &stream))
        return NULL;
    he_cuda_cache_arrays a;
    if (heb_optim_arrays(records, host, c.num_rows, dim, hp.kind, &a) < 0)
        return NULL;
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_update(&c, &a, indices.ptr, values.ptr, nnz, &hp, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

/* A moment's codes as float32 words a row (the HostBuffers, and the
 * moves, hold words): 0, or -1 with ValueError. */
static int heb_compact_words(const char *what, int dtype, long long dim, long long *words)
{
    int per_word = dtype == HE_BF16 ? 2 : he_dtype_quantized(dtype) ? 4 : 0;
    if (!per_word) {
        PyErr_Format(PyExc_ValueError, "%s must be %d (bfloat16), %d (int8) or %d (uint8, fourth root), got %d",
                     what, HE_BF16, HE_Q8, HE_Q8_NONNEG, dtype);
        return -1;
    }
    if (dim % per_word != 0) {
        PyErr_Format(PyExc_ValueError, "%s %s: a row's codes must fill whole float32 words, so dim must be a multiple "
                     "of %d, got %lld", what, he_dtype_name(dtype), per_word, dim);
        return -1;
    }
    *words = dim / per_word;
    return 0;
}

/* records, host: weight, exp_avg, exp_avg_sq, and with an 8-bit moment
 * exp_avg_scale, exp_avg_sq_scale (None for a bfloat16 moment's, which
 * has none), each HostBuffer checked against its rows in float32 words. 0,
 * or -1 with an exception. */
static int heb_compact_arrays(PyObject *records, PyObject *host, long long num_rows, long long dim, int m_dtype,
                              int v_dtype, he_cuda_cache_compact *a)
{
    static const char *const names[HE_CUDA_COMPACT_ARRAYS] = {"weight", "exp_avg", "exp_avg_sq", "exp_avg_scale",
                                                              "exp_avg_sq_scale"};
    long long words[HE_CUDA_COMPACT_ARRAYS] = {dim, 0, 0, he_q8_blocks(dim), he_q8_blocks(dim)};
    if (heb_compact_words("m_dtype", m_dtype, dim, &words[1]) < 0 ||
        heb_compact_words("v_dtype", v_dtype, dim, &words[2]) < 0)
        return -1;
    int scaled[2] = {he_dtype_quantized(m_dtype), he_dtype_quantized(v_dtype)};
    Py_ssize_t count = scaled[0] || scaled[1] ? 5 : 3;
    if (!PyTuple_Check(records) || !PyTuple_Check(host)) {
        PyErr_Format(PyExc_TypeError, "records and host must be tuples, got %.100s and %.100s",
                     Py_TYPE(records)->tp_name, Py_TYPE(host)->tp_name);
        return -1;
    }
    if (PyTuple_GET_SIZE(records) != count || PyTuple_GET_SIZE(host) != count) {
        PyErr_Format(PyExc_ValueError, "records and host must be tuples of %zd (weight, exp_avg, exp_avg_sq%s) for "
                     "exp_avg %s and exp_avg_sq %s, got %zd and %zd", count,
                     count == 5 ? ", exp_avg_scale, exp_avg_sq_scale" : "", he_dtype_name(m_dtype),
                     he_dtype_name(v_dtype), PyTuple_GET_SIZE(records), PyTuple_GET_SIZE(host));
        return -1;
    }
    memset(a, 0, sizeof *a);
    a->m_dtype = m_dtype;
    a->v_dtype = v_dtype;
    a->dim = dim;
    for (int i = 0; i < (int)count; i++) {
        PyObject *r = PyTuple_GET_ITEM(records, i), *h = PyTuple_GET_ITEM(host, i);
        if (i >= 3 && !scaled[i - 3]) {
            if (r != Py_None || h != Py_None) {
                PyErr_Format(PyExc_ValueError, "records[%d] and host[%d] must be None: %s is bfloat16, with no %s",
                             i, i, names[i - 2], names[i]);
                return -1;
            }
            continue;
        }
        if (heb_record_and_host(names[i], names[i], r, h, num_rows, words[i], &a->records[i], &a->host[i]) < 0)
            return -1;
    }
    return 0;
}

static PyObject *heb_cuda_cache_adam_compact(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "records", "host", "dim", "m_dtype", "v_dtype", "indices", "values", "nnz",
                             "lr", "beta1", "beta2", "eps", "step", "maximize", "weight_decay", "device", "stream",
                             NULL};
    he_cuda_cache c;
    PyObject *records, *host;
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    HEB_ADDRESS(stream);
    long long dim, nnz, step;
    he_adam_params hp = {0};
    int m_dtype, v_dtype, maximize, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&OOLiiO&O&LddddLpdiO&:cuda_cache_adam_compact", kwlist,
                                     heb_cuda_cache_converter, &c, &records, &host, &dim, &m_dtype, &v_dtype,
                                     heb_address_converter, &indices, heb_address_converter, &values, &nnz, &hp.lr,
                                     &hp.beta1, &hp.beta2, &hp.eps, &step, &maximize, &hp.weight_decay, &device,
                                     heb_address_converter, &stream))
        return NULL;
    he_cuda_cache_compact a;
    if (heb_compact_arrays(records, host, c.num_rows, dim, m_dtype, v_dtype, &a) < 0)
        return NULL;
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_adam_compact(&c, &a, indices.ptr, values.ptr, nnz, &hp, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_cache_sync_records(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"cache", "records", "host", "dim", "to_host", "written", "device", "stream", NULL};
    he_cuda_cache c;
    PyObject *records, *host;
    HEB_ADDRESS(written);
    HEB_ADDRESS(stream);
    long long dim;
    int to_host, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&OOLpO&iO&:cuda_cache_sync_records", kwlist,
                                     heb_cuda_cache_converter, &c, &records, &host, &dim, &to_host,
                                     heb_address_converter, &written, &device, heb_address_converter, &stream))
        return NULL;
    he_cuda_cache_arrays a;
    if (heb_cache_arrays(records, host, c.num_rows, dim, &a) < 0)
        return NULL;
    a.written = written.ptr;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_cache_sync_records(&c, &a, to_host, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyMethodDef heb_cuda_cache_methods[] = {
    {"cuda_cache_plan_workspace", HEB_KW_FUNC(heb_cuda_cache_plan_workspace), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_plan_workspace($module, /, *, n, capacity, policy, device)\n--\n\n"
     "Bytes of device scratch for cuda_cache_plan"},
    {"cuda_cache_plan", HEB_KW_FUNC(heb_cuda_cache_plan), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_plan($module, /, *, cache, unique, n, batch, slot, miss, evict_row, workspace, workspace_bytes, "
     "device, stream)\n--\n\n"
     "Plans batch `batch` of unique rows unique[:n] on the GPU, as the CPU planner would (nothing waits)"},
    {"cuda_cache_move", HEB_KW_FUNC(heb_cuda_cache_move), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_move($module, /, *, cache, records, host, dim, unique, n, slot, miss, evict_row, written, "
     "zero_fill, device, stream)\n--\n\n"
     "A plan's write-backs and fetches of records over the pinned mapping; written (a byte a row, 0: none) "
     "marks rows bypassed or written back, and a fetched row not marked gets zeros for the arrays of the "
     "zero_fill bits"},
    {"cuda_cache_gather", HEB_KW_FUNC(heb_cuda_cache_gather), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_gather($module, /, *, records, host, num_rows, dim, unique, slot, n, out, device, stream)\n--\n\n"
     "out[k] = unique[k]'s row: from its slot, or over the mapping where slot[k] is -1"},
    {"cuda_cache_adam", HEB_KW_FUNC(heb_cuda_cache_adam), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_adam($module, /, *, cache, records, host, dim, indices, values, nnz, lr, beta1, beta2, eps, step, "
     "maximize, weight_decay, device, stream)\n--\n\n"
     "SparseAdam of distinct rows, each in its slot or in host memory"},
    {"cuda_cache_adam_compact", HEB_KW_FUNC(heb_cuda_cache_adam_compact), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_adam_compact($module, /, *, cache, records, host, dim, m_dtype, v_dtype, indices, values, nnz, lr, "
     "beta1, beta2, eps, step, maximize, weight_decay, device, stream)\n--\n\n"
     "cuda_cache_adam on bfloat16 or 8-bit moments (their scales after them), with the CPU core's bits"},
    {"cuda_cache_update", HEB_KW_FUNC(heb_cuda_cache_update), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_update($module, /, *, cache, records, host, dim, kind, indices, values, nnz, lr, eps, lr_decay, "
     "step, maximize, weight_decay, device, stream)\n--\n\n"
     "SGD, Adagrad or row-wise Adagrad (kind) of distinct rows, each in its slot or in host memory, with the CPU "
     "core's bits"},
    {"cuda_cache_sync_records", HEB_KW_FUNC(heb_cuda_cache_sync_records), METH_VARARGS | METH_KEYWORDS,
     "cuda_cache_sync_records($module, /, *, cache, records, host, dim, to_host, written, device, stream)\n--\n\n"
     "Every occupied slot's records written to their host rows (to_host; their rows marked in written, 0: "
     "none) or read from them"},
    {NULL, NULL, 0, NULL},
};

int heb_cuda_cache_add(PyObject *module)
{
    return PyModule_AddFunctions(module, heb_cuda_cache_methods);
}

#else /* !HE_WITH_CUDA */

int heb_cuda_cache_add(PyObject *module)
{
    (void)module;
    return 0;
}

#endif
