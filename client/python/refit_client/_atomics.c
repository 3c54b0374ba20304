/* Ordered loads for reading an attached arena's header (its seqlock).
 *
 * The daemon bumps the header's seq to odd, copies a version's bytes, writes
 * the version, then bumps seq to even with release ordering. A reader that
 * checks seq before and after its reads needs its own ordering: the first
 * seq load must come before the data loads, and the data loads before the
 * second seq load. x86-64 keeps loads in order; AArch64 (Grace hosts) does
 * not, and Python's struct module reads a 64-bit field byte by byte.
 *
 * load_acquire(buffer, offset): the aligned 64-bit little-endian word at
 *   offset, loaded whole, after a read fence (every earlier load completes
 *   first) and with acquire ordering (no later load moves before it).
 *
 * Optional: where the module was not built (no C compiler), refit_client
 * reads the header with struct, which is ordered on x86-64 only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

static PyObject *atomics_load_acquire(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer buf;
  Py_ssize_t offset;
  if (!PyArg_ParseTuple(args, "y*n:load_acquire", &buf, &offset)) return NULL;
  PyObject *result = NULL;
  if (offset < 0 || offset > buf.len - 8) {
    PyErr_Format(PyExc_IndexError, "load_acquire: offset %zd is outside a %zd-byte buffer",
                 offset, buf.len);
  } else if (((uintptr_t)buf.buf + (uintptr_t)offset) % 8 != 0) {
    PyErr_Format(PyExc_ValueError, "load_acquire: offset %zd is not 8-byte aligned in memory",
                 offset);
  } else {
    const uint64_t *word = (const uint64_t *)((const char *)buf.buf + offset);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    value = __builtin_bswap64(value);
#endif
    result = PyLong_FromUnsignedLongLong(value);
  }
  PyBuffer_Release(&buf);
  return result;
}

static PyMethodDef atomics_methods[] = {
    {"load_acquire", atomics_load_acquire, METH_VARARGS,
     "load_acquire(buffer, offset): the aligned little-endian uint64 at offset, after a read "
     "fence and with acquire ordering."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "refit_client._atomics",
    .m_doc = "Ordered loads for reading an attached arena's header.",
    .m_size = -1,
    .m_methods = atomics_methods,
};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&atomics_module); }
