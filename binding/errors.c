/* The one place a he_status becomes a Python exception, so that every op
 * raises the same type for the same failure. */
#include "binding.h"

PyObject *heb_raise_status(he_status st)
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
