/* kvstrata.impl._native, part 2: store key texts for a batch of pages (issue 20).
 *
 * join_keys(prefixes, pages, page_type) renders what KeySpace.rendered renders in Python: for each
 * page, in order, and for each prefix, in order, the text prefix + the page digest as 64 lowercase
 * hex digits (page-major). It makes each text once, straight into a new str, where Python makes the
 * hex text and then a second string per key. It answers None, having made nothing the caller keeps,
 * whenever the Python path must decide instead: pages that are not a list or a tuple, a page that
 * is not a `page_type`, a digest that is not 32 bytes, a prefix that is not an ASCII str. tests/unit/impl/test_kernels.py holds it to the
 * Python rendering. No global mutable state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_native_keys.h"

#define DIGEST 32

static const char HEX[] = "0123456789abcdef";

static PyObject *join_pages(PyObject *prefixes, PyObject *const *pages, Py_ssize_t count,
                            PyTypeObject *page_type, PyObject *digest_name) {
    Py_ssize_t width = PyTuple_GET_SIZE(prefixes);
    if (width && count > PY_SSIZE_T_MAX / width) return PyErr_NoMemory();
    PyObject *texts = PyList_New(count * width);
    if (texts == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyObject_TypeCheck(pages[i], page_type)) goto fall_back;
        PyObject *digest = PyObject_GetAttr(pages[i], digest_name);
        if (digest == NULL) goto failed;
        if (!PyBytes_CheckExact(digest) || PyBytes_GET_SIZE(digest) != DIGEST) {
            Py_DECREF(digest);
            goto fall_back;
        }
        char hex[2 * DIGEST];
        const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(digest);
        for (int b = 0; b < DIGEST; b++) {
            hex[2 * b] = HEX[bytes[b] >> 4];
            hex[2 * b + 1] = HEX[bytes[b] & 15];
        }
        Py_DECREF(digest);
        for (Py_ssize_t j = 0; j < width; j++) {
            PyObject *prefix = PyTuple_GET_ITEM(prefixes, j);
            Py_ssize_t length = PyUnicode_GET_LENGTH(prefix);
            PyObject *text = PyUnicode_New(length + 2 * DIGEST, 127);
            if (text == NULL) goto failed;
            Py_UCS1 *out = PyUnicode_1BYTE_DATA(text);
            memcpy(out, PyUnicode_1BYTE_DATA(prefix), (size_t)length);
            memcpy(out + length, hex, 2 * DIGEST);
            PyList_SET_ITEM(texts, i * width + j, text);
        }
    }
    return texts;
fall_back:
    Py_DECREF(texts);
    Py_RETURN_NONE;
failed:
    Py_DECREF(texts);
    return NULL;
}

PyObject *join_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "join_keys(prefixes, pages, page_type) takes 3");
        return NULL;
    }
    PyObject *prefixes = args[0];
    if (!PyTuple_Check(prefixes) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "join_keys: prefixes must be a tuple, page_type a type");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(prefixes); j++) {
        PyObject *prefix = PyTuple_GET_ITEM(prefixes, j);
        if (!PyUnicode_Check(prefix) || !PyUnicode_IS_ASCII(prefix)) Py_RETURN_NONE;
    }
    /* The pages as a tuple of our own: a page's `digest` may run Python code (a subclass's
     * property), which must not be able to change or free what the loop walks. Anything but a
     * list or a tuple (a generator, say, that the loop would use up) is left to Python. */
    PyObject *items;
    if (PyTuple_CheckExact(args[1])) {
        items = args[1];
        Py_INCREF(items);
    } else if (PyList_CheckExact(args[1])) {
        items = PyList_AsTuple(args[1]);
        if (items == NULL) return NULL;
    } else {
        Py_RETURN_NONE;
    }
    PyObject *digest_name = PyUnicode_InternFromString("digest");
    PyObject *texts = NULL;
    if (digest_name != NULL) {
        texts = join_pages(prefixes, PySequence_Fast_ITEMS(items), PyTuple_GET_SIZE(items),
                           (PyTypeObject *)args[2], digest_name);
        Py_DECREF(digest_name);
    }
    Py_DECREF(items);
    return texts;
}
