/* The CPython binding: the only file that includes Python.h.
 *
 * Every function takes raw addresses and sizes (the Python layer owns the
 * torch tensors and keeps them alive for the call), releases the GIL around
 * the work and turns a he_status into the matching Python exception. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dedup.h"
#include "gather.h"
#include "grad_reduce.h"
#include "host_memory.h"
#include "renorm.h"
#include "sparse_adam.h"
#include "thread_pool.h"
#ifdef HE_WITH_CUDA
#include "he_cuda.h"
#endif

static PyObject *raise_status(he_status st)
{
    PyObject *type;
    switch (st) {
    case HE_ERR_NOMEM: type = PyExc_MemoryError; break;
    case HE_ERR_INDEX: type = PyExc_IndexError; break;
    case HE_ERR_VALUE: type = PyExc_ValueError; break;
    case HE_ERR_CUDA: type = PyExc_RuntimeError; break;
    default: type = PyExc_OSError; break;
    }
    PyErr_SetString(type, he_last_error());
    return NULL;
}

static he_ids make_ids(unsigned long long addr, long long count, int is_int64)
{
    he_ids ids = {(const void *)(uintptr_t)addr, count, is_int64};
    return ids;
}

/* ---- HostBuffer: one big host allocation, exported through the buffer
 * protocol so torch.frombuffer can alias it without a copy. */

typedef struct {
    PyObject_HEAD
    void *ptr;
    size_t nbytes;
    int scratch; /* recycled through the core's scratch cache when dropped */
    /* Pinned and mapped for the GPU (cuda_register): the device address of
     * ptr and the device it was registered from; -1: not registered. */
    void *device_ptr;
    int cuda_device;
    PyObject *weakrefs; /* the Python layer finds buffers by address through weak references */
} HostBuffer;

static PyObject *HostBuffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "first_touch", "scratch", NULL};
    long long nbytes;
    int first_touch = 0, scratch = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|pp", kwlist, &nbytes, &first_touch, &scratch))
        return NULL;
    if (nbytes < 0 || (unsigned long long)nbytes > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_ValueError, "nbytes must be in [0, %zd], got %lld", PY_SSIZE_T_MAX, nbytes);
        return NULL;
    }
    HostBuffer *self = (HostBuffer *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->cuda_device = -1; /* tp_alloc zeroes, and 0 is a device */
    he_status st;
    void *ptr = NULL;
    size_t mapped = (size_t)nbytes;
    Py_BEGIN_ALLOW_THREADS
    st = scratch ? he_scratch_alloc((size_t)nbytes, &ptr, &mapped) : he_host_alloc((size_t)nbytes, &ptr);
    if (st == HE_OK && first_touch)
        st = he_host_first_touch(ptr, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK) {
        if (scratch)
            he_scratch_release(ptr, mapped);
        else
            he_host_free(ptr, (size_t)nbytes);
        Py_DECREF(self);
        return raise_status(st);
    }
    self->ptr = ptr;
    /* A scratch buffer exposes its whole size class: the caller views the
     * prefix it asked for. */
    self->nbytes = mapped;
    self->scratch = scratch;
    return (PyObject *)self;
}

static void HostBuffer_dealloc(HostBuffer *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
#ifdef HE_WITH_CUDA
    /* Before munmap: the pages must not stay pinned (or be read by a
     * kernel) once they are gone. */
    if (self->cuda_device >= 0) {
        Py_BEGIN_ALLOW_THREADS
        he_cuda_unregister(self->ptr, self->nbytes, self->cuda_device);
        Py_END_ALLOW_THREADS
    }
#endif
    if (self->scratch)
        he_scratch_release(self->ptr, self->nbytes);
    else
        he_host_free(self->ptr, self->nbytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A view holds a reference to the buffer, so the memory outlives every
 * tensor made from it. */
static int HostBuffer_getbuffer(HostBuffer *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, (Py_ssize_t)self->nbytes, 0, flags);
}

static PyObject *HostBuffer_address(HostBuffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *HostBuffer_nbytes(HostBuffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->nbytes);
}

static PyObject *HostBuffer_device_address(HostBuffer *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0)
        Py_RETURN_NONE;
    return PyLong_FromVoidPtr(self->device_ptr);
}

static PyObject *HostBuffer_cuda_device(HostBuffer *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->cuda_device);
}

static PyObject *HostBuffer_cuda_register(HostBuffer *self, PyObject *arg)
{
    long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
#ifdef HE_WITH_CUDA
    if (self->scratch) {
        PyErr_SetString(PyExc_ValueError, "scratch buffers are recycled between steps and are never registered");
        return NULL;
    }
    if (self->cuda_device >= 0) {
        PyErr_Format(PyExc_ValueError, "this buffer is already registered (from CUDA device %d)", self->cuda_device);
        return NULL;
    }
    if (device < 0 || device > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "CUDA device index must be >= 0, got %ld", device);
        return NULL;
    }
    void *device_ptr = NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_register(self->ptr, self->nbytes, (int)device, &device_ptr);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    self->device_ptr = device_ptr;
    self->cuda_device = (int)device;
    Py_RETURN_NONE;
