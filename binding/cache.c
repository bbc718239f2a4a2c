/* CachePlanner: the row cache's planner (csrc/cache_plan.h). A batch's
 * unique rows and the plan's arrays come as addresses of tensors the
 * Python layer allocates, sized for the batch. */
#include "binding.h"

#include "cache_plan.h"
#include "he_cache_policy.h"

/* The planner is not thread-safe and plan() releases the GIL: a lock
 * keeps two Python threads from planning on one planner at once. */
typedef struct {
    PyObject_HEAD
    he_cache *c;
    PyThread_type_lock lock;
} heb_cache;

static PyObject *heb_cache_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_rows", "capacity", "protect", "policy", NULL};
    long long num_rows, capacity;
    int protect, policy;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$LLii:CachePlanner", kwlist, &num_rows, &capacity, &protect,
                                     &policy))
        return NULL;
    heb_cache *self = (heb_cache *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    he_status st = he_cache_new(num_rows, capacity, protect, policy, &self->c);
    if (st != HE_OK) {
        Py_DECREF(self);
        return heb_raise_status(st);
    }
    return (PyObject *)self;
}

static void heb_cache_dealloc(heb_cache *self)
{
    if (self->lock)
        PyThread_free_lock(self->lock);
    he_cache_free(self->c);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *heb_cache_plan(heb_cache *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"unique", "num_unique", "slot", "fetch_row", "fetch_slot", "fetch_after_update",
                             "evict_slot", "evict_row", NULL};
    HEB_ADDRESS(unique);
    HEB_ADDRESS(slot);
    HEB_ADDRESS(fetch_row);
    HEB_ADDRESS(fetch_slot);
    HEB_ADDRESS(fetch_after_update);
    HEB_ADDRESS(evict_slot);
    HEB_ADDRESS(evict_row);
    long long num_unique;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LO&O&O&O&O&O&:plan", kwlist, heb_address_converter, &unique,
                                     &num_unique, heb_address_converter, &slot, heb_address_converter, &fetch_row,
                                     heb_address_converter, &fetch_slot, heb_address_converter,
                                     &fetch_after_update, heb_address_converter, &evict_slot,
                                     heb_address_converter, &evict_row))
        return NULL;
    he_cache_plan plan = {.max_unique = num_unique,
                          .slot = slot.ptr,
                          .fetch_row = fetch_row.ptr,
                          .fetch_slot = fetch_slot.ptr,
                          .fetch_after_update = fetch_after_update.ptr,
                          .evict_slot = evict_slot.ptr,
                          .evict_row = evict_row.ptr};
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = he_cache_plan_batch(self->c, unique.ptr, num_unique, &plan);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    return Py_BuildValue("(LL)", (long long)plan.num_fetch, (long long)plan.num_evict);
}

static PyObject *heb_cache_slots_of(heb_cache *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"rows", "count", "slots", NULL};
    HEB_ADDRESS(rows);
    HEB_ADDRESS(slots);
    long long count;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O&LO&:slots_of", kwlist, heb_address_converter, &rows, &count,
                                     heb_address_converter, &slots))
        return NULL;
    he_status st;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = he_cache_slots_of(self->c, rows.ptr, count, slots.ptr);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != HE_OK)
        return heb_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *heb_cache_stats(heb_cache *self, void *closure)
{
    (void)closure;
    he_cache_stats s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = he_cache_get_stats(self->c);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{sLsLsLsLsLsL}", "batches", (long long)s.batches, "rows", (long long)s.rows, "hits",
                         (long long)s.hits, "fetches", (long long)s.fetches, "evictions", (long long)s.evictions,
                         "bypassed", (long long)s.bypassed);
}

static PyObject *heb_cache_capacity(heb_cache *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(he_cache_capacity(self->c));
}

static PyMethodDef heb_cache_methods[] = {
    {"plan", HEB_KW_FUNC(heb_cache_plan), METH_VARARGS | METH_KEYWORDS,
     "plan(*, unique, num_unique, slot, fetch_row, fetch_slot, fetch_after_update, evict_slot, evict_row)\n--\n\n"
     "Plans a batch whose unique rows (num_unique ascending int64 at `unique`) must be cached: writes each "
     "row's slot (int32, -1: bypassed), the fetches (int64 rows, int32 slots, uint8 flags) and the evictions "
     "(int32 slots, int64 rows), each array room for num_unique -> (fetches, evictions)"},
    {"slots_of", HEB_KW_FUNC(heb_cache_slots_of), METH_VARARGS | METH_KEYWORDS,
     "slots_of(*, rows, count, slots)\n--\n\n"
     "slots[i] (int32) = the slot holding rows[i] (int64), or -1; IndexError for a row outside the table"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef heb_cache_getset[] = {
    {"stats", (getter)heb_cache_stats, NULL, "counts since the planner was made", NULL},
    {"capacity", (getter)heb_cache_capacity, NULL, "slots", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject heb_cache_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hostembed._core._C.CachePlanner",
    .tp_doc = "CachePlanner(*, num_rows, capacity, protect, policy)\n--\n\n"
              "The row cache's planner: which rows are in which of `capacity` slots; protect 1 (plans made "
              "after the last step) or 2 (a step ahead); policy CACHE_FREQUENCY or CACHE_CLOCK",
    .tp_basicsize = sizeof(heb_cache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = heb_cache_new,
    .tp_dealloc = (destructor)heb_cache_dealloc,
    .tp_getset = heb_cache_getset,
    .tp_methods = heb_cache_methods,
};

int heb_cache_add(PyObject *module)
{
    if (PyType_Ready(&heb_cache_type) < 0)
        return -1;
    Py_INCREF(&heb_cache_type);
    if (PyModule_AddObject(module, "CachePlanner", (PyObject *)&heb_cache_type) < 0) {
        Py_DECREF(&heb_cache_type);
        return -1;
    }
    if (PyModule_AddIntConstant(module, "CACHE_CLOCK", HE_CACHE_CLOCK) < 0 ||
        PyModule_AddIntConstant(module, "CACHE_FREQUENCY", HE_CACHE_FREQUENCY) < 0)
        return -1;
    return 0;
}
