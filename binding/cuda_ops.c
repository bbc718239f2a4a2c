/* The GPU ops: keyword-only bindings of cuda/he_cuda.h's launchers over
 * addresses of torch CUDA tensors, a device index and a stream handle
 * (torch's current_stream().cuda_stream). The host rows they read or write
 * (a table, its optimizer state) come as the HostBuffer objects: their
 * [num_rows, dim] shape is checked against the buffer's size and the buffer
 * must be registered (cuda_register) before anything is launched; the
 * kernels get its device address. Built without HE_WITH_CUDA, the module
 * has none of them (the Python layer checks _C.CUDA_COMPILED). */
#include "binding.h"

#ifdef HE_WITH_CUDA

#include "he_cuda.h"

/* workspace_bytes arrives as a long long ("L"); cast to size_t a negative
 * one would pass the kernels' "big enough" check. */
static int heb_check_workspace_bytes(long long workspace_bytes)
{
    if (workspace_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "workspace_bytes must be >= 0, got %lld", workspace_bytes);
        return -1;
    }
    return 0;
}

/* The device address of a [num_rows, dim] float32 table in a registered
 * HostBuffer: ValueError if the shape does not fit the buffer, or if the
 * buffer is not registered (an empty table needs no registration: NULL,
 * which no kernel dereferences). 0, or -1 with the exception set. */
int heb_device_rows(const heb_buffer *buf, long long num_rows, long long dim, he_table *host, void **device_rows)
{
    *device_rows = NULL;
    if (heb_buffer_table(buf, num_rows, dim, HE_F32, host) < 0)
        return -1;
    if (num_rows == 0 || dim == 0)
        return 0;
    if (buf->cuda_device < 0 || buf->device_ptr == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the HostBuffer is not registered with CUDA (call its cuda_register first); the kernels "
                     "read and write host rows only through a registered buffer's device address",
                     buf->name);
        return -1;
    }
    *device_rows = buf->device_ptr;
    return 0;
}

static PyObject *heb_cuda_dedup_workspace(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"count", "num_rows", "device", NULL};
    long long count, num_rows;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$LLi:cuda_dedup_workspace", kwlist, &count, &num_rows, &device))
        return NULL;
    size_t bytes = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_dedup_workspace(count, num_rows, device, &bytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyLong_FromSize_t(bytes);
}

static PyObject *heb_cuda_dedup(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"ids", "count", "ids_int64", "num_rows", "padding_idx", "workspace",
                             "workspace_bytes", "unique", "offsets", "order", "inverse", "device", "stream", NULL};
    HEB_ADDRESS(ids);
    HEB_ADDRESS(workspace);
    HEB_ADDRESS(unique);
    HEB_ADDRESS(offsets);
    HEB_ADDRESS(order);
    HEB_ADDRESS(inverse);
    HEB_ADDRESS(stream);
    long long count, num_rows, padding_idx, workspace_bytes;
    int ids_int64, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LpLLO&LO&O&O&O&iO&:cuda_dedup", kwlist, heb_address_converter,
                                     &ids, &count, &ids_int64, &num_rows, &padding_idx, heb_address_converter,
                                     &workspace, &workspace_bytes, heb_address_converter, &unique,
                                     heb_address_converter, &offsets, heb_address_converter, &order,
                                     heb_address_converter, &inverse, &device, heb_address_converter, &stream))
        return NULL;
    if (heb_check_workspace_bytes(workspace_bytes) < 0)
        return NULL;
    he_cuda_dedup_out out = {unique.ptr, offsets.ptr, order.ptr, inverse.ptr};
    int64_t num_unique = 0, padding_slot = -1;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_dedup(ids.ptr, count, ids_int64, num_rows, padding_idx, workspace.ptr, (size_t)workspace_bytes,
                       &out, &num_unique, &padding_slot, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return Py_BuildValue("(LL)", (long long)num_unique, (long long)padding_slot);
}

