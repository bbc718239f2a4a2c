/* read_rows / write_rows: a table file's rows moved by the core's I/O
 * threads (csrc/row_file.h). Rows and buffers come as addresses of tensors
 * the Python layer (_core/table_files.py) allocates and keeps alive. */
#include "binding.h"

#include "row_file.h"

static PyObject *move(PyObject *args, PyObject *kwds, int write)
{
    static char *kwlist[] = {"fd", "direct_fd", "align", "row_bytes", "num_rows", "offset", "path", "rows", "count",
                             "buffer", "threads", "read_removed", NULL};
    int fd, direct_fd, threads, read_removed;
    long long row_bytes, num_rows, count;
    unsigned long long offset, align;
    const char *path;
    HEB_ADDRESS(rows);
    HEB_ADDRESS(buffer);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, write ? "$iiKLLKsO&LO&ip:write_rows" : "$iiKLLKsO&LO&ip:read_rows",
                                     kwlist, &fd, &direct_fd, &align, &row_bytes, &num_rows, &offset, &path,
                                     heb_address_converter, &rows, &count, heb_address_converter, &buffer, &threads, &read_removed))
        return NULL;
    if (row_bytes <= 0 || count < 0) {
        PyErr_Format(PyExc_ValueError, "%s needs rows of at least one byte and a count >= 0, got %lld and %lld",
                     write ? "write_rows" : "read_rows", row_bytes, count);
        return NULL;
    }
    he_row_file f = {fd, direct_fd, (size_t)align, (size_t)row_bytes, num_rows, offset, path, read_removed};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    st = write ? he_row_file_write(&f, rows.ptr, (size_t)count, buffer.ptr, threads)
               : he_row_file_read(&f, rows.ptr, (size_t)count, buffer.ptr, threads);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_read_rows(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    return move(args, kwds, 0);
}

static PyObject *heb_write_rows(PyObject *mod, PyObject *args, PyObject *kwds)
{
    (void)mod;
    return move(args, kwds, 1);
}

static PyObject *heb_inject_io_error(PyObject *mod, PyObject *args)
{
    (void)mod;
    long long after;
    int error;
    if (!PyArg_ParseTuple(args, "Li:inject_io_error", &after, &error))
        return NULL;
    he_row_file_inject_error(after, error);
    Py_RETURN_NONE;
}

#define ROW_FILE_ARGS "*, fd, direct_fd, align, row_bytes, num_rows, offset, path, rows, count, buffer, threads, read_removed"

static PyMethodDef heb_row_file_methods[] = {
    {"read_rows", HEB_KW_FUNC(heb_read_rows), METH_VARARGS | METH_KEYWORDS,
     "read_rows(" ROW_FILE_ARGS ")\n--\n\nReads `count` rows (int64 ids at `rows`, ascending, distinct) of a table "
     "file into `buffer`, with up to `threads` requests in flight (through `direct_fd`, the file opened with O_DIRECT, "
     "with offsets, lengths and memory multiples of `align`, where it is not -1); OSError naming the row for a failed or short "
     "read, a truncated or removed file"},
    {"write_rows", HEB_KW_FUNC(heb_write_rows), METH_VARARGS | METH_KEYWORDS,
     "write_rows(" ROW_FILE_ARGS ")\n--\n\nWrites `count` rows from `buffer` to a table file (as read_rows)"},
    {"inject_io_error", heb_inject_io_error, METH_VARARGS,
     "inject_io_error(after, errno)\n--\n\nFor tests: the after-th row-file request from now fails with errno "
     "(0 turns it off)"},
    {NULL, NULL, 0, NULL},
};

int heb_row_file_add(PyObject *module)
{
    return PyModule_AddFunctions(module, heb_row_file_methods);
}