#else
    (void)self;
    PyErr_SetString(PyExc_RuntimeError, "hostembed was built without CUDA: host buffers cannot be registered");
    return NULL;
#endif
}

static PyMethodDef HostBuffer_methods[] = {
    {"cuda_register", (PyCFunction)HostBuffer_cuda_register, METH_O,
     "cuda_register(device): pin and map for zero-copy GPU access (cudaHostRegister Mapped|Portable, "
     "in chunks); unregistered when the buffer is freed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HostBuffer_getset[] = {
    {"address", (getter)HostBuffer_address, NULL, "address of the first byte", NULL},
    {"nbytes", (getter)HostBuffer_nbytes, NULL, "size in bytes", NULL},
    {"device_address", (getter)HostBuffer_device_address, NULL,
     "device address of the first byte once registered, else None", NULL},
    {"cuda_device", (getter)HostBuffer_cuda_device, NULL, "the device it was registered from, else None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyBufferProcs HostBuffer_as_buffer = {
    (getbufferproc)HostBuffer_getbuffer,
    NULL,
};

static PyTypeObject HostBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hostembed._C.HostBuffer",
    .tp_doc = "HostBuffer(nbytes, first_touch=False, scratch=False): zeroed, lazily backed host memory;\n"
              "scratch=True: recycled on release, contents undefined",
    .tp_basicsize = sizeof(HostBuffer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = HostBuffer_new,
    .tp_dealloc = (destructor)HostBuffer_dealloc,
    .tp_as_buffer = &HostBuffer_as_buffer,
    .tp_getset = HostBuffer_getset,
    .tp_methods = HostBuffer_methods,
    .tp_weaklistoffset = offsetof(HostBuffer, weakrefs),
};

/* ---- Dedup: the sorted unique ids of one batch, kept between the calls
 * that size the outputs (Python allocates them) and fill them. */

typedef struct {
    PyObject_HEAD
    he_dedup *d;
} Dedup;

static PyObject *Dedup_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ids_address", "count", "is_int64", "num_rows", NULL};
    unsigned long long addr;
    long long count, num_rows;
    int is_int64;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KLpL", kwlist, &addr, &count, &is_int64, &num_rows))
        return NULL;
    Dedup *self = (Dedup *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    he_ids ids = make_ids(addr, count, is_int64);
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_dedup_build(&ids, num_rows, &self->d);
    Py_END_ALLOW_THREADS
    if (st != HE_OK) {
        Py_DECREF(self);
        return raise_status(st);
    }
    return (PyObject *)self;
}

static void Dedup_dealloc(Dedup *self)
{
    he_dedup_free(self->d);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Dedup_num_unique(Dedup *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->d->num_unique);
}

static PyGetSetDef Dedup_getset[] = {
    {"num_unique", (getter)Dedup_num_unique, NULL, "number of distinct ids", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DedupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hostembed._C.Dedup",
    .tp_doc = "Dedup(ids_address, count, is_int64, num_rows): sorted unique ids of a batch",
    .tp_basicsize = sizeof(Dedup),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Dedup_new,
    .tp_dealloc = (destructor)Dedup_dealloc,
    .tp_getset = Dedup_getset,
};

/* ---- functions */

static PyObject *py_gather(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long table, ids_addr, out;
    long long num_rows, dim, count;
    int is_int64;
    if (!PyArg_ParseTuple(args, "KLLKLpK", &table, &num_rows, &dim, &ids_addr, &count, &is_int64, &out))
        return NULL;
    he_ids ids = make_ids(ids_addr, count, is_int64);
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_gather((const float *)(uintptr_t)table, num_rows, dim, &ids, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_grad_reduce(PyObject *mod, PyObject *args)
{
    (void)mod;
    Dedup *dedup;
    unsigned long long grad, values, indices;
    long long dim, padding_idx;
    int scale;
    if (!PyArg_ParseTuple(args, "O!KLLpKK", &DedupType, &dedup, &grad, &dim, &padding_idx, &scale, &values,
                          &indices))
        return NULL;
    he_reduce_opts opts = {padding_idx, scale};
    int64_t written = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_grad_reduce(dedup->d, (const float *)(uintptr_t)grad, dim, &opts, (float *)(uintptr_t)values,
                        (int64_t *)(uintptr_t)indices, &written);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    return PyLong_FromLongLong(written);
}

static PyObject *py_renorm(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long table, ids_addr;
    long long num_rows, dim, count;
    int is_int64;
    double max_norm, norm_type;
    if (!PyArg_ParseTuple(args, "KLLKLpdd", &table, &num_rows, &dim, &ids_addr, &count, &is_int64, &max_norm,
                          &norm_type))
        return NULL;
    he_ids ids = make_ids(ids_addr, count, is_int64);
    he_dedup *d = NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_dedup_build(&ids, num_rows, &d);
    if (st == HE_OK)
        st = he_renorm((float *)(uintptr_t)table, num_rows, dim, d, max_norm, norm_type);
    he_dedup_free(d);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_sparse_adam(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long w, m, v, indices, values;
    long long num_rows, dim, nnz, step;
    he_adam_params hp;
    int maximize;
    if (!PyArg_ParseTuple(args, "KKKLLKKLddddLp", &w, &m, &v, &num_rows, &dim, &indices, &values, &nnz, &hp.lr,
                          &hp.beta1, &hp.beta2, &hp.eps, &step, &maximize))
        return NULL;
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_sparse_adam((float *)(uintptr_t)w, (float *)(uintptr_t)m, (float *)(uintptr_t)v, num_rows, dim,
                        (const int64_t *)(uintptr_t)indices, (const float *)(uintptr_t)values, nnz, &hp);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

#ifdef HE_WITH_CUDA
/* ---- the GPU path: addresses of torch CUDA tensors, of registered host
 * memory (device addresses), a device index and a stream handle. */

#define PTR(x) ((void *)(uintptr_t)(x))

static PyObject *py_cuda_dedup_workspace(PyObject *mod, PyObject *args)
{
    (void)mod;
    long long count, num_rows;
    int device;
    if (!PyArg_ParseTuple(args, "LLi", &count, &num_rows, &device))
        return NULL;
    size_t bytes = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_dedup_workspace(count, num_rows, device, &bytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    return PyLong_FromSize_t(bytes);
}

static PyObject *py_cuda_dedup(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long ids, workspace, unique, offsets, order, inverse, stream;
    long long count, num_rows, padding_idx;
    Py_ssize_t workspace_bytes;
    int is_int64, device;
    if (!PyArg_ParseTuple(args, "KLpLLKnKKKKiK", &ids, &count, &is_int64, &num_rows, &padding_idx, &workspace,
                          &workspace_bytes, &unique, &offsets, &order, &inverse, &device, &stream))
        return NULL;
    he_cuda_dedup_out out = {PTR(unique), PTR(offsets), PTR(order), PTR(inverse)};
    int64_t num_unique = 0, padding_slot = -1;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_dedup(PTR(ids), count, is_int64, num_rows, padding_idx, PTR(workspace), (size_t)workspace_bytes,
                       &out, &num_unique, &padding_slot, device, PTR(stream));
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    return Py_BuildValue("(LL)", (long long)num_unique, (long long)padding_slot);
}

static PyObject *py_cuda_gather(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long table, rows, out, stream;
    long long dim, count;
    int device;
    if (!PyArg_ParseTuple(args, "KLKLKiK", &table, &dim, &rows, &count, &out, &device, &stream))
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_gather(PTR(table), dim, PTR(rows), count, PTR(out), device, PTR(stream));
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_renorm(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long table, rows, stream;
    long long dim, count;
    double max_norm, norm_type;
    int device;
    if (!PyArg_ParseTuple(args, "KLKLddiK", &table, &dim, &rows, &count, &max_norm, &norm_type, &device, &stream))
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_renorm(PTR(table), dim, PTR(rows), count, max_norm, norm_type, device, PTR(stream));
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_grad_reduce_workspace(PyObject *mod, PyObject *args)
{
    (void)mod;
    long long count, num_unique, dim;
    int device;
    if (!PyArg_ParseTuple(args, "LLLi", &count, &num_unique, &dim, &device))
        return NULL;
    size_t bytes = 0;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_grad_reduce_workspace(count, num_unique, dim, device, &bytes);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    return PyLong_FromSize_t(bytes);
}

static PyObject *py_cuda_grad_reduce(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long grad, unique, offsets, order, inverse, workspace, values, indices, stream;
    long long dim, count, num_unique, padding_slot;
    Py_ssize_t workspace_bytes;
    int scale, device;
    if (!PyArg_ParseTuple(args, "KLLKKKKLLpKnKKiK", &grad, &dim, &count, &unique, &offsets, &order, &inverse,
                          &num_unique, &padding_slot, &scale, &workspace, &workspace_bytes, &values, &indices,
                          &device, &stream))
        return NULL;
    he_cuda_dedup_out d = {PTR(unique), PTR(offsets), PTR(order), PTR(inverse)};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_grad_reduce(PTR(grad), dim, count, &d, num_unique, padding_slot, scale, PTR(workspace),
                             (size_t)workspace_bytes, PTR(values), PTR(indices), device, PTR(stream));
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_sparse_adam(PyObject *mod, PyObject *args)
{
    (void)mod;
    unsigned long long w, m, v, indices, values, stream;
    long long dim, nnz, step;
    he_adam_params hp;
    int maximize, device;
    if (!PyArg_ParseTuple(args, "KKKLKKLddddLpiK", &w, &m, &v, &dim, &indices, &values, &nnz, &hp.lr, &hp.beta1,
                          &hp.beta2, &hp.eps, &step, &maximize, &device, &stream))
        return NULL;
    hp.step = step;
    hp.maximize = maximize;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_cuda_sparse_adam(PTR(w), PTR(m), PTR(v), dim, PTR(indices), PTR(values), nnz, &hp, device, PTR(stream));
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}
#endif /* HE_WITH_CUDA */

static PyObject *py_set_num_threads(PyObject *mod, PyObject *arg)
{
    (void)mod;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 1 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "number of threads must be a positive integer, got %ld", n);
        return NULL;
    }
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = he_set_num_threads((int)n);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    return PyLong_FromLong(he_get_num_threads());
}

static PyObject *py_empty_cache(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    he_scratch_trim();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"empty_cache", py_empty_cache, METH_NOARGS, "unmap the scratch buffers kept for reuse"},
    {"gather", py_gather, METH_VARARGS,
     "gather(table, num_rows, dim, ids, count, is_int64, out): out[i] = table[ids[i]]"},
    {"grad_reduce", py_grad_reduce, METH_VARARGS,
     "grad_reduce(dedup, grad, dim, padding_idx, scale_grad_by_freq, values, indices) -> rows written"},
    {"renorm", py_renorm, METH_VARARGS,
     "renorm(table, num_rows, dim, ids, count, is_int64, max_norm, norm_type): max_norm in place"},
    {"sparse_adam", py_sparse_adam, METH_VARARGS,
     "sparse_adam(w, m, v, num_rows, dim, indices, values, nnz, lr, beta1, beta2, eps, step, maximize)"},
    {"set_num_threads", py_set_num_threads, METH_O, "set the core's worker thread count"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "the core's worker thread count"},
#ifdef HE_WITH_CUDA
    {"cuda_dedup_workspace", py_cuda_dedup_workspace, METH_VARARGS,
     "cuda_dedup_workspace(count, num_rows, device) -> bytes of device scratch for cuda_dedup"},
    {"cuda_dedup", py_cuda_dedup, METH_VARARGS,
     "cuda_dedup(ids, count, is_int64, num_rows, padding_idx, workspace, workspace_bytes, unique, offsets, order, "
     "inverse, device, stream) -> (num_unique, padding_slot); IndexError before any write for a bad id"},
    {"cuda_gather", py_cuda_gather, METH_VARARGS,
     "cuda_gather(table_device, dim, rows, count, out, device, stream): out[k] = table[rows[k]]"},
    {"cuda_renorm", py_cuda_renorm, METH_VARARGS,
     "cuda_renorm(table_device, dim, rows, count, max_norm, norm_type, device, stream): max_norm in place"},
    {"cuda_grad_reduce_workspace", py_cuda_grad_reduce_workspace, METH_VARARGS,
     "cuda_grad_reduce_workspace(count, num_unique, dim, device) -> bytes of device scratch"},
    {"cuda_grad_reduce", py_cuda_grad_reduce, METH_VARARGS,
     "cuda_grad_reduce(grad, dim, count, unique, offsets, order, inverse, num_unique, padding_slot, "
     "scale_grad_by_freq, workspace, workspace_bytes, values, indices, device, stream)"},
    {"cuda_sparse_adam", py_cuda_sparse_adam, METH_VARARGS,
     "cuda_sparse_adam(w, m, v, dim, indices, values, nnz, lr, beta1, beta2, eps, step, maximize, device, stream)"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "hostembed._C", "hostembed's C core", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void)
{
    if (PyType_Ready(&HostBufferType) < 0 || PyType_Ready(&DedupType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    Py_INCREF(&HostBufferType);
    Py_INCREF(&DedupType);
#ifdef HE_WITH_CUDA
    PyObject *cuda_compiled = Py_True;
#else
    PyObject *cuda_compiled = Py_False;
#endif
    Py_INCREF(cuda_compiled);
    if (PyModule_AddObject(m, "HostBuffer", (PyObject *)&HostBufferType) < 0 ||
        PyModule_AddObject(m, "Dedup", (PyObject *)&DedupType) < 0 ||
        PyModule_AddObject(m, "CUDA_COMPILED", cuda_compiled) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