static PyObject *heb_cuda_gather(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"table", "num_rows", "dim", "rows", "count", "out", "device", "stream", NULL};
    HEB_BUFFER(table);
    HEB_ADDRESS(rows);
    HEB_ADDRESS(out);
    HEB_ADDRESS(stream);
    long long num_rows, dim, count;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LLO&LO&iO&:cuda_gather", kwlist, heb_buffer_converter,
                                     &table, &num_rows, &dim, heb_address_converter, &rows, &count,
                                     heb_address_converter, &out, &device, heb_address_converter, &stream))
        return NULL;
    he_table host;
    void *device_rows;
    if (heb_device_rows(&table, num_rows, dim, &host, &device_rows) < 0)
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_gather((const float *)device_rows, dim, rows.ptr, count, out.ptr, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_renorm(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"table", "num_rows", "dim", "rows", "count", "max_norm", "norm_type", "device",
                             "stream", NULL};
    HEB_BUFFER(table);
    HEB_ADDRESS(rows);
    HEB_ADDRESS(stream);
    long long num_rows, dim, count;
    double max_norm, norm_type;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LLO&LddiO&:cuda_renorm", kwlist, heb_buffer_converter, &table,
                                     &num_rows, &dim, heb_address_converter, &rows, &count, &max_norm, &norm_type,
                                     &device, heb_address_converter, &stream))
        return NULL;
    he_table host;
    void *device_rows;
    if (heb_device_rows(&table, num_rows, dim, &host, &device_rows) < 0)
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_renorm((float *)device_rows, dim, rows.ptr, count, max_norm, norm_type, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_grad_reduce_workspace(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"count", "num_unique", "dim", "device", NULL};
    long long count, num_unique, dim;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$LLLi:cuda_grad_reduce_workspace", kwlist, &count, &num_unique,
                                     &dim, &device))
        return NULL;
    size_t bytes = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_grad_reduce_workspace(count, num_unique, dim, device, &bytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return PyLong_FromSize_t(bytes);
}

