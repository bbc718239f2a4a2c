/* HostBuffer: one big host allocation, exported through the buffer protocol
 * so torch.frombuffer can alias it without a copy, and pinned + mapped for
 * the GPU on request (cuda_register). */
#include "binding.h"

#include <unistd.h>

#include "host_memory.h"
#ifdef HE_WITH_CUDA
#include "he_cuda.h"
#endif

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
    pid_t owner; /* the process that mapped it */
} heb_host_buffer;

static PyObject *heb_host_buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "first_touch", "scratch", "fd", NULL};
    long long nbytes;
    int first_touch = 0, scratch = 0, fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|ppi", kwlist, &nbytes, &first_touch, &scratch, &fd))
        return NULL;
    if (nbytes < 0 || (unsigned long long)nbytes > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_ValueError, "nbytes must be in [0, %zd], got %lld", PY_SSIZE_T_MAX, nbytes);
        return NULL;
    }
    /* A shared file's memory is written by its creator only: zeroing it
     * here, in every process that maps it, would wipe its rows. */
    if (fd >= 0 && (first_touch || scratch)) {
        PyErr_SetString(PyExc_ValueError, "a buffer over a shared file (fd) takes neither first_touch nor scratch");
        return NULL;
    }
    heb_host_buffer *self = (heb_host_buffer *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->cuda_device = -1; /* tp_alloc zeroes, and 0 is a device */
    self->owner = getpid();
    he_status st;
    void *ptr = NULL;
    size_t mapped = (size_t)nbytes;
    Py_BEGIN_ALLOW_THREADS
    if (fd >= 0)
        st = he_host_map_shared(fd, (size_t)nbytes, &ptr);
    else
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
        return heb_raise_status(st);
    }
    self->ptr = ptr;
    /* A scratch buffer exposes its whole size class: the caller views the
     * prefix it asked for. */
    self->nbytes = mapped;
    self->scratch = scratch;
    return (PyObject *)self;
}

static void heb_host_buffer_dealloc(heb_host_buffer *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    /* In a forked child a table's range is not mapped (MADV_DONTFORK), and
     * the child's own mappings may have taken it since: a munmap there
     * would pull the child's memory (its own tables) from under it. Its
     * CUDA registration is the parent's too. Scratch memory is inherited
     * (copied), and goes to the child's scratch cache. */
    if (!self->scratch && self->owner != getpid()) {
        Py_TYPE(self)->tp_free((PyObject *)self);
        return;
    }
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
static int heb_host_buffer_getbuffer(heb_host_buffer *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, (Py_ssize_t)self->nbytes, 0, flags);
}

static PyObject *heb_host_buffer_address(heb_host_buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *heb_host_buffer_nbytes(heb_host_buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->nbytes);
}

static PyObject *heb_host_buffer_device_address(heb_host_buffer *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0)
        Py_RETURN_NONE;
    return PyLong_FromVoidPtr(self->device_ptr);
}

static PyObject *heb_host_buffer_cuda_device(heb_host_buffer *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->cuda_device);
}

static PyObject *heb_host_buffer_cuda_register(heb_host_buffer *self, PyObject *arg)
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
        return heb_raise_status(st);
    self->device_ptr = device_ptr;
    self->cuda_device = (int)device;
    Py_RETURN_NONE;
#else
    (void)self;
    PyErr_SetString(PyExc_RuntimeError, "hostembed was built without CUDA: host buffers cannot be registered");
    return NULL;
#endif
}

static PyMethodDef heb_host_buffer_methods[] = {
    {"cuda_register", (PyCFunction)heb_host_buffer_cuda_register, METH_O,
     "cuda_register(device): pin and map for zero-copy GPU access (cudaHostRegister Mapped|Portable, "
     "in chunks); unregistered when the buffer is freed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef heb_host_buffer_getset[] = {
    {"address", (getter)heb_host_buffer_address, NULL, "address of the first byte", NULL},
    {"nbytes", (getter)heb_host_buffer_nbytes, NULL, "size in bytes", NULL},
    {"device_address", (getter)heb_host_buffer_device_address, NULL,
     "device address of the first byte once registered, else None", NULL},
    {"cuda_device", (getter)heb_host_buffer_cuda_device, NULL, "the device it was registered from, else None",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyBufferProcs heb_host_buffer_as_buffer = {
    (getbufferproc)heb_host_buffer_getbuffer,
    NULL,
};

static PyTypeObject heb_host_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hostembed._core._C.HostBuffer",
    .tp_doc = "HostBuffer(nbytes, first_touch=False, scratch=False, fd=-1)\n--\n\n"
              "Zeroed, lazily backed host memory; scratch=True: recycled on release, contents undefined; "
              "fd >= 0: the first nbytes of that file, mapped shared (the file's contents)",
    .tp_basicsize = sizeof(heb_host_buffer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = heb_host_buffer_new,
    .tp_dealloc = (destructor)heb_host_buffer_dealloc,
    .tp_as_buffer = &heb_host_buffer_as_buffer,
    .tp_getset = heb_host_buffer_getset,
    .tp_methods = heb_host_buffer_methods,
    .tp_weaklistoffset = offsetof(heb_host_buffer, weakrefs),
};

int heb_buffer_converter(PyObject *obj, void *out)
{
    heb_buffer *b = out;
    if (!PyObject_TypeCheck(obj, &heb_host_buffer_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a hostembed._core._C.HostBuffer (the table's own memory), got %.100s",
                     b->name, Py_TYPE(obj)->tp_name);
        return 0;
    }
    heb_host_buffer *hb = (heb_host_buffer *)obj;
    b->ptr = hb->ptr;
    b->nbytes = hb->nbytes;
    b->device_ptr = hb->cuda_device >= 0 ? hb->device_ptr : NULL;
    b->cuda_device = hb->cuda_device;
    return 1;
}

int heb_buffer_table(const heb_buffer *buf, long long num_rows, long long dim, int dtype, he_table *out)
{
    *out = he_table_typed(buf->ptr, buf->nbytes, (int64_t)num_rows, (int64_t)dim, dtype);
    he_status st = he_table_check(out, buf->name);
    if (st != HE_OK) {
        heb_raise_status(st);
        return -1;
    }
    return 0;
}

int heb_host_buffer_add(PyObject *module)
{
    if (PyType_Ready(&heb_host_buffer_type) < 0)
        return -1;
    Py_INCREF(&heb_host_buffer_type);
    if (PyModule_AddObject(module, "HostBuffer", (PyObject *)&heb_host_buffer_type) < 0) {
        Py_DECREF(&heb_host_buffer_type);
        return -1;
    }
    return 0;
}
