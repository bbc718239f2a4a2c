/* The address arguments' converter: every raw pointer an op takes from
 * Python passes here, so a bad one fails before any work, naming its
 * argument. */
#include "binding.h"

#include <limits.h>

int heb_address_converter(PyObject *obj, void *out)
{
    heb_address *a = out;
    /* bool is an int subclass; True as an address is a swapped flag. */
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an address (a non-negative int), got %.100s", a->name,
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred())
        return 0;
    if (overflow < 0 || (overflow == 0 && value < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be an address (a non-negative int), got %R", a->name, obj);
        return 0;
    }
    unsigned long long address = (unsigned long long)value;
    if (overflow > 0) {
        address = PyLong_AsUnsignedLongLong(obj);
        if (address == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s must be an address below 2**64, got %R", a->name, obj);
            return 0;
        }
    }
#if UINTPTR_MAX < ULLONG_MAX
    if (address > UINTPTR_MAX) {
        PyErr_Format(PyExc_ValueError, "%s must be an address below 2**%d, got %R", a->name,
                     (int)(8 * sizeof(uintptr_t)), obj);
        return 0;
    }
#endif
    a->ptr = (void *)(uintptr_t)address;
    return 1;
}