static PyObject *heb_cuda_grad_reduce(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"grad", "dim", "count", "unique", "offsets", "order", "inverse", "num_unique",
                             "padding_slot", "scale_grad_by_freq", "workspace", "workspace_bytes", "values",
                             "indices", "device", "stream", NULL};
    HEB_ADDRESS(grad);
    HEB_ADDRESS(unique);
    HEB_ADDRESS(offsets);
    HEB_ADDRESS(order);
    HEB_ADDRESS(inverse);
    HEB_ADDRESS(workspace);
    HEB_ADDRESS(values);
    HEB_ADDRESS(indices);
    HEB_ADDRESS(stream);
    long long dim, count, num_unique, padding_slot, workspace_bytes;
    int scale, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LLO&O&O&O&LLpO&LO&O&iO&:cuda_grad_reduce", kwlist,
                                     heb_address_converter, &grad, &dim, &count, heb_address_converter, &unique,
                                     heb_address_converter, &offsets, heb_address_converter, &order,
                                     heb_address_converter, &inverse, &num_unique, &padding_slot, &scale,
                                     heb_address_converter, &workspace, &workspace_bytes, heb_address_converter,
                                     &values, heb_address_converter, &indices, &device, heb_address_converter,
                                     &stream))
        return NULL;
    if (heb_check_workspace_bytes(workspace_bytes) < 0)
        return NULL;
    he_cuda_dedup_out d = {unique.ptr, offsets.ptr, order.ptr, inverse.ptr};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_grad_reduce(grad.ptr, dim, count, &d, num_unique, padding_slot, scale, workspace.ptr,
                             (size_t)workspace_bytes, values.ptr, indices.ptr, device, stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cuda_sparse_adam(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    static char *kwlist[] = {"weight", "exp_avg", "exp_avg_sq", "num_rows", "dim", "indices", "values", "nnz",
                             "lr", "beta1", "beta2", "eps", "step", "maximize", "weight_decay", "device", "stream",
                             NULL};
    HEB_BUFFER(weight);
    HEB_BUFFER(exp_avg);
    HEB_BUFFER(exp_avg_sq);
    HEB_ADDRESS(indices);
    HEB_ADDRESS(values);
    HEB_ADDRESS(stream);
    long long num_rows, dim, nnz, step;
    he_adam_params hp = {0};
    int maximize, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&O&O&LLO&O&LddddLpdiO&:cuda_sparse_adam", kwlist,
                                     heb_buffer_converter, &weight, heb_buffer_converter, &exp_avg,
                                     heb_buffer_converter, &exp_avg_sq, &num_rows, &dim, heb_address_converter,
                                     &indices, heb_address_converter, &values, &nnz, &hp.lr, &hp.beta1, &hp.beta2,
                                     &hp.eps, &step, &maximize, &hp.weight_decay, &device, heb_address_converter,
                                     &stream))
        return NULL;
    he_table hw, hm, hv;
    void *w, *m, *v;
    if (heb_device_rows(&weight, num_rows, dim, &hw, &w) < 0 ||
        heb_device_rows(&exp_avg, num_rows, dim, &hm, &m) < 0 ||
        heb_device_rows(&exp_avg_sq, num_rows, dim, &hv, &v) < 0)
        return NULL;
    /* The kernel reads and writes the three through __restrict__ pointers. */
    if (he_table_overlap(&hw, &hm) || he_table_overlap(&hw, &hv) || he_table_overlap(&hm, &hv)) {
        PyErr_SetString(PyExc_ValueError, "cuda_sparse_adam: weight, exp_avg and exp_avg_sq must not share memory");
        return NULL;
    }
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_sparse_adam((float *)w, (float *)m, (float *)v, dim, indices.ptr, values.ptr, nnz, &hp, device,
                             stream.ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyMethodDef heb_cuda_methods[] = {
    {"cuda_dedup_workspace", HEB_KW_FUNC(heb_cuda_dedup_workspace), METH_VARARGS | METH_KEYWORDS,
     "cuda_dedup_workspace($module, /, *, count, num_rows, device)\n--\n\n"
     "Bytes of device scratch for cuda_dedup"},
    {"cuda_dedup", HEB_KW_FUNC(heb_cuda_dedup), METH_VARARGS | METH_KEYWORDS,
     "cuda_dedup($module, /, *, ids, count, ids_int64, num_rows, padding_idx, workspace, workspace_bytes, unique, "
     "offsets, order, inverse, device, stream)\n--\n\n"
     "-> (num_unique, padding_slot); IndexError before any write for a bad id"},
    {"cuda_gather", HEB_KW_FUNC(heb_cuda_gather), METH_VARARGS | METH_KEYWORDS,
     "cuda_gather($module, /, *, table, num_rows, dim, rows, count, out, device, stream)\n--\n\n"
     "out[k] = table[rows[k]]; table: the registered HostBuffer of the [num_rows, dim] rows, rows: in range "
     "(from cuda_dedup)"},
    {"cuda_renorm", HEB_KW_FUNC(heb_cuda_renorm), METH_VARARGS | METH_KEYWORDS,
     "cuda_renorm($module, /, *, table, num_rows, dim, rows, count, max_norm, norm_type, device, stream)\n--\n\n"
     "max_norm in place on rows[:count] of the table (its registered HostBuffer of [num_rows, dim] rows)"},
    {"cuda_grad_reduce_workspace", HEB_KW_FUNC(heb_cuda_grad_reduce_workspace), METH_VARARGS | METH_KEYWORDS,
     "cuda_grad_reduce_workspace($module, /, *, count, num_unique, dim, device)\n--\n\n"
     "Bytes of device scratch for cuda_grad_reduce"},
    {"cuda_grad_reduce", HEB_KW_FUNC(heb_cuda_grad_reduce), METH_VARARGS | METH_KEYWORDS,
     "cuda_grad_reduce($module, /, *, grad, dim, count, unique, offsets, order, inverse, num_unique, "
     "padding_slot, scale_grad_by_freq, workspace, workspace_bytes, values, indices, device, stream)\n--\n\n"
     "The coalesced sparse gradient of a lookup from cuda_dedup's outputs, without atomics"},
    {"cuda_sparse_adam", HEB_KW_FUNC(heb_cuda_sparse_adam), METH_VARARGS | METH_KEYWORDS,
     "cuda_sparse_adam($module, /, *, weight, exp_avg, exp_avg_sq, num_rows, dim, indices, values, nnz, lr, "
     "beta1, beta2, eps, step, maximize, weight_decay, device, stream)\n--\n\n"
     "SparseAdam through mapped memory: weight/exp_avg/exp_avg_sq are the registered HostBuffers of "
     "[num_rows, dim] rows each; indices unique and in range"},
    {NULL, NULL, 0, NULL},
};

int heb_cuda_ops_add(PyObject *module)
{
    return PyModule_AddFunctions(module, heb_cuda_methods);
}

#else /* !HE_WITH_CUDA */

int heb_cuda_ops_add(PyObject *module)
{
    (void)module;
    return 0;
}

#endif
