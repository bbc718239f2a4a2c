/* What the binding's files share: the status -> exception mapping
 * (errors.c), the address and HostBuffer argument converters (address.c,
 * host_buffer.c), and the registration function each file exports to
 * module.c. Everything here is named heb_ (the extension exports only
 * PyInit__C; the prefix keeps these apart from the core's he_ names even in
 * a build that exports more). */
#ifndef HEB_BINDING_H
#define HEB_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "he_status.h"
#include "table.h"

/* Raises the exception for st with the core's message for this thread:
 * NOMEM -> MemoryError, INDEX -> IndexError, VALUE -> ValueError,
 * CUDA -> RuntimeError, anything else -> OSError. Returns NULL. */
PyObject *heb_raise_status(he_status st);

/* An address argument (a torch data_ptr(), a stream handle, a HostBuffer
 * address) and its keyword name, so that the converter's error names it.
 * Declare with HEB_ADDRESS(table) and parse with "O&" and
 * heb_address_converter, &table; then use table.ptr. */
typedef struct heb_address {
    const char *name;
    void *ptr;
} heb_address;

#define HEB_ADDRESS(var) heb_address var = {#var, NULL}

/* PyArg "O&" converter for a heb_address: a Python int in [0, 2**64) (not a
 * bool). "K" would wrap a negative int into a huge pointer silently; this
 * raises TypeError for a non-int and ValueError for one out of range,
 * naming the argument. */
int heb_address_converter(PyObject *obj, void *out);

/* A HostBuffer argument (a table, or its optimizer state) and its keyword
 * name. The ops that read or write a table take the buffer object itself,
 * never its address, so the size they check a shape against is the one the
 * buffer was allocated with. Declare with HEB_BUFFER(table) and parse with
 * "O&" and heb_buffer_converter, &table; the call's arguments keep the
 * object alive while the GIL is released. */
typedef struct heb_buffer {
    const char *name;
    void *ptr;        /* host address of the first byte */
    size_t nbytes;
    void *device_ptr; /* its device address once registered, else NULL */
    int cuda_device;  /* the device it was registered from, or -1 */
} heb_buffer;

#define HEB_BUFFER(var) heb_buffer var = {#var, NULL, 0, NULL, -1}

/* PyArg "O&" converter for a heb_buffer: TypeError, naming the argument,
 * for anything but a hostembed._core._C.HostBuffer. */
int heb_buffer_converter(PyObject *obj, void *out);

/* The core's view of a [num_rows, dim] row-major float32 table over the
 * buffer, checked with he_table_check (the shape must fit the buffer's
 * bytes): 0, or -1 with ValueError set naming the argument. */
int heb_buffer_table(const heb_buffer *buf, long long num_rows, long long dim, int dtype, he_table *out);

/* cuda_ops.c, with HE_WITH_CUDA: the device address of a registered
 * [num_rows, dim] float32 table in `buf` (its shape checked against the
 * buffer); 0, or -1 with ValueError set. */
int heb_device_rows(const heb_buffer *buf, long long num_rows, long long dim, he_table *host, void **device_rows);

/* Registration, called once from PyInit__C: each adds its types and
 * functions to the module; 0 on success, -1 with an exception set. */
/* bag_ops.c: a bag batch tuple (its layout there) into out; -1 with an
 * exception set. out points into the tuple's objects: keep it alive. */
struct he_bag_batch;
int heb_parse_bag_batch(PyObject *item, struct he_bag_batch *out);

int heb_host_buffer_add(PyObject *module); /* host_buffer.c: HostBuffer */
int heb_cpu_ops_add(PyObject *module);     /* cpu_ops.c: Dedup, gather, grad_reduce, renorm, sparse_update */
int heb_bag_ops_add(PyObject *module);     /* bag_ops.c: pool_bags, bag_positions */
int heb_cache_add(PyObject *module);       /* cache.c: CachePlanner */
int heb_row_file_add(PyObject *module);    /* row_file.c: read_rows, write_rows */
int heb_cuda_ops_add(PyObject *module);    /* cuda_ops.c: cuda_*; adds nothing without HE_WITH_CUDA */
int heb_cuda_cache_add(PyObject *module);  /* cuda_cache.c: cuda_cache_*; likewise */

/* A METH_VARARGS | METH_KEYWORDS function in a PyMethodDef: through
 * void (*)(void), which -Wcast-function-type accepts as "any function". */
#define HEB_KW_FUNC(f) ((PyCFunction)(void (*)(void))(f))

#endif
