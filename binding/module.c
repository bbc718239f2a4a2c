/* hostembed._core._C: the CPython binding of the core (csrc/) and the kernels
 * (cuda/). binding/ is the only code that includes Python.h:
 *   module.c      PyInit__C and the module's own functions (threads, scratch
 *                 cache, CUDA_COMPILED); it registers the files below and
 *                 nothing calls it;
 *   cpu_ops.c     Dedup, gather, grad_reduce, renorm, sparse_update;
 *   cuda_ops.c    the cuda_* launchers (built with HE_WITH_CUDA only);
 *   cache.c       the CachePlanner type;
 *   host_buffer.c the HostBuffer type (big host allocations, pinning) and
 *                 the ops' HostBuffer arguments;
 *   errors.c      he_status -> exception (heb_raise_status);
 *   address.c     the ops' address arguments (heb_address_converter).
 *
 * Every op takes its arguments by keyword only, releases the GIL around the
 * work and turns a he_status into the matching exception. A table and its
 * optimizer state (memory the core reads and writes in place) come as their
 * HostBuffer objects, and the table's shape is checked against the buffer's
 * own size before any work (he_table_check; for the GPU ops also that the
 * buffer is registered); everything else (ids, gradients, outputs, the
 * Python layer's torch tensors, kept alive for the call) comes as raw
 * addresses and sizes.
 *
 * Adding an op:
 *   1. the work: a core function in csrc/ (returns he_status, never raises)
 *      or an extern "C" launcher in cuda/ declared in cuda/he_cuda.h; types
 *      both sides use go in include/ (csrc/ and cuda/ never include each
 *      other's headers);
 *   2. a keyword-only binding in cpu_ops.c or cuda_ops.c: "$" first in the
 *      PyArg_ParseTupleAndKeywords format, tables through HEB_BUFFER + "O&"
 *      heb_buffer_converter then heb_buffer_table, other addresses through
 *      HEB_ADDRESS + "O&" heb_address_converter, sizes "L", flags "p",
 *      floats "d", the call between Py_BEGIN/END_ALLOW_THREADS,
 *      heb_raise_status on failure, and a docstring starting with its text
 *      signature;
 *   3. the torch custom op in python/hostembed/_core/ops/, the only Python
 *      caller of _C (schema, fake implementation, autograd; tensors become
 *      addresses there and nowhere else, and an op that touches a table
 *      holds HostTable.lock around the call). */
#include "binding.h"

#include "host_memory.h"
#include "thread_pool.h"

static PyObject *heb_set_num_threads(PyObject *mod, PyObject *arg)
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
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_get_num_threads(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    int n;
    /* It waits for a parallel job in flight (the pool's job lock). */
    Py_BEGIN_ALLOW_THREADS
    n = he_get_num_threads();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *heb_empty_cache(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    he_scratch_trim();
    Py_RETURN_NONE;
}

static PyMethodDef heb_module_methods[] = {
    {"empty_cache", heb_empty_cache, METH_NOARGS, "unmap the scratch buffers kept for reuse"},
    {"set_num_threads", heb_set_num_threads, METH_O, "set the core's worker thread count"},
    {"get_num_threads", heb_get_num_threads, METH_NOARGS, "the core's worker thread count"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef heb_module_def = {
    PyModuleDef_HEAD_INIT, "hostembed._core._C", "hostembed's C core", -1, heb_module_methods, NULL, NULL, NULL, NULL,
};

/* A build of one SIMD level (setup.py's HOSTEMBED_SIMD, for testing) runs
 * that level's instructions unconditionally: on a CPU without them the
 * first row loop would die of SIGILL, so the import refuses instead. */
static int heb_simd_level_ok(const char **level)
{
#if defined(HE_SIMD_ONLY) && defined(__GNUC__) && defined(__x86_64__)
#if HE_SIMD_ONLY == 4
    *level = "avx512";
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2");
#elif HE_SIMD_ONLY == 3
    *level = "avx2";
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#else
    *level = "default";
    return 1;
#endif
#else
    *level = "all"; /* every level built, one chosen at load time (csrc/simd.h) */
    return 1;
#endif
}

PyMODINIT_FUNC PyInit__C(void)
{
    const char *level;
    if (!heb_simd_level_ok(&level)) {
        PyErr_Format(PyExc_ImportError,
                     "hostembed was built for the %s SIMD level only (HOSTEMBED_SIMD=%s, a testing build) and this "
                     "CPU lacks its instructions: rebuild without HOSTEMBED_SIMD",
                     level, level);
        return NULL;
    }
    PyObject *m = PyModule_Create(&heb_module_def);
    if (!m)
        return NULL;
    if (PyModule_AddStringConstant(m, "SIMD_LEVEL", level) < 0)
        goto fail;
#ifdef HE_WITH_CUDA
    PyObject *cuda_compiled = Py_True;
#else
    PyObject *cuda_compiled = Py_False;
#endif
    Py_INCREF(cuda_compiled);
    if (PyModule_AddObject(m, "CUDA_COMPILED", cuda_compiled) < 0) {
        Py_DECREF(cuda_compiled);
        goto fail;
    }
    if (heb_host_buffer_add(m) < 0 || heb_cpu_ops_add(m) < 0 || heb_bag_ops_add(m) < 0 || heb_cache_add(m) < 0 || heb_row_file_add(m) < 0 ||
        heb_cuda_ops_add(m) < 0 || heb_cuda_cache_add(m) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
